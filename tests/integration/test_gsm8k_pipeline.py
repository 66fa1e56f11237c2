"""The GSM8K recipe's stand-in on a real broker: its curator, reward and curate commands run as
written in examples/gsm8k/docker-compose.gsm8k.yaml (the experiment, dataset and sizes from the
compose variables, as `gsm8k.env` would give them), each its own process, with a RaaS node serving
a tiny model whose tokenizer has a Qwen2.5-style chat template (the recipe's vLLM node on GPUs).

The dataset is a GSM8K-format fixture (`question`, `answer` ending in `#### n`) saved with
`save_to_disk` with a train and a test split, holding a row without `####` (a bad row: skipped and
counted) and a row whose final answer math-verify cannot parse (scored 0, with the reason on its
trajectories). The stand-in's changes to the commands: fewer samples and tokens (compose
variables), `--max-tasks` and `--trainer-group none` on the curator (no trainer here), and curate
keeps zero-variance groups (a random model's rewards have no variance).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import RECIPE_DIR, recipe_commands, recipe_env

from astraflow.config import AstraflowConfig, KafkaSettings, load_config
from astraflow.kafka.topics import Topics
from astraflow.raas.backends.torch_backend import TorchBackend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.records import TrainSample, Trajectory
from astraflow.testing import read_records

ROOT = Path(__file__).resolve().parents[2]
TASKS, SAMPLES = 3, 4
GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "What is the answer to this broken row?", "answer": "It cannot be parsed.\n#### $ $"},
    {"question": "A row without a final answer.", "answer": "There is no marker here."},  # bad: skipped
]


@pytest.fixture
def gsm8k_dir(tmp_path: Path) -> Path:
    import datasets

    out = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_TRAIN),
                          "test": datasets.Dataset.from_list(GSM8K_TRAIN[:1])}).save_to_disk(str(out))
    return out


def test_gsm8k_recipe_pipeline_through_math_verify(kafka: KafkaSettings, make_experiment: Callable[..., str],
                                                   chat_model_dir: Path, gsm8k_dir: Path, tmp_path: Path) -> None:
    exp = make_experiment("gsm8k", ["policy"])
    topics = Topics(exp)
    variables = recipe_env(AF_EXPERIMENT=exp, AF_DATASET=str(gsm8k_dir), AF_N_SAMPLES=str(SAMPLES),
                           AF_MAX_AHEAD=str(TASKS), AF_MAX_TOKENS="24")
    commands = recipe_commands(variables)
    stand_in = {"curator": ["--max-tasks", str(TASKS), "--trainer-group", "none"],
                "reward": ["--metrics-interval", "1"],
                "curate": ["--default", "filter.zero_variance=none", "--default", "filter.length=none"]}
    env = {**os.environ, "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "ASTRAFLOW__RUN_DIR": str(tmp_path / "runs"), "PYTHONUNBUFFERED": "1"}
    config = RECIPE_DIR / "astraflow.yaml"
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in stand_in}
    procs = {name: subprocess.Popen([sys.executable, "-m", "astraflow_cli.main", "--config", str(config),
                                     *commands[name], *extra], cwd=ROOT, env=env, stdout=logs[name],
                                    stderr=subprocess.STDOUT)
             for name, extra in stand_in.items()}
    cfg = load_config(config, overrides=[f"kafka.bootstrap_servers={kafka.bootstrap_servers}"], env={},
                      model=AstraflowConfig)
    backend = TorchBackend("policy", str(chat_model_dir), seed=0, max_batch=8, threads=1)
    node = RaasNode(cfg, NodeSettings(exp, max_inflight=8, metrics_interval_s=1.0), {"policy": backend})

    async def serve() -> None:
        run = asyncio.create_task(node.run())
        deadline = time.monotonic() + 180
        while node.tasks_done < TASKS and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), "a recipe process exited early"
            await asyncio.sleep(0.2)
        node.stop()
        await run

    try:
        asyncio.run(serve())
        scored = read_records(kafka, [topics.scored], lambda out: len(out) >= TASKS * SAMPLES, timeout_s=120)
        samples = read_records(kafka, [topics.train("policy")], lambda out: len(out) >= TASKS * SAMPLES, timeout_s=120)
    finally:
        backend.close()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(60) for name, p in procs.items()}
        for f in logs.values():
            f.close()
    output = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in stand_in}
    assert codes == dict.fromkeys(stand_in, 0), output
    assert "1 bad row: 1 answer has no '#### <final answer>' (row 3)" in output["curator"], output["curator"]

    assert len(scored) == TASKS * SAMPLES and all(isinstance(t, Trajectory) for t in scored)
    for t in sorted(scored, key=lambda t: t.trajectory_id):  # what `pytest -s` shows of the run
        print(f"{t.prompt_id:10} {t.trajectory_id:16} reward={t.reward:.2f} {t.reward_components} "
              f"answer={(t.final_answer or '')[:24]!r} {t.metadata.get('reward.reason', '')}")
    for t in scored:
        prompt = t.segments[0]
        assert prompt.role == "prompt" and prompt.text.startswith(
            "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
            "<|im_start|>user\n"), prompt.text[:200]
        assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert [(r.app, r.name) for r in t.lineage][-1] == ("reward", "math_verify")
        assert set(t.reward_components) == {"correct", "format", "answered", "reference_ok", "timeout"}
        assert t.reward == pytest.approx(t.reward_components["correct"] + 0.1 * t.reward_components["format"])
        broken = "broken row" in prompt.text
        assert t.reward_components["reference_ok"] == (0.0 if broken else 1.0), t.reward_components
        if broken:
            assert t.reward == 0.0 and t.metadata["reward.reason"].startswith("unverifiable reference"), t.metadata
    assert len({t.prompt_id for t in scored}) == TASKS  # the three good rows of the train split

    assert len(samples) == TASKS * SAMPLES and all(isinstance(s, TrainSample) for s in samples)
    by_id = {t.trajectory_id: t for t in scored}
    for s in samples:
        assert s.reward == pytest.approx(by_id[s.trajectory_id].reward)
        assert [(r.app, r.name) for r in s.lineage][-1] == ("curate", "grpo")
