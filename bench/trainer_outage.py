"""The trainer through a broker outage longer than librdkafka's 5-minute message timeout.

Starts a private local Kafka (its own ports and data directory, stopped at the end), writes
train samples (and one bad record, so a dead letter is pending), starts `astraflow train`, stops
the broker as soon as the first version with trained samples is published, keeps it down for
`--outage-s` seconds while the trainer goes on with what it had fetched (and then waits to
publish, dead-letter and send metrics), restarts the broker, writes more samples and checks:
the trainer never exited, every good sample is in the trained-sample log exactly once, and
every committed version number has one state checksum.

    python bench/trainer_outage.py [--outage-s 330] [--port 19792]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage-s", type=float, default=330.0, help="how long the broker stays down")
    ap.add_argument("--port", type=int, default=19792, help="private broker port (controller: port + 1)")
    ap.add_argument("--samples", type=int, default=48, help="samples before the outage (as many after)")
    args = ap.parse_args(argv)

    import numpy as np

    from astraflow.config import KafkaSettings, LocalKafkaSettings, TopicSettings
    from astraflow.kafka.clients import RecordProducer
    from astraflow.kafka.local import LocalKafka
    from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
    from astraflow.models.tiny import init_tiny
    from astraflow.records import PolicyVersion, TrainSample
    from tests.integration.test_trainer_resume import _read

    work = Path(tempfile.mkdtemp(prefix="af-outage-"))
    broker = LocalKafka(LocalKafkaSettings(data_dir=work / "kafka", port=args.port, controller_port=args.port + 1))
    quiet = lambda *_: None  # noqa: E731
    broker.up(echo=quiet)
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    exp, topics = "outage", Topics("outage")
    TopicAdmin(kafka).create(topic_specs(exp, ["policy"], TopicSettings(partitions=2)))
    model = init_tiny(work / "tiny", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512)
    rng = np.random.default_rng(0)

    def samples(first: int, n: int) -> list[TrainSample]:
        out = []
        for i in range(first, first + n):
            length, gen = 48, 16
            mask = np.r_[np.zeros(length - gen, np.uint8), np.ones(gen, np.uint8)]
            out.append(TrainSample(f"s-{i}", f"t-{i}", f"g-{i // 4}", "p", "policy",
                                   rng.integers(3, 600, length, dtype=np.int32), mask,
                                   np.where(mask == 1, -3.0, 0).astype(np.float32),
                                   np.where(mask == 1, 0, -1).astype(np.int32), float(rng.normal()), 0.5, 0))
        return out

    def send(batch: list[TrainSample], poison: bool = False) -> None:
        producer = RecordProducer(kafka)
        for k, s in enumerate(batch):
            producer.send(topics.train("policy"), s, key=s.group_id)
            if poison and k == len(batch) // 2:
                producer.send_raw(topics.train("policy"), b"\xffnot a sample", key="bad")
        producer.flush()

    send(samples(0, args.samples), poison=True)
    log = work / "runs" / exp / "policy" / "trained-samples.jsonl"
    sets = [f"kafka.bootstrap_servers={broker.bootstrap}", f"run_dir={work / 'runs'}", "topics.partitions=2",
            "trainer.batch_size=4", "trainer.max_wait_s=0.5", "trainer.stop_when_idle_s=60",
            "trainer.max_staleness=null",  # the synthetic samples all claim version 0
            "trainer.logger=none", "trainer.progress_bar=false"]
    cmd = [sys.executable, "-m", "astraflow_cli.main", "train", "-e", exp, "-p", "policy", "-m", str(model)]
    for s in sets:
        cmd += ["--set", s]
    out_file = open(work / "trainer.out", "w")  # noqa: SIM115 - the child's output
    proc = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while not (log.exists() and log.read_text().strip()):
            if proc.poll() is not None:
                raise SystemExit(f"trainer exited before the outage: {(work / 'trainer.out').read_text()[-2000:]}")
            time.sleep(0.1)
        broker.down(echo=quiet)
        down_at = time.monotonic()
        lines_at_down = len(log.read_text().splitlines())
        print(f"broker stopped; {lines_at_down} samples published so far; down for {args.outage_s:.0f} s")
        while time.monotonic() - down_at < args.outage_s:
            if proc.poll() is not None:
                raise SystemExit(f"FAIL: the trainer exited during the outage (rc {proc.returncode})")
            time.sleep(1.0)
        lines_in_outage = len(log.read_text().splitlines())
        broker.up(echo=quiet)
        print(f"broker back after {time.monotonic() - down_at:.0f} s; the trainer is alive "
              f"({lines_in_outage - lines_at_down} samples logged during the outage)")
        send(samples(args.samples, args.samples))
        rc = proc.wait(timeout=900)
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        per = collections.Counter(x["sample_id"] for x in lines)
        versions = collections.defaultdict(set)
        for r in _read(kafka, topics.weights("policy"), "read_committed"):
            if isinstance(r, PolicyVersion):
                versions[r.version].add(r.state_checksum)
        ok = (rc == 0 and len(per) == 2 * args.samples and max(per.values()) == 1
              and all(len(v) == 1 for v in versions.values()))
        print(f"trainer exit {rc}; {len(per)} of {2 * args.samples} samples trained, most per id {max(per.values())}; "
              f"{len(versions)} versions, all with one checksum: {all(len(v) == 1 for v in versions.values())}")
        print("OK" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out_file.close()
        broker.down(echo=quiet)


if __name__ == "__main__":
    sys.exit(main())
