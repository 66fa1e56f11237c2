"""Builds the `faust.App` of a `StreamEngine`: settings, the agent, tables and timers.

Settings chosen for AstraFlow (and why):

* `store="memory://"`: tables live in memory and are rebuilt from their changelog topics when
  a worker takes a partition (RocksDB is not a dependency; state here is small: groups in
  assembly and recently emitted group ids).
* `processing_guarantee` from `EngineSettings.guarantee` (`exactly_once` by default) with
  `ExactTransactionManager` in place of Faust's (`stream_apps.transactions`).
* `topic_disable_leader=True`, `table_standby_replicas=0`, `web_enabled=False`: no extra topics,
  consumers or ports per worker.
* Broker outages: the consumer retries connections forever; requests time out after 40 s,
  the group session after `kafka.group_session_timeout_s` (6 s; heartbeat 1 s from the consumer
  thread, so a killed worker's partitions move within seconds); a produce or a transaction that fails after those timeouts crashes the app and
  `StreamEngine.run` rebuilds it every `restart_delay_s` until the broker is back, so the
  process never exits on its own.
* Changelog topics are as durable as the experiment's topics: `declare_changelogs` creates them
  before Faust would, with `topics.replication_factor` (unset: the cluster's
  `default.replication.factor`, which Faust cannot ask for: it would use 1) and
  `topics.min_insync_replicas`; Faust then finds them and creates nothing.
* Faust's per-record hand-over, lean: the fetch loop hands each record to the agent's queue
  without four tasks per record (`stream_apps.handover`, in `ExactConsumer`), and
  `App.create_event` uses the Event class looked up once, not through the settings per record.
* `producer_max_request_size` / `consumer_max_fetch_size` follow the serde's record limit,
  `producer_max_batch_size` is 1 MiB (aiokafka's 16 KiB default sends a 4,096-token
  trajectory alone in its request);
  `producer_compression_type` from `EngineSettings.compression`: **snappy** by default (aiokafka
  needs `cramjam` for it and for zstd, a dependency). aiokafka compresses each batch in the
  worker's own thread, the one that runs the agent (librdkafka does it in a thread of its own),
  so the agent waits while a batch compresses. On 4,096-token trajectories (53.6 kB,
  one core, cramjam 2.14, through aiokafka's own codec functions): snappy 10 us per record to
  compress and 17 us to decompress, for 0.64 of the bytes; zstd (aiokafka always asks for level
  3) 155 us and 36 us for 0.47; lz4 (aiokafka writes the frame format) 697 us and 12 us for
  0.60. Every reader of the apps' topics reads snappy: librdkafka (trainer, status, archive,
  RaaS nodes, the benchmarks' readers) has it built in, aiokafka (Faust's consumers, the
  changelogs at recovery) through cramjam. `zstd` is there for links where bytes cost more than
  the workers' CPU.
"""

from __future__ import annotations

import ssl
import time
from typing import TYPE_CHECKING, Any

from astraflow.errors import ConfigError

if TYPE_CHECKING:
    import faust

    from astraflow.config import KafkaSettings
    from stream_apps.engine_api import EngineApi


def broker_urls(kafka: KafkaSettings) -> list[str]:
    """`kafka://host:port` URLs of the bootstrap servers."""
    return [f"kafka://{h.strip()}" for h in kafka.bootstrap_servers.split(",") if h.strip()]


def credentials(kafka: KafkaSettings) -> Any:
    """Faust credentials for the configured security protocol (None for PLAINTEXT)."""
    import faust

    proto = kafka.security_protocol
    if proto == "PLAINTEXT":
        return None
    context = None
    if proto.endswith("SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_ca_location)
        if kafka.ssl_certificate_location:
            context.load_cert_chain(kafka.ssl_certificate_location, kafka.ssl_key_location)
    if proto == "SSL":
        return faust.SSLCredentials(context)
    if kafka.sasl_mechanism == "OAUTHBEARER":
        raise ConfigError("the stream apps (Faust/aiokafka) support SASL PLAIN and SCRAM, not OAUTHBEARER")
    password = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return faust.SASLCredentials(username=kafka.sasl_username, password=password, ssl_context=context,
                                 mechanism=kafka.sasl_mechanism)


def source_partitions(kafka: KafkaSettings, topic: str, wait_s: float = 10.0) -> int:
    """Partitions of `topic` (waits `wait_s` for a topic just created to show in the metadata)."""
    from astraflow.kafka.topics import TopicAdmin

    admin = TopicAdmin(kafka)
    deadline = time.monotonic() + wait_s
    while not (found := admin.list(topic).get(topic)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not found:
        raise ConfigError(f"topic {topic} does not exist; create the experiment's topics with `astraflow topics create`")
    return found


def declare_changelogs(engine: EngineApi, partitions: int) -> dict[str, str]:
    """Creates the changelog topics of the engine's tables (if missing) with the experiment's
    replication and min ISR; returns topic -> 'created' | 'exists'."""
    from mode.utils.times import want_seconds

    from astraflow.kafka.topics import TopicAdmin, TopicSpec

    topics = engine.settings.topics
    specs = []
    for table in engine.tables.values():
        changelog = table.changelog_topic
        on = (("compact", changelog.compacting), ("delete", changelog.deleting))
        config = {"cleanup.policy": ",".join(p for p, yes in on if yes) or "delete",
                  **{k: str(v) for k, v in (changelog.config or {}).items()}}
        if changelog.retention is not None:
            config["retention.ms"] = str(int(want_seconds(changelog.retention) * 1000))
        if topics.min_insync_replicas is not None:
            config["min.insync.replicas"] = str(topics.min_insync_replicas)
        specs.extend(TopicSpec(name, partitions, config) for name in changelog.topics)
    return TopicAdmin(engine.kafka).create(specs, topics.replication_factor) if specs else {}


def build_app(engine: EngineApi) -> faust.App:
    """A Faust app running `engine.handler` (call inside the event loop that will run it)."""
    import faust

    from stream_apps.codec import register
    from stream_apps.transactions import (
        ExactConsumer,
        ExactTransactionManager,
        TxTable,
        keep_queues_on_resume,
    )

    register(engine.serde)
    s = engine.settings
    partitions = s.source_partitions or (source_partitions(engine.kafka, engine.source) if engine.source else 1)
    conf: dict[str, Any] = dict(
        broker=broker_urls(engine.kafka),
        broker_credentials=credentials(engine.kafka),
        store="memory://",
        processing_guarantee=s.guarantee,
        autodiscover=False,
        client_only=engine.source is None,  # a source app (the curator) joins no consumer group
        web_enabled=False,
        topic_disable_leader=True,
        topic_partitions=partitions,
        table_standby_replicas=0,
        # Anything Faust still creates itself gets the configured factor (1 when unset).
        topic_replication_factor=s.topics.replication_factor or 1,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=s.commit_interval_s,
        broker_session_timeout=engine.kafka.group_session_timeout_s,
        broker_heartbeat_interval=engine.kafka.heartbeat_interval_s,
        # aiokafka refuses a session at or above its request timeout: keep the request timeout above it.
        broker_request_timeout=max(40.0, engine.kafka.group_session_timeout_s + 10.0),
        producer_request_timeout=40.0,
        broker_max_poll_interval=300.0,
        producer_acks=-1,
        producer_linger=0.005,
        producer_compression_type=None if s.compression == "none" else s.compression,
        producer_max_request_size=engine.serde.max_record_bytes + 64 * 1024,
        producer_max_batch_size=1024 * 1024,  # aiokafka's 16 KiB default puts one 50 KB trajectory per request
        consumer_max_fetch_size=max(4 * 1024 * 1024, engine.serde.max_record_bytes + 64 * 1024),
        stream_buffer_maxsize=512,
    )
    conf.update(s.faust_overrides)  # replaces any of the settings above
    app = faust.App(engine.group_id, **conf)
    app.astraflow_engine = engine  # type: ignore[attr-defined]
    # Faust looks its Event class up through the settings' descriptors for every record it hands
    # over (`App.create_event`): 18.9 us per record, against 1.3 us with the class kept here.
    event_cls = app.conf.Event
    app.create_event = lambda key, value, headers, message: event_cls(  # type: ignore[method-assign]
        app, key, value, headers, message)
    app.transport.TransactionManager = ExactTransactionManager  # type: ignore[misc]
    app.transport.Consumer = ExactConsumer  # type: ignore[misc]
    if s.guarantee == "exactly_once":  # at-least-once keeps Faust's flow control (no takeover guard there)
        keep_queues_on_resume(app)
    # Faust keeps transactional producers in class attributes shared by every app of the process.
    app.producer._transaction_producers = {}  # type: ignore[attr-defined]
    app.producer._trn_locks = {}  # type: ignore[attr-defined]
    for name in engine.handler.tables:
        engine.tables[name] = app.tables.add(TxTable(  # bytes keys and values: Faust's "raw" codec
            app, name=name, partitions=partitions, key_type=bytes, value_type=bytes, help=f"{engine.handler.name} state: {name}",
        ))
    declare_changelogs(engine, partitions)
    if engine.source:
        topic = app.topic(engine.source, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

        @app.agent(topic, name=f"{engine.group_id}.{engine.handler.name}")
        async def consume(stream: Any) -> None:
            async for event in stream.events():
                try:
                    await engine.handle_event(event)
                except Exception as exc:  # a Kafka-layer failure: the record stays unacked, the app restarts
                    engine.crash(exc)
                    raise

        async def revoked(sender: Any, revoked: Any, **_: Any) -> None:
            engine.on_revoked({tp.partition for tp in revoked if tp.topic == engine.source})

        app.on_partitions_revoked.connect(revoked)

    @app.timer(s.control_interval_s, name=f"{engine.group_id}.control")
    async def control() -> None:
        engine.refresh_control()

    @app.timer(engine.handler.tick_interval_s, name=f"{engine.group_id}.tick")
    async def tick() -> None:
        await engine.tick()

    @app.timer(s.commit_interval_s, name=f"{engine.group_id}.commit")
    async def commit() -> None:
        await engine.commit()

    @app.timer(s.metrics_interval_s, name=f"{engine.group_id}.metrics")
    async def metrics() -> None:
        if engine.started.is_set():
            await engine.publish_metrics()

    return app
