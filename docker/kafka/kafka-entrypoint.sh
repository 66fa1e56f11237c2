#!/usr/bin/env bash
# Entrypoint of the compose Kafka image: `start` writes server.properties from the environment,
# formats the KRaft storage once (idempotent) and runs the broker+controller in this process;
# `ready` is the health probe (a metadata request).
#
# Environment: KAFKA_CLUSTER_ID (required to start), KAFKA_NODE_ID (1), KAFKA_ADVERTISED
# (kafka:9092, the name other containers use), KAFKA_HOST_ADVERTISED (the host listener's
# advertised address, e.g. localhost:49092; no host listener when empty), KAFKA_HEAP_MB (768),
# and any broker property as KAFKA_CFG_<NAME> with dots as underscores
# (KAFKA_CFG_LOG_RETENTION_HOURS=24 -> log.retention.hours=24).
set -euo pipefail
LIBS=/opt/kafka/libs
DATA=/var/lib/kafka/data
CONF=/var/lib/kafka/server.properties
LOG4J=/etc/kafka/log4j2.properties

case "${1:-start}" in
  ready)
    exec java -Xmx64m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Dlog4j2.configurationFile=/etc/kafka/log4j2-probe.properties \
      -cp "$LIBS/*:/opt/kafka/probe" KafkaReady "localhost:9092" "${2:-5000}" ;;
  start) ;;
  *) exec "$@" ;;
esac

: "${KAFKA_CLUSTER_ID:?set KAFKA_CLUSTER_ID (22 characters, base64url of 16 bytes)}"
node=${KAFKA_NODE_ID:-1}
listeners="PLAINTEXT://:9092,CONTROLLER://:9093"
advertised="PLAINTEXT://${KAFKA_ADVERTISED:-kafka:9092}"
protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
if [ -n "${KAFKA_HOST_ADVERTISED:-}" ]; then
  listeners="$listeners,HOST://:29092"
  advertised="$advertised,HOST://$KAFKA_HOST_ADVERTISED"
  protocols="$protocols,HOST:PLAINTEXT"
fi
# The same settings as `astraflow kafka up` (astraflow/kafka/local.py) for one node.
{
  echo "process.roles=broker,controller"
  echo "node.id=$node"
  echo "controller.quorum.bootstrap.servers=localhost:9093"
  echo "listeners=$listeners"
  echo "advertised.listeners=$advertised"
  echo "listener.security.protocol.map=$protocols"
  echo "controller.listener.names=CONTROLLER"
  echo "inter.broker.listener.name=PLAINTEXT"
  echo "log.dirs=$DATA"
  echo "num.network.threads=2"
  echo "num.io.threads=2"
  echo "num.partitions=4"
  echo "default.replication.factor=1"
  echo "min.insync.replicas=1"
  echo "offsets.topic.num.partitions=8"
  echo "offsets.topic.replication.factor=1"
  echo "transaction.state.log.num.partitions=4"
  echo "transaction.state.log.replication.factor=1"
  echo "transaction.state.log.min.isr=1"
  echo "share.coordinator.state.topic.replication.factor=1"
  echo "share.coordinator.state.topic.min.isr=1"
  echo "unclean.leader.election.enable=false"
  echo "group.initial.rebalance.delay.ms=0"
  echo "group.min.session.timeout.ms=1000"  # RaaS nodes may ask for a short session (raas.group_session_timeout_s)
  echo "auto.create.topics.enable=false"
  echo "log.cleaner.dedupe.buffer.size=16777216"
  echo "message.max.bytes=67108864"
  echo "replica.fetch.max.bytes=67108864"
  echo "log.retention.check.interval.ms=60000"
  # KAFKA_CFG_* overrides (later lines win in a properties file).
  env | sed -n 's/^KAFKA_CFG_\([A-Z0-9_]*\)=\(.*\)$/\1=\2/p' | while IFS='=' read -r name value; do
    echo "$(echo "$name" | tr 'A-Z_' 'a-z.')=$value"
  done
} > "$CONF"

common=(-Dlog4j2.configurationFile="$LOG4J" -cp "$LIBS/*")
if [ ! -f "$DATA/meta.properties" ]; then
  echo "formatting KRaft storage in $DATA (cluster $KAFKA_CLUSTER_ID)"
  java -Xmx256m "${common[@]}" kafka.tools.StorageTool format --ignore-formatted --standalone \
    -t "$KAFKA_CLUSTER_ID" -c "$CONF"
fi
heap=${KAFKA_HEAP_MB:-768}
exec java "-Xms${heap}m" "-Xmx${heap}m" -XX:+UseG1GC -Djava.awt.headless=true "${common[@]}" kafka.Kafka "$CONF"
