"""RaaS node throughput on CPU: rollouts/s and tokens/s against max-inflight, beside plain transformers.

Runs, in one process and one run: (1) a RaasNode serving `--tasks` single-turn tasks from a real
Kafka (the local broker unless --bootstrap) with the tiny model, for max-inflight 1, 4 and 16;
(2) the same number of generations of the same length with a plain transformers loop
(`model.generate`, KV cache) one request at a time, and batched 16 at a time. The ratio of the
node at max-inflight 16 to the batched plain loop shows what the node (Kafka, serde, workflow,
per-token logprobs and versions) costs. Usage: python bench/raas.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
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


def node_run(kafka: KafkaSettings, model: Path, tasks: int, tokens: int, inflight: int) -> tuple[float, int]:
    exp = f"bench-raas-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(kafka)
    specs = topic_specs(exp, ["policy"], AstraflowConfig().topics)
    admin.create(specs)
    try:
        producer = RecordProducer(kafka)
        for i in range(tasks):
            t = make_task(i, n_samples=1)
            t.sampling = SamplingParams(temperature=1.0, max_tokens=tokens)
            producer.send(Topics(exp).tasks, t, key=t.group_id)
        producer.flush()
        backend = TorchBackend("policy", str(model), seed=0, max_batch=16, threads=torch.get_num_threads())
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
        backend.close()
        return elapsed, backend.tokens_generated
    finally:
        admin.delete([s.name for s in specs])


def plain_run(model_dir: Path, n: int, tokens: int, batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [make_task(i).prompt for i in range(n)]
    tok.padding_side = "left"
    generated = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, n, batch):
            enc = tok(prompts[lo : lo + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=0,
                                 pad_token_id=tok.pad_token_id)
            generated += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return time.perf_counter() - t0, generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tasks")
    ap.add_argument("--json", default=None)
    ap.add_argument("--bootstrap", default=None, help="Kafka to use (default: the local one, started if needed)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per rollout")
    args = ap.parse_args()
    tasks = 48 if args.quick else 160
    if args.bootstrap:
        kafka = KafkaSettings(bootstrap_servers=args.bootstrap)
    else:
        from astraflow.kafka.local import LocalKafka

        local = LocalKafka()
        local.up(echo=lambda *_: None)
        kafka = KafkaSettings(bootstrap_servers=local.bootstrap)
    from astraflow.models.tiny import init_tiny

    model = init_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    rows = []
    for inflight in (1, 4, 16):
        secs, toks = node_run(kafka, model, tasks, args.tokens, inflight)
        rows.append((f"node max-inflight {inflight}", tasks / secs, toks / secs))
    for batch in (1, 16):
        secs, toks = plain_run(model, tasks, args.tokens, batch)
        rows.append((f"plain transformers, batch {batch}", tasks / secs, toks / secs))
    print(f"{'setup':<32} {'rollouts/s':>11} {'tokens/s':>10}")
    for name, r, t in rows:
        print(f"{name:<32} {r:>11.1f} {t:>10.0f}")
    ratio = rows[2][1] / rows[4][1]
    print(f"node (max-inflight 16) vs plain batched loop: {ratio:.2f}x rollouts/s")
    write_json(args.json, "raas", {"tasks": tasks, "new_tokens": args.tokens,
                                   "rows": [{"setup": n, "rollouts_per_s": r, "tokens_per_s": t} for n, r, t in rows],
                                   "ratio_node16_vs_plain_batched": ratio})


if __name__ == "__main__":
    main()
