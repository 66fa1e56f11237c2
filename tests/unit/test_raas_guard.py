"""Containment of workflows without a broker: whatever a workflow does, its sample gets a Trajectory.

The workflows here misbehave on purpose (raise BaseException subclasses, hang, ignore
cancellation, return the wrong thing); `run_workflow` is the real code the node runs.
"""

from __future__ import annotations

import asyncio

import pytest

from astraflow.raas.guard import run_workflow
from astraflow.raas.tools import ToolBox
from astraflow.raas.workflows import RolloutContext
from astraflow.records import NodeInfo, Trajectory, TrajectoryStatus
from astraflow.testing import make_task


def _ctx(index: int = 1) -> RolloutContext:
    return RolloutContext(make_task(7, n_samples=2), index, {}, ToolBox({}, 1.0), NodeInfo("n", "cpu", "local", "test"))


def _run(workflow, timeout_s: float = 5.0) -> Trajectory:
    return asyncio.run(run_workflow(workflow, _ctx(), timeout_s))


async def ok(ctx: RolloutContext) -> Trajectory:
    return ctx.finish("4")


def test_a_good_workflow_returns_its_own_trajectory() -> None:
    traj = _run(ok)
    assert traj.status == TrajectoryStatus.OK and traj.final_answer == "4" and traj.trajectory_id == "task-7/1"


@pytest.mark.parametrize("exc", [ValueError("bad"), SystemExit(3), KeyboardInterrupt(), GeneratorExit(),
                                 MemoryError("big"), RecursionError("deep")])
def test_any_exception_becomes_an_error_trajectory(exc: BaseException) -> None:
    async def raising(ctx: RolloutContext) -> Trajectory:
        await asyncio.sleep(0)
        raise exc

    traj = _run(raising)
    assert traj.status == TrajectoryStatus.ERROR and traj.error.startswith(type(exc).__name__)
    assert traj.trajectory_id == "task-7/1" and traj.group_size == 2


def test_exception_raised_before_the_first_await_and_by_a_plain_function() -> None:
    def plain(ctx: RolloutContext) -> Trajectory:
        raise SystemExit("from a plain function")

    assert _run(plain).error == "SystemExit: from a plain function"


@pytest.mark.parametrize(
    ("result", "says"),
    [(None, "returned NoneType, not a Trajectory"), ("text", "returned str"), (42, "returned int")],
)
def test_wrong_return_types_become_error_trajectories(result: object, says: str) -> None:
    async def wrong(ctx: RolloutContext):
        return result

    traj = _run(wrong)
    assert traj.status == TrajectoryStatus.ERROR and says in traj.error


def test_a_trajectory_of_another_sample_or_task_is_refused() -> None:
    async def other_sample(ctx: RolloutContext) -> Trajectory:
        return RolloutContext(ctx.task, 0, {}, ctx.tools, ctx.node).finish("x")

    async def other_task(ctx: RolloutContext) -> Trajectory:
        return RolloutContext(make_task(8, n_samples=2), 1, {}, ctx.tools, ctx.node).finish("x")

    assert "trajectory_id='task-7/0', expected 'task-7/1'" in _run(other_sample).error
    assert "trajectory_id='task-8/1'" in _run(other_task).error


def test_a_hang_ends_at_the_deadline() -> None:
    async def hang(ctx: RolloutContext) -> Trajectory:
        await asyncio.Event().wait()
        return ctx.finish("never")

    traj = _run(hang, timeout_s=0.2)
    assert traj.status == TrajectoryStatus.ERROR and "deadline of 0.2 s (raas.rollout_timeout_s)" in traj.error
    assert traj.segments == []


def test_a_workflow_that_ignores_cancellation_is_abandoned_not_awaited() -> None:
    state = {"finished": False}

    async def stubborn(ctx: RolloutContext) -> Trajectory:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # swallows the cancellation and goes on
        state["finished"] = True
        return ctx.finish("late")

    async def main() -> tuple[Trajectory, bool]:
        traj = await run_workflow(stubborn, _ctx(), 0.1)
        finished_then = state["finished"]
        await asyncio.sleep(0.7)  # let it end before the loop closes
        return traj, finished_then

    traj, finished_then = asyncio.run(main())
    assert "deadline" in traj.error and not finished_then and state["finished"]


def test_cancelling_the_node_still_cancels_the_rollout() -> None:
    state = {"cancelled": False}

    async def slow(ctx: RolloutContext) -> Trajectory:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        return ctx.finish("never")

    async def main() -> None:
        t = asyncio.create_task(run_workflow(slow, _ctx(), 60.0))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())
    assert state["cancelled"]


@pytest.mark.parametrize("block", ["busy", "sleep"])
def test_a_workflow_that_blocks_the_event_loop_is_interrupted(block: str) -> None:
    import time
    import weakref

    from astraflow.raas.watchdog import StallWatchdog

    async def blocking(ctx: RolloutContext) -> Trajectory:
        if block == "busy":
            while True:
                pass
        time.sleep(3600)
        return ctx.finish("never")

    async def main() -> tuple[Trajectory, int]:
        running: weakref.WeakSet = weakref.WeakSet()
        with StallWatchdog(asyncio.get_running_loop(), 0.5, running) as dog:
            traj = await run_workflow(blocking, _ctx(), 60.0, running)
        return traj, dog.interrupted

    traj, interrupted = asyncio.run(main())
    assert traj.status == TrajectoryStatus.ERROR and interrupted == 1
    assert traj.error.startswith("LoopStalled: the workflow blocked the event loop for more than 0.5 s")


def test_the_watchdog_leaves_code_that_is_not_a_workflow_alone() -> None:
    import time
    import weakref

    from astraflow.raas.watchdog import StallWatchdog

    async def main() -> int:
        with StallWatchdog(asyncio.get_running_loop(), 0.2, weakref.WeakSet()) as dog:
            await asyncio.sleep(0.05)
            time.sleep(0.8)  # the node's own code blocking (a flush, say): not interrupted
            await asyncio.sleep(0.05)
        return dog.interrupted

    assert asyncio.run(main()) == 0


def test_what_a_workflow_does_to_its_task_never_reaches_the_answer() -> None:
    ctx = _ctx()
    record = ctx.task

    async def meddling(ctx: RolloutContext) -> Trajectory:
        ctx.task.task_id, ctx.task.metadata = "someone-else", {1: object()}  # type: ignore[dict-item]
        return ctx.finish("x")

    traj = asyncio.run(run_workflow(meddling, ctx, 5.0))
    assert "trajectory_id='someone-else/1', expected 'task-7/1'" in traj.error
    assert traj.trajectory_id == "task-7/1" and traj.metadata == record.metadata and record.task_id == "task-7"


def test_a_workflow_that_changes_its_task_in_place_leaves_the_record_as_read() -> None:
    ctx = _ctx()
    record = ctx.task
    before = repr(record)

    async def meddling(ctx: RolloutContext) -> Trajectory:
        assert ctx.task is not record and ctx.task == record
        ctx.task.metadata["added"] = "x"
        ctx.task.policies.append("another")
        ctx.task.sampling.stop.append("</zz>")
        ctx.task.sampling.max_tokens = 1
        return ctx.finish("x")

    asyncio.run(run_workflow(meddling, ctx, 5.0))
    assert repr(record) == before
