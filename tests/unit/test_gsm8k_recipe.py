"""The GSM8K recipe cannot rot: every file of examples/gsm8k/ parses with the classes that read it,
and every `astraflow` command of docs/recipes/gsm8k.md and of the recipe's compose file parses
against the CLI (options, their types, the reward's default with its JSON and its parameters)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from helpers import RECIPE_DIR as RECIPE
from helpers import recipe_commands, recipe_env

from astraflow.config import AstraflowConfig, load_config
from astraflow.dataflow.registry import REGISTRY
from stream_apps.slots import parse_default
from trainers.config import TrainRunConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "recipes" / "gsm8k.md"
SHARED = ("experiment", "run_dir", "kafka", "topics", "raas", "weights")


def doc_commands() -> list[list[str]]:
    """The `astraflow ...` command lines of the doc's bash blocks (continuations joined, leading
    VAR=value assignments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0] == "astraflow":
                out.append(words[1:])
    return out


def parse_cli(args: list[str]) -> Any:
    """Parses `astraflow ARGS` down to its command, as the CLI would, without running it (a bad
    option, a missing one or a value of the wrong type raises the CLI's usage error)."""
    from astraflow_cli.main import app

    command: Any = typer.main.get_command(app)  # typer's own click (typer._click)
    ctx = command.make_context("astraflow", list(args), resilient_parsing=False)
    while hasattr(command, "resolve_command"):  # a group: on to its subcommand
        name, command, rest = command.resolve_command(ctx, [*getattr(ctx, "_protected_args", []), *ctx.args])
        assert command is not None, args
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def check_reward_default(ctx: Any) -> None:
    for item in ctx.params.get("default") or []:
        slot, default = parse_default(item)
        assert slot == "reward"
        spec = REGISTRY.spec("reward", default.strategy)
        assert set(default.params) <= set(spec.params()), default
        REGISTRY.get("reward", default.strategy, **default.params)  # builds (spawns nothing until scored)


def test_gsm8k_recipe_configs_parse_and_agree() -> None:
    shared = load_config(RECIPE / "astraflow.yaml", env={}, model=AstraflowConfig)
    trainer = load_config(RECIPE / "trainer.yaml", env={}, model=TrainRunConfig)
    assert shared.experiment == trainer.experiment == "gsm8k"
    for section in SHARED:
        assert getattr(shared, section) == getattr(trainer, section), section
    t = trainer.trainer
    assert (t.strategy, t.accelerator, t.precision) == ("fsdp", "gpu", "bf16-mixed") and t.devices == 4
    assert t.lr == 1e-6 and t.loss.kl_coef == 0.001 and t.batch_size == 256 and t.batch_size % t.minibatches == 0
    # what the compose stack's environment makes of it (its trainer-env sets the batch from AF_TRAINER_BATCH)
    env = recipe_env()
    in_compose = load_config(RECIPE / "trainer.yaml", model=TrainRunConfig, env={
        "ASTRAFLOW__TRAINER__BATCH_SIZE": env["AF_TRAINER_BATCH"], "ASTRAFLOW__TRAINER__DEVICES": env["AF_TRAINER_GPUS"],
        "ASTRAFLOW__TOPICS__PARTITIONS": env["AF_PARTITIONS"], "ASTRAFLOW__EXPERIMENT": env["AF_EXPERIMENT"]})
    assert in_compose.trainer == t and in_compose.topics == trainer.topics
    assert shared.raas.max_tokens >= int(env["AF_MAX_TOKENS"])


def test_gsm8k_recipe_compose_commands_parse_against_the_cli() -> None:
    commands = recipe_commands()
    assert set(commands) == {"curator", "reward", "curate", "raas-gpu", "trainer-gpu"}
    for name, args in commands.items():
        ctx = parse_cli(args)
        if name == "reward":
            check_reward_default(ctx)
        if name == "trainer-gpu":
            assert (ctx.params["devices"], ctx.params["strategy"]) == (4, "fsdp")
        if name == "curator":
            assert ctx.params["preset"] == "gsm8k" and ctx.params["n_samples"] == 8 and ctx.params["max_tokens"] == 1024
    base = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())["services"]
    assert set(recipe_commands()) <= set(base)  # an override of services the stack has


def test_gsm8k_recipe_doc_commands_parse_against_the_cli() -> None:
    commands = doc_commands()
    assert len(commands) >= 8
    seen = set()
    for args in commands:
        ctx = parse_cli(args)
        seen.add(ctx.command_path.split(" ", 1)[1])
        if ctx.command_path.endswith("app run") and ctx.params["name"] == "reward":
            check_reward_default(ctx)
    assert {"app run", "raas serve", "train", "topics create"} <= seen
    # the doc and the compose file run the same curator and reward
    doc = {tuple(a[a.index("run") + 1:a.index("run") + 2]): a for a in commands if a[:1] == ["--config"] and "run" in a}
    curator = recipe_commands()["curator"]
    assert doc[("curator",)][doc[("curator",)].index("--dataset"):] == curator[curator.index("--dataset"):]


@pytest.mark.parametrize("path", sorted(p.name for p in RECIPE.iterdir()))
def test_gsm8k_recipe_every_file_is_known(path: str) -> None:
    assert path in {"astraflow.yaml", "trainer.yaml", "docker-compose.gsm8k.yaml", "gsm8k.env"}, \
        f"examples/gsm8k/{path}: add a check that it parses"
