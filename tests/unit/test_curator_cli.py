"""`astraflow app run curator`: the options it builds, defaults from `CuratorOptions` alone."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

import astraflow_cli.apps_cmd as apps_cmd
import stream_apps.launch as launch
from astraflow_cli.main import app
from stream_apps.curator import CuratorOptions


@pytest.mark.parametrize(("extra", "want"), [
    ([], (CuratorOptions([], []).n_samples, CuratorOptions([], []).max_ahead, "rlvr", 0)),
    (["--n-samples", "4", "--max-ahead", "3", "--workflow", "tool_use", "--max-tasks", "7"], (4, 3, "tool_use", 7)),
])
def test_the_curator_gets_the_given_options_and_the_defaults_of_curator_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], want: tuple) -> None:
    built: list[CuratorOptions] = []
    monkeypatch.setattr(launch, "build_worker",
                        lambda name, settings, options: built.append(options.curator) or types.SimpleNamespace(group_id="g"))
    monkeypatch.setattr(apps_cmd, "_run", lambda worker: None)  # builds the worker, runs nothing
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n')
    res = CliRunner().invoke(app, ["app", "run", "curator", "-e", "x", "--policy", "p", "--dataset", str(data), *extra])
    assert res.exit_code == 0, (res.output, res.exception)
    [c] = built
    assert (c.n_samples, c.max_ahead, c.workflow, c.max_tasks) == want and list(c.policies) == ["p"]


@pytest.mark.parametrize(("extra", "want"), [([], 1.0), (["--commit-interval", "0.2"], 0.2), (["--commit-interval", "0"], None)])
def test_app_run_passes_the_commit_interval_and_refuses_one_not_above_zero(
        monkeypatch: pytest.MonkeyPatch, extra: list[str], want: float | None) -> None:
    built: list = []
    monkeypatch.setattr(launch, "build_worker",
                        lambda name, settings, options: built.append(settings) or types.SimpleNamespace(group_id="g"))
    monkeypatch.setattr(apps_cmd, "_run", lambda worker: None)
    res = CliRunner().invoke(app, ["app", "run", "reward", "-e", "x", *extra])
    if want is None:
        assert res.exit_code != 0 and not built
    else:
        assert res.exit_code == 0, (res.output, res.exception)
        assert [s.commit_interval_s for s in built] == [want]
