"""Held-out evaluation that follows a policy's weights topic, like a RaaS node would.

Evaluates the starting weights, then each newly applied version (at most one evaluation per
`min_interval_s`, always the newest version), with the same tool protocol as the `tool_use`
workflow. Two figures per version go to the metrics topic (component "eval", label "version"):
`eval_success`, the success of the policy as it acts in rollouts (sampled at temperature 1, two
episodes per held-out problem), and `eval_success_greedy` (argmax decoding). A held-out row whose
reference is `yes` or `no` is a verifier's: success is then the share of right verdicts.
"""

from __future__ import annotations

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
from astraflow.weights.follow import KafkaWeightFollower
from astraflow.weights.layout import ModelLayout
from astraflow.weights.verify import FollowLimits

log = logging.getLogger("astraflow.eval")


def load_heldout(path: Path | str, split: str | None = None, preset: str | None = None,
                 columns: str | None = None) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs of a held-out dataset, read like the curator reads its own
    (`astraflow.data`: the JSONL the demo writes, or any file, directory and column mapping)."""
    from astraflow.data import DatasetSpec, load_prompts
    from astraflow.models.arith import reference_answer

    loaded = load_prompts([DatasetSpec(path, split=split, preset=preset, columns=columns)])
    return [(r.text, reference_answer(r.reference or "")) for r in loaded.rows]


def evaluate(model, tokenizer, items: list[tuple[str, str]], batch: int = 128, temperature: float = 0.0,
             repeats: int = 1) -> float:
    """Share of `items` (prompt, reference) answered right: a number for a solver's problem, or a
    verdict (`yes` / `no`) for a verifier's."""
    from astraflow.models.arith import answers_match, parse_answer
    from astraflow.models.evaluate import run_tool_use
    from astraflow.models.protocol import VERDICTS, parse_verdict

    items = items * repeats
    correct = 0
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        outs = run_tool_use(model, tokenizer, [p for p, _ in chunk], temperature=temperature)
        correct += sum(parse_verdict(text) == ref if ref in VERDICTS else answers_match(parse_answer(text), ref)
                       for (text, _), (_, ref) in zip(outs, chunk, strict=True))
    return correct / max(len(items), 1)


def run_evaluator(cfg: AstraflowConfig, experiment: str, policy: str, model_dir: str, heldout: Path,
                  min_interval_s: float = 20.0, threads: int = 1) -> None:
    from astraflow.metrics_export import serve_role
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
    follower = KafkaWeightFollower(cfg.kafka, experiment, policy, request_snapshots=False, requester="eval",
                                   limits=FollowLimits.from_settings(cfg.weights), layout=ModelLayout.of(model.state_dict()))
    follower.start()
    endpoint = serve_role(experiment, "eval", f"eval-{policy}")  # opt-in: ASTRAFLOW_METRICS_PORT

    def publish(version: int) -> None:
        with torch.no_grad():
            torch.manual_seed(version)
            sampled = evaluate(model, tokenizer, items, temperature=1.0, repeats=2)
            greedy = evaluate(model, tokenizer, items, temperature=0.0)
        labels = {"version": str(version), "policy": policy, "n": str(len(items))}
        for name, value in (("eval_success_greedy", greedy), ("eval_success", sampled)):
            m = Metric(name, value, "eval", f"eval-{policy}", labels)
            producer.send(topics.metrics, m, key=f"eval-{policy}")
            if endpoint is not None:
                endpoint.observe(m)
        producer.flush()
        log.info("version %d: held-out success %.3f sampled, %.3f greedy (%d problems)", version, sampled, greedy, len(items))

    publish(0)
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
        publish(int(version))
        evaluated, last = int(version), time.monotonic()
    follower.close()
    producer.flush()
    if endpoint is not None:
        endpoint.close()
