"""Admission of tasks: every value a Task carries is checked before a RaaS node does any work.

A task comes from a topic that many machines and teams write, so nothing in it is trusted: its
sampling values must lie within the node's configured limits (`raas.*` in the config), it must
name policies this node serves, and its workflow must be one the operator chose (a registered
name or `module:function` inside `raas.workflow_modules`). A task that fails any check is
dead-lettered with the field, the value and the limit, so whoever wrote it can fix it.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from astraflow.config import RaasSettings
from astraflow.errors import AstraflowError
from astraflow.raas.workflows import Workflow, WorkflowNotAllowedError, policy_count, resolve_workflow
from astraflow.records import Task

MAX_ID_CHARS = 512  # task_id / group_id: they become record keys and trajectory ids


class InvalidTaskError(AstraflowError):
    """Raised (and the task dead-lettered) when a task cannot be served: a value outside the
    node's limits, a policy this node does not serve, or a workflow that is not allowed."""


@dataclass(frozen=True)
class AdmittedTask:
    """A task that passed every check, with the workflow it will run."""

    task: Task  # the record, unchanged
    workflow: Workflow  # resolved from the registry or the allowed modules


def _require(ok: bool, task: Task, field: str, value: object, rule: str, setting: str | None = None) -> None:
    if ok:
        return
    fix = f" (limit set by raas.{setting})" if setting else ""
    raise InvalidTaskError(f"task {task.task_id!r}: {field}={value!r} {rule}{fix}")


def check_task(task: Task, limits: RaasSettings, served: Collection[str]) -> None:
    """Raise `InvalidTaskError` naming the first field outside its limit (see the module doc)."""
    _require(0 < len(task.task_id) <= MAX_ID_CHARS, task, "task_id", task.task_id[:40],
             f"must be 1..{MAX_ID_CHARS} characters")
    _require(0 < len(task.group_id) <= MAX_ID_CHARS, task, "group_id", task.group_id[:40],
             f"must be 1..{MAX_ID_CHARS} characters")
    _require(1 <= task.n_samples <= limits.max_n_samples, task, "n_samples", task.n_samples,
             f"must be between 1 and {limits.max_n_samples}", "max_n_samples")
    _require(len(task.prompt) <= limits.max_prompt_chars, task, "prompt", f"<{len(task.prompt)} characters>",
             f"must be at most {limits.max_prompt_chars} characters", "max_prompt_chars")
    p = task.sampling
    _require(1 <= p.max_tokens <= limits.max_tokens, task, "sampling.max_tokens", p.max_tokens,
             f"must be between 1 and {limits.max_tokens}", "max_tokens")
    _require(1 <= p.max_turns <= limits.max_turns, task, "sampling.max_turns", p.max_turns,
             f"must be between 1 and {limits.max_turns}", "max_turns")
    _require(math.isfinite(p.temperature) and p.temperature >= 0, task, "sampling.temperature", p.temperature,
             "must be finite and >= 0 (0 means greedy)")
    _require(math.isfinite(p.top_p) and 0 < p.top_p <= 1, task, "sampling.top_p", p.top_p, "must be in (0, 1]")
    _require(len(p.stop) <= limits.max_stop_strings, task, "sampling.stop", f"<{len(p.stop)} strings>",
             f"must hold at most {limits.max_stop_strings} strings", "max_stop_strings")
    longest = max((len(s) for s in p.stop), default=0)
    _require(all(p.stop) and longest <= limits.max_stop_chars, task, "sampling.stop",
             f"<strings of up to {longest} characters>",
             f"strings must be non-empty and at most {limits.max_stop_chars} characters", "max_stop_chars")
    _require(bool(task.policies), task, "policies", task.policies, "must name at least one policy")
    missing = sorted({p for p in task.policies if p not in served})
    if missing:
        raise InvalidTaskError(
            f"task {task.task_id!r}: policies={missing} are not served by this node (it serves "
            f"{sorted(served)}); start a node with --policy NAME=MODEL_DIR for each"
        )


def admit(task: Task, limits: RaasSettings, served: Collection[str]) -> AdmittedTask:
    """Check `task` and resolve its workflow; raises `InvalidTaskError` with the reason."""
    check_task(task, limits, served)
    try:
        workflow = resolve_workflow(task.workflow, limits.workflow_modules)
    except WorkflowNotAllowedError as exc:
        raise InvalidTaskError(f"task {task.task_id!r}: {exc}") from exc
    lo, hi = policy_count(task.workflow, workflow)
    n = len(task.policies)
    if n < lo or (hi is not None and n > hi) or len(set(task.policies)) != n:
        want = f"{lo}" if lo == hi else (f"{lo} or more" if hi is None else f"{lo} to {hi}")
        raise InvalidTaskError(f"task {task.task_id!r}: workflow {task.workflow!r} takes {want} distinct policies, "
                               f"the task names {n}: {task.policies[:8]}")
    return AdmittedTask(task, workflow)


__all__ = ["MAX_ID_CHARS", "AdmittedTask", "InvalidTaskError", "admit", "check_task"]
