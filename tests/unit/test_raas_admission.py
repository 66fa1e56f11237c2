"""Task admission without a broker: the workflow allow-list and every limit on a Task's values."""

from __future__ import annotations

import math
import re
import uuid
from pathlib import Path

import pytest

from astraflow.config import RaasSettings
from astraflow.raas.admission import InvalidTaskError, admit, check_task
from astraflow.raas.workflows import WorkflowNotAllowedError, resolve_workflow
from astraflow.raas.workflows.builtin import rlvr
from astraflow.records import SamplingParams, Task
from astraflow.testing import make_task

LIMITS = RaasSettings(max_n_samples=8, max_tokens=64, max_turns=4, max_prompt_chars=100, max_stop_strings=2,
                      max_stop_chars=8)
SERVED = {"policy", "verifier"}


def _task(**sampling) -> Task:
    t = make_task(0, n_samples=2)
    t.sampling = SamplingParams(**{"max_tokens": 16, **sampling})
    return t


def test_registered_names_resolve_without_any_allowed_module() -> None:
    assert resolve_workflow("rlvr") is rlvr
    assert resolve_workflow("tool_use").__name__ == "tool_use"


@pytest.mark.parametrize("name", ["astraflow.raas.workflows.builtin:rlvr", "os:system", "builtins:exit",
                                  "subprocess:run", "astraflow.raasx:rlvr"])
def test_import_paths_outside_the_allowed_modules_are_refused_with_the_fix(name: str) -> None:
    module = name.partition(":")[0]
    with pytest.raises(WorkflowNotAllowedError, match=rf"raas.workflow_modules=\[{module}\]"):
        resolve_workflow(name, ["astraflow.raas"] if name.startswith("astraflow.raasx") else [])


def test_a_listed_module_and_its_submodules_are_allowed() -> None:
    assert resolve_workflow("astraflow.raas.workflows.builtin:rlvr", ["astraflow.raas"]) is rlvr
    assert resolve_workflow("astraflow.raas.workflows.builtin:rlvr", ["astraflow.raas.workflows.builtin"]) is rlvr


@pytest.mark.parametrize("name", ["nope", "a b:c", "os:__import__('os')", "x:", ":f", "..a:f", "a.:f"])
def test_malformed_or_unknown_names_are_refused(name: str) -> None:
    with pytest.raises(WorkflowNotAllowedError):
        resolve_workflow(name, ["a", "x", "os"])


def test_allowed_module_that_fails_to_import_or_is_not_callable(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    mod = f"flows_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}_exit.py").write_text("raise SystemExit(3)\n")
    (tmp_path / f"{mod}_ok.py").write_text("NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    allowed = [f"{mod}_exit", f"{mod}_ok", f"{mod}_missing"]
    with pytest.raises(WorkflowNotAllowedError, match="raised SystemExit"):
        resolve_workflow(f"{mod}_exit:wf", allowed)
    with pytest.raises(WorkflowNotAllowedError, match="not an async function"):
        resolve_workflow(f"{mod}_ok:NOT_A_FUNCTION", allowed)
    with pytest.raises(WorkflowNotAllowedError, match="cannot be imported"):
        resolve_workflow(f"{mod}_ok:absent", allowed)
    with pytest.raises(WorkflowNotAllowedError, match="cannot be imported"):
        resolve_workflow(f"{mod}_missing:wf", allowed)


def test_admit_wraps_the_refusal_as_an_invalid_task() -> None:
    t = _task()
    t.workflow = "os:system"
    with pytest.raises(InvalidTaskError, match="raas.workflow_modules"):
        admit(t, LIMITS, SERVED)
    t.workflow = "rlvr"
    assert admit(t, LIMITS, SERVED).workflow is rlvr


def test_values_at_their_limits_pass() -> None:
    t = _task(temperature=0.0, top_p=1.0, max_tokens=64, max_turns=4, stop=["ab", "12345678"])
    t.n_samples, t.prompt, t.policies = 8, "x" * 100, ["policy", "verifier"]
    check_task(t, LIMITS, SERVED)


def _set(t: Task, field: str, value) -> None:
    target = t.sampling if field.startswith("sampling.") else t
    setattr(target, field.removeprefix("sampling."), value)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("n_samples", 0, "between 1 and 8 (limit set by raas.max_n_samples)"),
        ("n_samples", 9, "between 1 and 8 (limit set by raas.max_n_samples)"),
        ("n_samples", -(2**31), "between 1 and 8"),
        ("prompt", "x" * 101, "at most 100 characters (limit set by raas.max_prompt_chars)"),
        ("sampling.max_tokens", 0, "between 1 and 64 (limit set by raas.max_tokens)"),
        ("sampling.max_tokens", 2**31 - 1, "between 1 and 64"),
        ("sampling.max_turns", 0, "between 1 and 4 (limit set by raas.max_turns)"),
        ("sampling.max_turns", 5, "between 1 and 4"),
        ("sampling.temperature", -0.5, "finite and >= 0"),
        ("sampling.temperature", math.nan, "finite and >= 0"),
        ("sampling.temperature", math.inf, "finite and >= 0"),
        ("sampling.top_p", 0.0, "in (0, 1]"),
        ("sampling.top_p", 1.5, "in (0, 1]"),
        ("sampling.top_p", math.nan, "in (0, 1]"),
        ("sampling.stop", ["a", "b", "c"], "at most 2 strings (limit set by raas.max_stop_strings)"),
        ("sampling.stop", ["123456789"], "at most 8 characters (limit set by raas.max_stop_chars)"),
        ("sampling.stop", [""], "non-empty"),
        ("policies", [], "at least one policy"),
        ("policies", ["policy", "stranger"], "['stranger'] are not served by this node"),
        ("task_id", "", "1..512 characters"),
        ("group_id", "g" * 513, "1..512 characters"),
    ],
)
def test_each_value_outside_its_limit_is_refused_naming_field_and_limit(field: str, value, says: str) -> None:
    t = _task()
    _set(t, field, value)
    with pytest.raises(InvalidTaskError, match=f"{re.escape(field)}.*{re.escape(says)}"):
        check_task(t, LIMITS, SERVED)
