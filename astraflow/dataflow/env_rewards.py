"""Rewards of the AgentBench-style environments (`astraflow.envs`): the outcome, not the text.

- `sql_result`: rebuilds the task's database from the reference, runs the ground-truth query
  under the same guard as the agent's SQL (the reference comes from a record too), and gives 1
  when the final answer holds the same values (order and case aside; numbers compared to 4
  decimals), else 0.
- `os_check`: the verdict of the task's check script, which the `os_agent` workflow ran in the
  sandbox on the final files when the agent stopped (`metadata.os_check`); 1 for `pass`. Only a
  trajectory of that workflow counts (a task cannot bring its own verdict through metadata:
  the workflow always overwrites it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import RewardResult, load_reference
from astraflow.envs.database import DbSpecError, GuardedDb, SqlError, answer_values, parse_spec, rows_values
from astraflow.errors import RewardError
from astraflow.records import Trajectory, TrajectoryStatus


@register("reward", "sql_result", version=1)
@dataclass(frozen=True, slots=True)
class SqlResult:
    """1 if the final answer holds the values of the ground-truth query's result, else 0."""

    timeout_s: float = 2.0  # deadline of the ground-truth query

    def expected(self, trajectory: Trajectory) -> list[str]:
        ref = load_reference(trajectory)
        query = ref.get("query")
        if not isinstance(query, str) or not query.strip():
            raise RewardError(f"trajectory {trajectory.trajectory_id}: reference needs 'query', the ground-truth SQL")
        try:
            db = GuardedDb(parse_spec(ref.get("db")), timeout_s=self.timeout_s, max_rows=1000)
        except DbSpecError as exc:
            raise RewardError(f"trajectory {trajectory.trajectory_id}: reference 'db': {exc}") from exc
        try:
            return rows_values(db.query(query))
        except SqlError as exc:
            raise RewardError(f"trajectory {trajectory.trajectory_id}: the ground-truth query failed: {exc}") from exc
        finally:
            db.close()

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        want = self.expected(trajectory)
        if not trajectory.final_answer:
            return RewardResult(0.0, {"sql_match": 0.0, "answered": 0.0})
        hit = answer_values(trajectory.final_answer) == want
        return RewardResult(float(hit), {"sql_match": float(hit), "answered": 1.0})

    async def score_async(self, trajectory: Trajectory) -> RewardResult:
        return await asyncio.to_thread(self, trajectory)


@register("reward", "os_check", version=1)
@dataclass(frozen=True, slots=True)
class OsCheck:
    """1 if the task's check script passed on the agent's final files (run by `os_agent`), else 0."""

    workflow: str = "os_agent"  # the workflow whose verdicts count

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        if trajectory.workflow != self.workflow:
            raise RewardError(f"trajectory {trajectory.trajectory_id}: os_check scores {self.workflow} trajectories, "
                              f"not {trajectory.workflow[:100]!r}")
        verdict = trajectory.metadata.get("os_check")
        checked = verdict in ("pass", "fail") and trajectory.status is not TrajectoryStatus.ERROR
        passed = checked and verdict == "pass"
        return RewardResult(float(passed), {"os_check": float(passed), "checked": float(checked)})


__all__ = ["OsCheck", "SqlResult"]
