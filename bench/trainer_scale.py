"""The trainer on several ranks, and the weight path of a model of real size.

1. **Ranks** (needs the local Kafka): `astraflow train --devices N --strategy ddp` on CPU (gloo),
   N = 1 and 2, on one pre-filled train topic (the tiny model, batches of `--batch` samples):
   steady-state samples/s from the trainer's own step cycles (`train/cycle_s` in its CSV log,
   the first batch left out), and the whole job's wall time. On a machine with fewer cores than
   2 ranks x their threads the second rank only adds contention: this measures that the path
   works and what it costs here, not a GPU's scaling.
2. **0.5B weight path** (`--big`; about 12 GB of memory: run it alone, e.g. under
   `flock /work/coord/heavy.lock`): a model of Qwen2-0.5B's shape (hidden 896, 24 layers, 14
   heads, 2 KV heads, intermediate 4864, vocabulary 151936; random weights, random token ids,
   nothing downloaded), at one rank: one train step (policy loss, AdamW), the published bf16
   state of before and after, the sparse delta between them (`VersionEncoder.encode`, as the
   trainer publishes), and a following node in a separate process fed the records a consumer
   reads (`WeightFollower.feed`, chunk by chunk from files): the base version's snapshot (a node
   joining), the state lent to an engine (`lend_state`, what `BackendWeightFollower` hands its
   backend, which keeps it), then the delta's records (crc32s, sha256, the in-place apply, the
   version checksum, the finiteness check) and the next lend: seconds of each, bytes per changed
   element, peak resident memory of each process.

Prints the figures and writes bench/results/trainer_scale.json.

    python bench/trainer_scale.py [--ranks 1,2] [--samples 96] [--batch 8] [--big] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import write_json

QWEN2_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 4096, "tie_word_embeddings": True}


TERMS = {  # what the figures compare (written into the results JSON)
    "ours": "astraflow train on N ranks (DDP on CPU, gloo)",
    "against": "the same trainer on one rank",
    "settings": "one pre-filled train topic, the tiny model, batches of --batch; --big: the 0.5B weight path",
}


def peak_rss_gb() -> float:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux keeps that across
    fork and exec, so the follower, started by the trainer's process, would report the trainer's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


# -- 1. ranks -----------------------------------------------------------------------------------


def ranks_run(bootstrap: str, ranks: list[int], n_samples: int, batch: int) -> list[dict[str, Any]]:
    from astraflow.config import KafkaSettings, TopicSettings
    from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
    from astraflow.models.tiny import init_tiny
    from trainers.cpu_ranks import send, train_cmd, train_env, varied_samples

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    admin = TopicAdmin(kafka)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
        for n in ranks:
            exp = f"bench-scale-{uuid.uuid4().hex[:8]}"
            specs = topic_specs(exp, ["policy"], TopicSettings(partitions=2))
            admin.create(specs)
            try:
                send(kafka, Topics(exp).train("policy"), varied_samples(n_samples))
                run_dir = Path(tmp) / f"runs-{n}"
                cmd = train_cmd(kafka, exp, model, run_dir, n, "ddp" if n > 1 else "auto", f"trainer.batch_size={batch}",
                                "trainer.logger=csv", "trainer.stop_when_idle_s=3", "trainer.publish_every_steps=1")
                t = time.perf_counter()
                proc = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=900)
                wall = time.perf_counter() - t
                if proc.returncode != 0:
                    raise SystemExit(f"{n} rank(s) failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                [metrics] = (run_dir / exp / "policy" / "lightning").glob("version_*/metrics.csv")
                rows = [r for r in csv.DictReader(metrics.open()) if r.get("train/cycle_s")]
                cycles = [float(r["train/cycle_s"]) for r in rows]
                steps = [float(r["train/step_s"]) for r in rows]
                figures = {"ranks": n, "batches_timed": len(cycles), "samples_per_s": round(batch * len(cycles) / sum(cycles), 1),
                           "step_s_median": round(sorted(steps)[len(steps) // 2], 4), "job_wall_s": round(wall, 1)}
                print(f"{n} rank(s): {figures['samples_per_s']} samples/s over {len(cycles)} batches of {batch} "
                      f"(median step {figures['step_s_median']} s; job {figures['job_wall_s']} s)", flush=True)
                out.append(figures)
            finally:
                admin.delete([s.name for s in specs])
    return out


# -- 2. the 0.5B weight path --------------------------------------------------------------------


def _records(spec: dict[str, Any]) -> Iterator[Any]:
    """A version's manifest, then its chunks read one by one from its payload file (a consumer
    holds a few records at a time, never the whole payload)."""
    from astraflow.records import PolicyVersion, WeightChunk, WeightKind

    m = PolicyVersion(**{**spec["manifest"], "kind": WeightKind(spec["manifest"]["kind"])})
    yield m
    with open(spec["file"], "rb") as f:
        for i in range(m.num_chunks):
            data = f.read(spec["chunk_bytes"])
            yield WeightChunk(m.policy, m.version, i, m.num_chunks, data, zlib.crc32(data))


def follower_apply(spec_file: str) -> None:
    """The following node: joins from the snapshot, lends the state to an engine, applies the delta; prints figures."""
    from astraflow.weights.chain import ApplyStatus
    from astraflow.weights.follow import WeightFollower

    snapshot, delta = json.loads(Path(spec_file).read_text())
    follower = WeightFollower(snapshot["manifest"]["policy"])

    def feed(spec: dict[str, Any]) -> None:
        events = [e for r in _records(spec) for e in follower.feed(r)]
        if [e.result.status for e in events] != [ApplyStatus.APPLIED]:
            raise SystemExit(f"version {spec['manifest']['version']} not applied: {events}")

    # Each timing covers the records fed and the hand-off to the engine: what a version costs a node.
    t, cpu = time.perf_counter(), time.process_time()
    feed(snapshot)
    engine = follower.lend_state()  # a backend keeps what it is handed until its engine loads it
    join_s, join_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    joined = peak_rss_gb()
    t, cpu = time.perf_counter(), time.process_time()
    feed(delta)
    engine = follower.lend_state()
    seconds, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    assert follower.chain.checksum.hex() == delta["manifest"]["state_checksum"] and len(engine) == len(follower.state)
    print(f"FOLLOWER {seconds:.3f} {peak_rss_gb():.3f} {joined:.3f} {join_s:.3f} {cpu_s:.3f} {join_cpu_s:.3f}", flush=True)


def _spec(m: Any, payload: bytes, file: str, chunk_bytes: int) -> dict[str, Any]:
    """What the follower's process needs to replay a version's records: its manifest and payload file."""
    Path(file).write_bytes(payload)
    manifest = {k: getattr(m, k) for k in m.__slots__}
    manifest["kind"] = m.kind.value
    manifest["num_chunks"] = max(1, -(-len(payload) // chunk_bytes))
    return {"manifest": manifest, "file": file, "chunk_bytes": chunk_bytes}


def big_run(seq: int, rows: int) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.rl import PolicyLossConfig, policy_loss, token_logprobs
    from astraflow.weights.delta import SparseDelta
    from astraflow.weights.publish import PublishSettings, VersionEncoder, published_state

    torch.manual_seed(0)
    t = time.perf_counter()
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    settings = PublishSettings(dtype="bfloat16", snapshot_every=1000)
    encoder = VersionEncoder("policy", settings)
    tmp = tempfile.TemporaryDirectory()
    pub0 = encoder.encode(published_state(model.state_dict(), "bfloat16"), prepared=True)  # the first: a snapshot
    snap_spec = _spec(pub0.manifest, pub0.payload, f"{tmp.name}/v0.snapshot", settings.chunk_bytes)
    snapshot_bytes = len(pub0.payload)
    del pub0  # the encoder keeps the base state, as a trainer does; the snapshot's bytes went out
    ids = torch.randint(3, QWEN2_05B["vocab_size"], (rows, seq))
    mask = torch.zeros(rows, seq, dtype=torch.bool)
    mask[:, seq // 2:] = True
    t = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=torch.arange(seq // 2 - 1, seq - 1)).logits
    lp = torch.zeros(rows, seq)
    lp[:, seq // 2:] = token_logprobs(logits, ids[:, seq // 2:])
    out = policy_loss(lp, lp.detach() - 0.01, torch.randn(rows), mask, PolicyLossConfig(mode="ppo"))
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t
    trainer_after_step_gb = peak_rss_gb()
    t = time.perf_counter()
    v1 = published_state(model.state_dict(), "bfloat16")
    cast_s = time.perf_counter() - t
    t = time.perf_counter()
    pub1 = encoder.encode(v1, trainer_step=1, prepared=True)  # the delta v0 -> v1 and its manifest (sha256)
    payload = pub1.payload
    encode_s = time.perf_counter() - t
    changed = SparseDelta.from_bytes(payload).trailer.n_changed
    elements = sum(v.numel() for v in v1.values())
    with tmp:
        specs = [snap_spec, _spec(pub1.manifest, payload, f"{tmp.name}/v1.delta", settings.chunk_bytes)]
        Path(f"{tmp.name}/spec.json").write_text(json.dumps(specs))
        trainer_peak_gb = peak_rss_gb()
        del model, opt, logits, out, v1, pub1, encoder
        proc = subprocess.run([sys.executable, __file__, "--follower", f"{tmp.name}/spec.json"], capture_output=True,
                              text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("FOLLOWER ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"the follower failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    _, apply_s, follower_peak, follower_joined, join_s, apply_cpu_s, join_cpu_s = line[0].split()
    figures = {
        "shape": QWEN2_05B, "parameters": params, "rows": rows, "seq_len": seq, "build_s": round(build_s, 1),
        "train_step_s": round(step_s, 2), "publish_cast_bf16_s": round(cast_s, 2), "delta_encode_s": round(encode_s, 2),
        "delta_bytes": len(payload), "changed_elements": changed, "published_elements": elements,
        "bytes_per_changed_element": round(len(payload) / max(changed, 1), 3),
        "follower_apply_s": float(apply_s), "trainer_peak_rss_gb": round(trainer_peak_gb, 2),
        "trainer_peak_rss_after_step_gb": round(trainer_after_step_gb, 2),
        "follower_apply_cpu_s": float(apply_cpu_s), "follower_join_cpu_s": float(join_cpu_s),
        "snapshot_bytes": snapshot_bytes, "follower_join_s": float(join_s),
        "follower_peak_rss_gb": float(follower_peak), "follower_peak_rss_joined_gb": float(follower_joined),
    }
    print(f"0.5B ({params / 1e6:.0f}M parameters, {rows} x {seq} tokens): train step {step_s:.1f} s; publish: bf16 cast "
          f"{cast_s:.1f} s, delta encode {encode_s:.1f} s, {len(payload) / 1e6:.1f} MB for {changed:,} of {elements:,} "
          f"elements changed ({figures['bytes_per_changed_element']} B/changed element); follower: join from a {snapshot_bytes / 1e6:.0f} MB "
          f"snapshot {float(join_s):.1f} s, apply {float(apply_s):.1f} s ({float(apply_cpu_s):.1f} s of CPU); peak RSS trainer {trainer_peak_gb:.1f} GB, follower {float(follower_peak):.1f} GB", flush=True)
    return figures


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--follower":
        follower_apply(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default=os.environ.get("ASTRAFLOW_TEST_BOOTSTRAP", "127.0.0.1:19092"))
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--big", action="store_true", help="also the 0.5B weight path (~12 GB of memory)")
    ap.add_argument("--big-seq", type=int, default=128)
    ap.add_argument("--big-rows", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer samples; never the 0.5B model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.samples, args.big = 48, False
    figures: dict[str, Any] = {"ranks": ranks_run(args.bootstrap, [int(x) for x in args.ranks.split(",") if x], args.samples,
                                                  args.batch)}
    if args.big:
        figures["qwen2_0_5b_weight_path"] = big_run(args.big_seq, args.big_rows)
    write_json(args.out, "trainer_scale", figures, terms=TERMS, quick=args.quick)


if __name__ == "__main__":
    main()
