"""`bench/raas.py --backend vllm`: a RaaS node over vLLM beside vLLM's own offline `LLM.generate`.

In one run, on the same tiny model (untied embeddings, float32), the same prompts, sampling
(temperature 1, logprobs of the sampled tokens, processed) and token budget:

* the node: a RaasNode serving `tasks` single-sample `rlvr` tasks from a real Kafka with the
  `vllm` backend (its engine core in a child process), `--inflight` rollouts at once;
* vLLM offline: `LLM.generate` on every prompt at once (vLLM schedules them itself);
* the node with our `torch` engine (its own process, max-inflight 16, as `astraflow raas serve`).

Both vLLM engines are started and warmed up once, then measured in alternated rounds (node,
offline, node, offline, ...: `--repeats` pairs), so a shared machine's drift falls on both sides
alike; each round lasts a few seconds. Tokens/s counts the tokens generated between the first
rollout's start (the group join is not throughput) and the last task's end for the nodes, and the
`generate` call for offline vLLM; engine start-up is outside every measurement. Each round starts
`IDLE_GAP_S` after the other engine's last step: vLLM's worker process busy-waits (`sched_yield`)
for a second after its last read, which would take a core from the round that follows it. Each
round also records the CPU seconds per generated token of this process (the node with its Kafka
clients and vLLM's front end, or offline vLLM's front end) and of the engines' processes (engine
core and worker: both engines', the idle one's included).
`node_vs_offline_ratio` is the median over the pairs of the node's tokens/s over offline vLLM's
in the same pair (goal >= 0.9); every pair's ratio is in the results. The torch node runs one
round after them. Needs the virtualenv of scripts/vllm-env.sh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

from _common import write_json

from astraflow.config import AstraflowConfig, KafkaSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import SamplingParams
from astraflow.testing import make_task

TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "a RaaS node over vLLM serving single-sample tasks from Kafka",
    "against": "vLLM's own offline LLM.generate, and a node over the torch engine",
    "settings": "the same untied tiny model (float32), prompts, temperature 1 and 32-token budget",
}


KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of both vLLM engines
MAX_MODEL_LEN = 512
IDLE_GAP_S = 1.5  # before each round: vLLM's shared-memory reader spins 1 s after its last read


def cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by its live child processes."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    kids = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited meanwhile
            kids += sum(child.cpu_times()[:2])
    return own, kids


def cpu_per_token(before: tuple[float, float], after: tuple[float, float], tokens: int) -> dict[str, float]:
    return {"this_process_ms_per_token": (after[0] - before[0]) / tokens * 1e3,
            "engine_processes_ms_per_token": (after[1] - before[1]) / tokens * 1e3}


def open_backend(model: Path, tokens: int, backend: str):
    """A started, warmed-up engine (the first requests of an engine are slow, as offline vLLM's)."""
    from astraflow.raas.backends.base import GenerateRequest

    if backend == "vllm":
        from astraflow.raas.backends.vllm_backend import VllmBackend

        b = VllmBackend("policy", str(model), max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB,
                        dtype="float32", seed=0)
    else:
        from astraflow.raas.backends.torch_backend import TorchBackend

        b = TorchBackend("policy", str(model), seed=0, max_batch=16, threads=1, process=True)
    for i in range(2):
        b.generate_sync(GenerateRequest(b.encode(make_task(i).prompt, add_bos=True), tokens, 1.0))
    return b


def node_round(kafka: KafkaSettings, b, tasks: int, tokens: int, inflight: int) -> dict:
    """One round: `tasks` tasks on a fresh experiment's topics, served by a new node over `b`."""
    exp = f"bench-raas-vllm-{uuid.uuid4().hex[:8]}"
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
        node = RaasNode(AstraflowConfig(kafka=kafka), NodeSettings(exp, max_inflight=inflight, metrics_interval_s=3600),
                        {"policy": b}, tools={})
        time.sleep(IDLE_GAP_S)

        async def serve() -> tuple[float, int, dict[str, float]]:
            run = asyncio.create_task(node.run())
            while node.inflight == 0 and node.tasks_done == 0:
                await asyncio.sleep(0.001)
            t0, before, cpu0 = time.perf_counter(), int(b.tokens_generated), cpu_s()
            while node.tasks_done < tasks:
                await asyncio.sleep(0.005)
            elapsed, cpu1 = time.perf_counter() - t0, cpu_s()
            generated = int(b.tokens_generated) - before
            node.stop()
            await run
            return elapsed, generated, cpu_per_token(cpu0, cpu1, generated)

        elapsed, generated, cpu = asyncio.run(serve())
        return {"setup": f"node over Kafka, {b.name} backend, max-inflight {inflight}", "rollouts": tasks,
                "tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed, **cpu}
    finally:
        admin.delete([s.name for s in specs])


class Offline:
    """vLLM's own `LLM`, started and warmed up once; `round()` generates every prompt at once."""

    def __init__(self, model: Path, tasks: int, tokens: int) -> None:
        import os

        from transformers import AutoTokenizer
        from vllm import LLM, TokensPrompt
        from vllm import SamplingParams as VllmSampling

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
        tok = AutoTokenizer.from_pretrained(model)
        self.prompts = [TokensPrompt(prompt_token_ids=tok.encode(make_task(i).prompt, add_special_tokens=True))
                        for i in range(tasks)]
        self.llm = LLM(model=str(model), max_model_len=MAX_MODEL_LEN, enforce_eager=True, dtype="float32", seed=0,
                       logprobs_mode="processed_logprobs")
        self.params = VllmSampling(temperature=1.0, max_tokens=tokens, logprobs=0)
        self.llm.generate(self.prompts[:2], self.params, use_tqdm=False)

    def round(self) -> dict:
        time.sleep(IDLE_GAP_S)
        t0, cpu0 = time.perf_counter(), cpu_s()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        elapsed, cpu1 = time.perf_counter() - t0, cpu_s()
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"setup": "vLLM offline LLM.generate, all prompts at once", "rollouts": len(self.prompts),
                "tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
                **cpu_per_token(cpu0, cpu1, generated)}


def main(kafka: KafkaSettings, tasks: int, tokens: int, inflight: int, json_out: str | None, quick: bool,
         repeats: int) -> None:
    import statistics
    import tempfile

    from astraflow.models.tiny import init_tiny

    model = init_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0, tie_embeddings=False)
    node_b, offline = open_backend(model, tokens, "vllm"), Offline(model, tasks, tokens)
    rows, pairs = [], []
    try:
        for _ in range(repeats):
            node, off = node_round(kafka, node_b, tasks, tokens, inflight), offline.round()
            rows += [node, off]
            pairs.append(node["tokens_per_s"] / off["tokens_per_s"])
    finally:
        node_b.close()
        del offline
    torch_b = open_backend(model, tokens, "torch")
    try:
        torch_row = node_round(kafka, torch_b, tasks, tokens, 16)
    finally:
        torch_b.close()
    rows.append(torch_row)
    print(f"{'setup':<58} {'rollouts':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'CPU ms/token: here':>18} "
          f"{'engines':>7}")
    for r in rows:
        print(f"{r['setup']:<58} {r['rollouts']:>8} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['this_process_ms_per_token']:>18.3f} {r['engine_processes_ms_per_token']:>7.3f}")
    cpu = {side: {k: statistics.median(r[k] for r in rows[first:-1:2])
                  for k in ("this_process_ms_per_token", "engine_processes_ms_per_token")}
           for side, first in (("node", 0), ("offline", 1))}
    ratio = statistics.median(pairs)
    vs_torch = statistics.median(r["tokens_per_s"] for r in rows[:-1:2]) / torch_row["tokens_per_s"]
    print(f"node over vLLM vs vLLM offline, tokens/s: median {ratio:.2f}x over {len(pairs)} alternated pairs "
          f"({', '.join(f'{p:.2f}' for p in pairs)}; goal >= 0.9); the vLLM node's median vs the node over the "
          f"torch engine: {vs_torch:.2f}x")
    write_json(json_out, "raas_vllm", {"tasks": tasks, "new_tokens": tokens, "inflight": inflight, "rows": rows,
                                       "pair_ratios": pairs, "node_vs_offline_ratio": ratio,
                                       "vllm_node_vs_torch_node_ratio": vs_torch, "median_cpu_ms_per_token": cpu},
               terms=TERMS, quick=quick)
