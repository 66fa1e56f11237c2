"""Bad input, as an outside client writes it, into the live pipeline: what each component answers.

    python bench/bad_inputs.py [--port 22200]

Starts the fault harness's pipeline (`_harness.Harness`: its own broker, curator, reward,
curate, trainer, two RaaS nodes) and, with a plain producer that knows nothing of the roles,
writes crafted records to the topics they read: random bytes, a record of another schema, a
Task naming a workflow outside the allow-list, Tasks with out-of-range values, a weight
version whose payload does not match its hash and one declaring a terabyte, train samples with
token ids past the vocabulary or a NaN advantage, an unscored trajectory. Each record's key
names the case. Then it resumes the curator, waits for the work to drain, and prints, per
case, what came back in the DLQ (component, error class, reason) and whether every role is
still running and the pipeline trained every issued task.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time
import uuid

from _harness import Harness

from astraflow.records import DeadLetter, PolicyVersion, SamplingParams, Task, TrainSample, WeightKind
from astraflow.weights.publish import split_chunks
from astraflow.weights.store import sha256_hex


def tasks(good: Task) -> list[tuple[str, Task | bytes]]:
    def t(case: str, **kw: object) -> tuple[str, Task]:
        sampling = kw.pop("sampling", good.sampling)
        return case, dataclasses.replace(good, task_id=f"bad-{case}", group_id=f"bad-{case}", sampling=sampling, **kw)

    s = good.sampling
    return [
        ("tasks: random bytes", os.urandom(200)),
        ("tasks: single-object header, unknown fingerprint", b"\xc3\x01" + os.urandom(8) + os.urandom(50)),
        t("tasks: workflow os:system", workflow="os:system"),
        t("tasks: workflow builtins:exec", workflow="builtins:exec"),
        t("tasks: unknown workflow name", workflow="no_such_workflow"),
        t("tasks: n_samples 1e6", n_samples=1_000_000),
        t("tasks: max_tokens 1e9", sampling=dataclasses.replace(s, max_tokens=1_000_000_000)),
        t("tasks: temperature NaN", sampling=dataclasses.replace(s, temperature=math.nan)),
        t("tasks: temperature -1", sampling=dataclasses.replace(s, temperature=-1.0)),
        t("tasks: top_p 2", sampling=dataclasses.replace(s, top_p=2.0)),
        t("tasks: max_turns 1e6", sampling=dataclasses.replace(s, max_turns=1_000_000)),
        t("tasks: 300k-character prompt", prompt="1+1=" * 75_000),
        t("tasks: unknown policy", policies=["nobody"]),
    ]


def train_samples() -> list[tuple[str, TrainSample | bytes]]:
    import numpy as np

    def s(case: str, ids: list[int], advantage: float = 1.0) -> tuple[str, TrainSample]:
        n = len(ids)
        return case, TrainSample(f"bad-{case}/0#policy", f"bad-{case}/0", f"bad-{case}", "p", "policy",
                                 np.array(ids, np.int32), np.ones(n, np.uint8), np.full(n, -0.5, np.float32),
                                 np.zeros(n, np.int32), advantage, 1.0, 0)

    return [("train: random bytes", os.urandom(300)), s("train: token id 10^6 (past the vocabulary)", [1, 2, 1_000_000]),
            s("train: negative token id", [1, -5, 2]), s("train: NaN advantage", [1, 2, 3], math.nan)]


def weights(version: int) -> list[tuple[str, object]]:
    payload = os.urandom(4096)
    out: list[tuple[str, object]] = []
    chunks = split_chunks("policy", version, payload, 1024)
    lie = PolicyVersion("policy", version, WeightKind.SNAPSHOT, "float32", len(chunks), len(payload), "0" * 64, "0" * 64, 0, 0)
    out += [("weights: payload whose sha256 does not match", lie), *(("weights: -its chunks", c) for c in chunks)]
    huge = PolicyVersion("policy", version + 1, WeightKind.SNAPSHOT, "float32", 1, 10**12, sha256_hex(payload[:1024]),
                         "0" * 64, 0, 0)
    out += [("weights: declares 10^12 bytes", huge), ("weights: -its chunk", split_chunks("policy", version + 1, payload[:1024], 1024)[0])]
    return out


def main(argv: list[str] | None = None) -> int:
    from faults import parse_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=22200)
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long the curator runs after the bad records")
    own = ap.parse_args(argv)
    args = parse_args(["--port", str(own.port), "--phase-s", str(own.settle_s)])
    h = Harness(args)
    try:
        h.setup()
        from confluent_kafka import Producer

        from astraflow.serde import AvroSerde

        serde = AvroSerde(max_record_bytes=64 * 1024 * 1024)
        prod = Producer({**h.cfg.kafka.client_config(), "message.max.bytes": 16 * 1024 * 1024})
        good = Task("x", "x", "p", "arith", "rlvr", "1+1=", ["policy"], 4, None, SamplingParams(max_tokens=8))
        run = uuid.uuid4().hex[:6]
        sent: list[tuple[str, str]] = []  # (key, topic)
        for topic, cases in ((h.topics.tasks, tasks(good)), (h.topics.train("policy"), train_samples()),
                             (h.topics.weights("policy"), weights(10_000)),
                             (h.topics.rollouts, [("rollouts: random bytes", os.urandom(100))]),
                             (h.topics.scored, [("scored: random bytes", os.urandom(100))])):
            for case, rec in cases:
                key = "policy" if topic == h.topics.weights("policy") else f"{case} [{run}]"
                value = rec if isinstance(rec, bytes) else serde.dumps(rec)
                prod.produce(topic, value, key.encode())
                if "-its chunk" not in case:
                    sent.append((case, topic))
        prod.flush(30)
        phase = h.run_phase("bad-inputs", [])
        time.sleep(10)
        from _ledger import TopicReader

        dlq = [r for r, _ in TopicReader(h.cfg.kafka, h.topics.dlq).read(60) if isinstance(r, DeadLetter)]
        print(f"\n{'case':52} {'component':10} answer")
        weights_topic = h.topics.weights("policy")
        for case, topic in sent:
            if topic == weights_topic:  # keyed by policy, like the trainer's: the reason tells them apart
                version = 10_000 + ("10^12" in case)
                hits = [d for d in dlq if d.topic == topic and f"version {version} " in d.error]
            else:
                hits = [d for d in dlq if (d.original_key or b"").decode(errors="replace").startswith(case)]
            for d in hits[:2] or [None]:
                print(f"{case:52} {d.component if d else '-':10} "
                      f"{(d.error_class + ': ' + d.error[:160].replace(chr(10), ' ')) if d else 'no dead letter'}")
        alive = {name: role.proc.poll() is None for name, role in h.roles.items()}
        t = h.ledger.tally(h.ledger.tasks.values())
        print(f"\nroles running: {alive}; exits: {phase.exits}")
        print(f"issued {t.tasks_issued} tasks, {t.tasks_trained} trained, {t.lost} samples lost; drained {phase.drained}")
        return 0 if all(alive.values()) and not phase.exits and t.lost == 0 else 1
    finally:
        h.close()
        shutil.rmtree(h.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
