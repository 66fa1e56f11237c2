"""Runs one rollout's workflow so that nothing it does can stop the node.

Whatever the workflow does -- raises any exception (even `SystemExit` or `KeyboardInterrupt`
from its own code), awaits forever, ignores cancellation, returns something that is not this
sample's Trajectory -- `run_workflow` returns a Trajectory: the workflow's own when it is
valid, else an ERROR trajectory of that sample whose `error` says what happened. The
deadline (`raas.rollout_timeout_s`) bounds a rollout that awaits (model calls, tools); a
workflow that blocks the event loop in synchronous code is interrupted by the node's
`astraflow.raas.watchdog` instead (blocking work belongs in `asyncio.to_thread`).

Why the workflow runs in a task of its own, wrapped by `_contained`: asyncio re-raises
`SystemExit` and `KeyboardInterrupt` out of the event loop when a task's coroutine lets them
escape, so they are caught inside that coroutine; and a task that ignores its cancellation is
abandoned at the deadline instead of awaited. Cancellation of the node itself (its own task
cancelled, or the loop shutting down) still propagates as usual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import weakref
from dataclasses import dataclass

from astraflow.raas.workflows import RolloutContext, Workflow
from astraflow.records import Task, Trajectory, TrajectoryStatus

log = logging.getLogger("astraflow.raas")


@dataclass(frozen=True)
class _Failed:
    """What a workflow raised, carried out of its task as a value."""

    error: BaseException


async def _contained(workflow: Workflow, ctx: RolloutContext) -> Trajectory | _Failed | object:
    try:
        result = workflow(ctx)
        if inspect.isawaitable(result):
            result = await result
        return result
    except asyncio.CancelledError:
        raise  # our deadline or the node stopping: never swallowed here
    except BaseException as exc:  # user code: SystemExit and KeyboardInterrupt included
        return _Failed(exc)


def problem_with(traj: object, task: Task, index: int) -> str | None:
    """Why `traj` cannot be published as sample `index` of `task`, or None."""
    if not isinstance(traj, Trajectory):
        return f"workflow returned {type(traj).__name__}, not a Trajectory (return ctx.finish(...))"
    t = task
    want = {"trajectory_id": Trajectory.make_id(t.task_id, index), "task_id": t.task_id,
            "group_id": t.group_id, "sample_index": index, "group_size": t.n_samples}
    for name, value in want.items():
        if getattr(traj, name) != value:
            return f"workflow returned a Trajectory with {name}={getattr(traj, name)!r}, expected {value!r}"
    return None


def error_trajectory(ctx: RolloutContext, task: Task, error: str, *, keep_segments: bool = True) -> Trajectory:
    """An ERROR trajectory of sample `ctx.sample_index` of `task` (the record as read, whatever the
    workflow did to its own copy), with what it generated so far unless told not to.

    Lists are copied: an abandoned workflow may still append to its context afterwards."""
    keep = dataclasses.replace(ctx, task=task, segments=list(ctx.segments) if keep_segments else [],
                               tool_calls=list(ctx.tool_calls) if keep_segments else [])
    return keep.finish(None, TrajectoryStatus.ERROR, error[:2000])


async def run_workflow(workflow: Workflow, ctx: RolloutContext, timeout_s: float,
                       running: weakref.WeakSet[asyncio.Future] | None = None) -> Trajectory:
    """Run one rollout, contained and bounded by `timeout_s`; see the module doc. The workflow's
    task is added to `running` (what `astraflow.raas.watchdog` may interrupt)."""
    label = f"{ctx.task.workflow[:200]} on {ctx.task.task_id}/{ctx.sample_index}"
    record = ctx.task
    ctx.task = record.copy()  # the workflow's own copy: what it does to it never reaches the record
    task = asyncio.ensure_future(_contained(workflow, ctx))
    if running is not None:
        running.add(task)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()  # not awaited: a workflow that ignores cancellation must not hold the node
        task.add_done_callback(_discard)
        log.error("workflow %s exceeded the %.1f s deadline", label, timeout_s)
        return error_trajectory(ctx, record,
                                f"rollout exceeded the deadline of {timeout_s:g} s (raas.rollout_timeout_s)",
                                keep_segments=False)
    try:
        result = task.result()
    except asyncio.CancelledError:  # the workflow cancelled itself
        return error_trajectory(ctx, record, "workflow was cancelled")
    if isinstance(result, _Failed):
        exc = result.error
        log.error("workflow %s raised %s: %s", label, type(exc).__name__, exc,
                  exc_info=exc if isinstance(exc, Exception) else None)
        return error_trajectory(ctx, record, f"{type(exc).__name__}: {exc}")
    problem = problem_with(result, record, ctx.sample_index)
    if problem is not None:
        log.error("workflow %s: %s", label, problem)
        return error_trajectory(ctx, record, problem)
    return result  # type: ignore[return-value]


def _discard(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log "exception was never retrieved"


__all__ = ["error_trajectory", "problem_with", "run_workflow"]
