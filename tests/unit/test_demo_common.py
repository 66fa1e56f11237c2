"""The demo scenarios' shared pieces: the warm-start model cache and the role command lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_parse import parse_cli
from rich.console import Console

from astraflow.demo.common import cached_model, curate_role, node_role, trainer_role


def test_a_model_is_built_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTRAFLOW_HOME", str(tmp_path))
    built: list[Path] = []

    def build(d: Path) -> None:
        built.append(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")

    console = Console(quiet=True)
    first = cached_model("m-1", console, build)
    second = cached_model("m-1", console, build)
    assert first == second == tmp_path / "demo-models" / "m-1"
    assert len(built) == 1 and built[0] != first  # built aside, then renamed into place
    assert (first / "config.json").exists() and not built[0].exists()


def test_a_model_cached_by_another_process_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTRAFLOW_HOME", str(tmp_path))
    target = tmp_path / "demo-models" / "m-2"

    def build(d: Path) -> None:
        d.mkdir(parents=True)
        (d / "config.json").write_text('{"mine": true}')
        target.mkdir(parents=True)  # the other process renamed its build into place first
        (target / "config.json").write_text('{"theirs": true}')
        (target / "weights").write_text("x")

    out = cached_model("m-2", Console(quiet=True), build)
    assert out == target and (target / "config.json").read_text() == '{"theirs": true}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["m-2"]  # the loser's build directory is gone


def test_role_command_lines_are_what_the_cli_parses() -> None:
    env = {"X": "1"}
    trainer = trainer_role("trainer-a", "exp1", "a", Path("/m/a"), Path("/run/a"), 3e-4, 16, env)
    node = node_role("raas-1", "exp1", {"a": Path("/m/a"), "b": Path("/m/b")}, 8, 3, env)
    curate = curate_role("exp1", ["a", "b"], env)
    for role in (trainer, node, curate):
        assert role.cmd[1:3] == ["-m", "astraflow_cli.main"] and role.env == env
    _, t = parse_cli(trainer.cmd[3:])
    assert (t["experiment"], t["policy"], t["model"]) == ("exp1", "a", "/m/a")
    assert {"run_dir=/run/a", "trainer.lr=0.0003", "trainer.batch_size=16", "trainer.publish_dtype=float32"} <= set(t["set_"])
    _, n = parse_cli(node.cmd[3:])
    assert (n["policy"], n["node_id"], n["max_inflight"], n["seed"], n["threads"]) == (["a=/m/a", "b=/m/b"], "raas-1", 8, 3, 1)
    _, c = parse_cli(curate.cmd[3:])
    assert (c["name"], c["experiment"], c["policy"]) == ("curate", "exp1", ["a", "b"])
    with pytest.raises(Exception, match="--bogus"):
        parse_cli([*node.cmd[3:], "--bogus"])
