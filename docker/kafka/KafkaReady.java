// Health probe of the compose Kafka: exits 0 when the broker answers a metadata request (a
// listening port is not enough: a KRaft broker accepts connections before it serves), 1 otherwise.
// Usage: java -cp '/opt/kafka/libs/*:/opt/kafka/probe' KafkaReady [bootstrap] [timeout_ms]
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeClusterOptions;

public final class KafkaReady {
    public static void main(String[] args) {
        String bootstrap = args.length > 0 ? args[0] : "localhost:9092";
        int timeoutMs = args.length > 1 ? Integer.parseInt(args[1]) : 5000;
        Properties props = new Properties();
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, timeoutMs);
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, timeoutMs);
        try (Admin admin = Admin.create(props)) {
            int nodes = admin.describeCluster(new DescribeClusterOptions().timeoutMs(timeoutMs)).nodes().get().size();
            System.exit(nodes > 0 ? 0 : 1);
        } catch (Exception e) {
            System.err.println("kafka not ready: " + e);
            System.exit(1);
        }
    }
}
