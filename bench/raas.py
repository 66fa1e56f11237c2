"""RaaS node throughput on CPU: rollouts/s, tokens/s and time to first token, beside plain transformers.

Runs, in one process and one run, on the tiny model with `--tokens` new tokens a rollout:

* single-sample tasks (`rlvr`, n = 1): a RaasNode serving `--tasks` tasks from a real Kafka (the
  local broker unless --bootstrap), its torch engine in its own process (as `astraflow raas
  serve` runs it), at max-inflight 1, 4 and 16; beside the same prompts through a plain
  transformers loop (`model.generate`, KV cache) one at a time and batched 16 at a time;
* grouped tasks (n = `--group`, GRPO-style: every sample of a task shares its prompt): the node
  at max-inflight 16, beside `model.generate(num_return_sequences=n)` on 16 / n prompts a batch;
* both workloads through the node's engine alone (`SlotEngine`, 16 rows, every request queued at
  once, stepped in this process): what is lost between it and the node is the node's (its
  loop, the IPC to the engine process, Kafka), not the engine's.

Same model, prompts, sampling (temperature 1, no top-k/top-p), token budget and torch threads
(`--threads`, default 1) on both sides.
The plain loop is forced to `--tokens` tokens (`min_new_tokens`); the node stops a rollout at
eos like any rollout, so the comparison is made on tokens/s (the random tiny model rarely
samples eos: the mean lengths are printed). Time to first token (TTFT): from the moment a
request reaches the engine (node) or its batch's `generate` call starts (plain) to its first
sampled token. For the node, the engine's own counters: rows sampled per decoding step (16 is a
full batch) and the share of the measured time it spent stepping (the rest it waited for
requests). Usage: python bench/raas.py [--quick] [--json OUT]

`--backend vllm` (in the virtualenv of scripts/vllm-env.sh) measures instead a node over vLLM
against vLLM's own offline `LLM.generate` and against the node over the torch engine
(`_raas_vllm.py`; key `node_vs_offline_ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import write_json

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import SamplingParams
from astraflow.testing import make_task

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "a RaaS node serving tasks from Kafka, its torch engine in its own process",
    "against": "plain transformers model.generate on the same prompts (batched by 16; num_return_sequences for groups)",
    "settings": "the tiny model, 32 new tokens, temperature 1, one torch thread each; ratios of tokens/s",
}


@dataclass
class Row:
    setup: str
    rollouts: int
    tokens: int
    seconds: float
    ttft_ms: float  # mean submit -> first token
    mean_batch: float | None = None  # node: rows sampled per engine step
    busy: float | None = None  # node: share of the measured time the engine spent stepping

    @property
    def rollouts_per_s(self) -> float:
        return self.rollouts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def node_run(kafka: KafkaSettings, model: Path, tasks: int, tokens: int, inflight: int, group: int, threads: int) -> Row:
    exp = f"bench-raas-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(kafka)
    specs = topic_specs(exp, ["policy"], AstraflowConfig().topics)
    admin.create(specs)
    try:
        producer = RecordProducer(kafka)
        for i in range(tasks):
            t = make_task(i, n_samples=group)
            t.sampling = SamplingParams(temperature=1.0, max_tokens=tokens)
            producer.send(Topics(exp).tasks, t, key=t.group_id)
        producer.flush()
        backend = TorchBackend("policy", str(model), seed=0, max_batch=16, threads=threads, process=True)
        node = RaasNode(AstraflowConfig(kafka=kafka), NodeSettings(exp, max_inflight=inflight, metrics_interval_s=3600),
                        {"policy": backend}, tools={})

        async def main() -> float:
            run = asyncio.create_task(node.run())
            while node.inflight == 0 and node.tasks_done == 0:  # group join is not throughput
                await asyncio.sleep(0.001)
            t0 = time.perf_counter()
            while node.tasks_done < tasks:
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - t0
            node.stop()
            await run
            return elapsed

        elapsed = asyncio.run(main())
        ttft = statistics.fmean(backend.ttft_s) * 1000
        stats = backend.stats()  # as of the last result
        backend.close()
        label = f"node max-inflight {inflight}" + (f", groups of {group}" if group > 1 else "")
        return Row(label, tasks * group, stats["tokens_generated"], elapsed, ttft,
                   stats["rows_sampled"] / max(1, stats["steps"]), stats["busy_us"] / 1e6 / elapsed)
    finally:
        admin.delete([s.name for s in specs])


def engine_run(model_dir: Path, tasks: int, tokens: int, group: int, threads: int) -> Row:
    """The slot engine alone, in this process, stepped in a loop with `max_batch` 16 and every
    request queued at once: what the node's engine can do without the node, IPC or Kafka."""
    from astraflow.raas.backends.base import GenerateRequest
    from astraflow.raas.backends.slots import load_engine

    engine, _ = load_engine(str(model_dir), max_batch=16, cache_slots=None, device=None, version=0, seed=0,
                            threads=threads, max_cache_lag=0)
    prompts = [engine.tokenizer.encode(make_task(i).prompt, add_special_tokens=True) for i in range(tasks)]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for k in range(group):
            engine.submit(i * group + k, GenerateRequest(list(p), tokens, temperature=1.0))
    ttfts = []
    while engine.has_work():
        ttfts += [f.ttft_s for f in engine.step()]
    elapsed = time.perf_counter() - t0
    label = "engine alone, 16 rows (no node, IPC, Kafka)" + (f", groups of {group}" if group > 1 else "")
    return Row(label, tasks * group, engine.tokens_generated, elapsed, statistics.fmean(ttfts) * 1000,
               engine.rows_sampled / max(1, engine.steps), engine.busy_s / elapsed)


def plain_run(model_dir: Path, tasks: int, tokens: int, batch: int, group: int, threads: int) -> Row:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        """Records when a batch's first token is sampled."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [make_task(i).prompt for i in range(tasks)]
    tok.padding_side = "left"
    per_call = max(1, batch // group)  # prompts a generate call
    generated, ttfts = 0, []
    t0 = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, tasks, per_call):
            enc = tok(prompts[lo : lo + per_call], return_tensors="pt", padding=True)
            first = FirstToken()
            start = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=0,
                                 num_return_sequences=group, pad_token_id=tok.pad_token_id,
                                 logits_processor=LogitsProcessorList([first]))
            generated += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
            ttfts += [(first.at or start) - start] * out.shape[0]
    elapsed = time.perf_counter() - t0
    label = f"plain transformers, batch {batch}" + (f" ({per_call} prompts x {group})" if group > 1 else "")
    return Row(label, tasks * group, generated, elapsed, statistics.fmean(ttfts) * 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tasks")
    ap.add_argument("--json", default=None, help="default bench/results/[quick/]raas.json")
    ap.add_argument("--bootstrap", default=None, help="Kafka to use (default: the local one, started if needed)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per rollout")
    ap.add_argument("--group", type=int, default=8, help="samples per task of the grouped case")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the engine and of the plain loop (1: a shared 2-core machine)")
    ap.add_argument("--backend", choices=("torch", "vllm"), default="torch",
                    help="vllm: the node over vLLM vs vLLM offline and vs the torch engine (_raas_vllm.py)")
    ap.add_argument("--inflight", type=int, default=256,
                    help="--backend vllm: the vLLM node's max-inflight (256: every task at once, as offline vLLM gets them)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="--backend vllm: alternated node/offline pairs (default 5; --quick 3)")
    args = ap.parse_args()
    tasks = 48 if args.quick else 160
    grouped = max(2, tasks // args.group)
    if args.bootstrap:
        kafka = KafkaSettings(bootstrap_servers=args.bootstrap)
    else:
        from astraflow.kafka.local import LocalKafka

        local = LocalKafka()
        local.up(echo=lambda *_: None)
        kafka = KafkaSettings(bootstrap_servers=local.bootstrap)
    if args.backend == "vllm":
        import _raas_vllm

        _raas_vllm.main(kafka, 64 if args.quick else 256, args.tokens, args.inflight, args.json, args.quick,
                        args.repeats or (3 if args.quick else 5))
        return
    from astraflow.models.tiny import init_tiny

    model = init_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    rows = [node_run(kafka, model, tasks, args.tokens, inflight, 1, args.threads) for inflight in (1, 4, 16)]
    rows += [plain_run(model, tasks, args.tokens, batch, 1, args.threads) for batch in (1, 16)]
    rows.append(node_run(kafka, model, grouped, args.tokens, 16, args.group, args.threads))
    rows.append(plain_run(model, grouped, args.tokens, 16, args.group, args.threads))
    rows += [engine_run(model, tasks, args.tokens, 1, args.threads),
             engine_run(model, grouped, args.tokens, args.group, args.threads)]
    print(f"{'setup':<44} {'rollouts/s':>10} {'tokens/s':>9} {'mean len':>8} {'TTFT ms':>8} {'rows/step':>9} {'busy':>5}")
    for r in rows:
        engine = "" if r.mean_batch is None else f" {r.mean_batch:>9.1f} {r.busy:>5.0%}"
        print(f"{r.setup:<44} {r.rollouts_per_s:>10.1f} {r.tokens_per_s:>9.0f} {r.tokens / r.rollouts:>8.1f} "
              f"{r.ttft_ms:>8.1f}{engine}")
    single = rows[2].tokens_per_s / rows[4].tokens_per_s
    group = rows[5].tokens_per_s / rows[6].tokens_per_s
    print(f"node (max-inflight 16) vs plain batched generate, tokens/s: single-sample {single:.2f}x, "
          f"groups of {args.group} {group:.2f}x")
    engine_single, engine_group = rows[7].tokens_per_s / rows[4].tokens_per_s, rows[8].tokens_per_s / rows[6].tokens_per_s
    print(f"engine alone vs plain batched generate, tokens/s: single-sample {engine_single:.2f}x, "
          f"groups of {args.group} {engine_group:.2f}x")
    write_json(args.json, "raas", {
        "tasks": tasks, "threads": args.threads, "grouped_tasks": grouped, "group": args.group, "new_tokens": args.tokens,
        "rows": [{"setup": r.setup, "rollouts_per_s": r.rollouts_per_s, "tokens_per_s": r.tokens_per_s,
                  "mean_new_tokens": r.tokens / r.rollouts, "ttft_ms": r.ttft_ms, "engine_rows_per_step": r.mean_batch,
                  "engine_busy_share": r.busy} for r in rows],
        "ratio_node16_vs_plain_batched_tokens": single, "ratio_grouped_node16_vs_plain_tokens": group,
        "ratio_engine_vs_plain_batched_tokens": engine_single, "ratio_grouped_engine_vs_plain_tokens": engine_group},
        terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
