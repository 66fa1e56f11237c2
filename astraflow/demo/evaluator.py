"""Held-out evaluation that follows a policy's weights topic, like a RaaS node would.

Evaluates the starting weights, then each newly applied version (at most one evaluation per
`min_interval_s`, always the newest version), greedy, with the same tool protocol as the
`tool_use` workflow. Publishes `Metric(name="eval_success", component="eval",
labels={"version": ...})` to the metrics topic.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path

import torch

from astraflow.config import AstraflowConfig
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import Metric
from astraflow.weights.publish import KafkaWeightFollower

log = logging.getLogger("astraflow.eval")


def load_heldout(path: Path) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs from the JSONL the demo writes."""
    from astraflow.models.arith import reference_answer

    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append((row["prompt"], reference_answer(row["reference"])))
    return out


def evaluate(model, tokenizer, items: list[tuple[str, str]], batch: int = 64) -> float:
    from astraflow.models.arith import answers_match, parse_answer
    from astraflow.models.evaluate import run_tool_use

    correct = 0
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        outs = run_tool_use(model, tokenizer, [p for p, _ in chunk], temperature=0.0)
        correct += sum(answers_match(parse_answer(text), ref) for (text, _), (_, ref) in zip(outs, chunk, strict=True))
    return correct / max(len(items), 1)


def run_evaluator(cfg: AstraflowConfig, experiment: str, policy: str, model_dir: str, heldout: Path,
                  min_interval_s: float = 20.0, threads: int = 1) -> None:
    from astraflow.models.tiny import load_tiny

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    model, tokenizer = load_tiny(model_dir)
    model.eval()
    items = load_heldout(heldout)
    topics = Topics(experiment)
    producer = RecordProducer(cfg.kafka)
    follower = KafkaWeightFollower(cfg.kafka, experiment, policy, request_snapshots=False, requester="eval")
    follower.start()

    def publish(version: int, success: float) -> None:
        producer.send(topics.metrics, Metric("eval_success", success, "eval", f"eval-{policy}",
                                             {"version": str(version), "policy": policy, "n": str(len(items))}),
                      key=f"eval-{policy}")
        producer.flush()
        log.info("version %d: held-out success %.3f on %d problems", version, success, len(items))

    with torch.no_grad():
        publish(0, evaluate(model, tokenizer, items))
    evaluated = 0
    last = time.monotonic()
    while not stop.is_set():
        follower.poll(timeout_s=0.5)
        version = follower.follower.version
        if version is None or version <= evaluated or time.monotonic() - last < min_interval_s:
            continue
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in follower.follower.state.items():
                if name in params:
                    params[name].copy_(value.to(params[name].dtype))
            publish(int(version), evaluate(model, tokenizer, items))
        evaluated, last = int(version), time.monotonic()
    follower.close()
    producer.flush()
