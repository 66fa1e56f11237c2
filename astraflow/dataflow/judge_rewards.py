"""Rewards of multi-policy workflows: a solver and the verifiers that judge its answer.

`solver_verifier` scores a trajectory of the workflow of that name (metadata `solver` and one
`verdict.<policy>` = yes | no | unclear per verifier) and gives every policy its own reward, as
the component `policy.<name>` that curate uses for that policy's samples:

* **solver**: `correct` (1 if its answer matches the reference, by the `exact_match` reward,
  else 0) plus `bonus * correct * accepted`, where `accepted` is the share of verifiers that
  said yes. The bonus is paid only on correct answers, so the solver never gains by fooling a
  verifier; it only breaks ties between correct answers the verifiers find convincing (0 turns
  it off).
* **each verifier**: 1 if its verdict is the truth (yes for a correct answer, no for a wrong
  one), else 0; `unclear` is wrong either way. A verifier that always says yes scores the
  solver's success rate, one that always says no its failure rate: only checking pays on both.

The trajectory's `reward` is the solver's. A verdict or solver name the workflow could not
have written (a forged or broken record) raises `RewardError`: the record goes to the DLQ.
"""

from __future__ import annotations

from dataclasses import dataclass

from astraflow.dataflow.registry import register
from astraflow.dataflow.rewards import ExactMatch, RewardResult
from astraflow.errors import RewardError
from astraflow.records import Trajectory

VERDICTS = ("yes", "no", "unclear")


def verdicts_of(trajectory: Trajectory) -> tuple[str, dict[str, str]]:
    """(solver policy, {verifier policy: verdict}) from the workflow's metadata, validated."""
    meta = trajectory.metadata
    solver = meta.get("solver")
    trained = {seg.policy for seg in trajectory.segments}
    if not solver or solver not in trained:
        raise RewardError(f"trajectory {trajectory.trajectory_id}: metadata 'solver' ({str(solver)[:80]!r}) does not name "
                          "a policy of its segments; is it from the solver_verifier workflow?")
    verdicts = {k.removeprefix("verdict."): v for k, v in meta.items() if k.startswith("verdict.")}
    for policy, verdict in verdicts.items():
        if verdict not in VERDICTS or policy not in trained or policy == solver:
            raise RewardError(f"trajectory {trajectory.trajectory_id}: verdict of {policy[:80]!r} is {verdict[:20]!r}; "
                              f"expected one of {VERDICTS} from a verifier policy of its segments")
    return solver, verdicts


@register("reward", "solver_verifier", version=1)
@dataclass(frozen=True, slots=True)
class SolverVerifier:
    """Per-policy rewards of the solver_verifier workflow (see the module doc)."""

    bonus: float = 0.2  # extra solver reward for a correct answer, times the share of verifiers that accepted it
    key: str = "answer"  # field of the reference JSON

    def __post_init__(self) -> None:
        if not 0.0 <= self.bonus <= 10.0:
            raise RewardError(f"solver_verifier bonus must be within [0, 10], got {self.bonus}")

    def __call__(self, trajectory: Trajectory) -> RewardResult:
        solver, verdicts = verdicts_of(trajectory)
        correct = ExactMatch(key=self.key)(trajectory).reward
        truth = "yes" if correct else "no"
        accepted = sum(v == "yes" for v in verdicts.values()) / len(verdicts) if verdicts else 0.0
        solver_reward = correct + self.bonus * correct * accepted
        components = {"correct": correct, "accepted": accepted, f"policy.{solver}": solver_reward}
        for policy, verdict in verdicts.items():
            components[f"policy.{policy}"] = float(verdict == truth)
        if verdicts:
            components["verifier_accuracy"] = sum(verdict == truth for verdict in verdicts.values()) / len(verdicts)
        return RewardResult(solver_reward, components)
