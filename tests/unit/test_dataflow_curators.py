"""Prompt statistics (EWMA, pooled moments, streaks) and curators' choices with fixed seeds."""

from __future__ import annotations

import math

import pytest

from astraflow.dataflow.curators import (
    AcceptAll,
    FilterSolved,
    Greso,
    Prompt,
    adapt_exploration,
    greso_keep_probability,
)
from astraflow.dataflow.curriculum import CurriculumOrdered, CurriculumTarget, curriculum_weights
from astraflow.dataflow.mixing import Mix
from astraflow.dataflow.prompt_stats import ewma, update_prompt_stats
from astraflow.dataflow.registry import get
from astraflow.errors import StrategyError
from astraflow.records import PromptStats

pytestmark = pytest.mark.unit


def stats(
    prompt_id: str, ewma_rate: float = 0.5, streak: int = 0, last: float = 0.5, groups: int = 3
) -> PromptStats:
    return PromptStats(
        prompt_id=prompt_id,
        dataset="d",
        policy="pi",
        groups=groups,
        samples=4 * groups,
        last_pass_rate=last,
        pass_rate_ewma=ewma_rate,
        reward_mean=0.5,
        reward_std=0.5,
        mean_length=10.0,
        zero_variance_streak=streak,
        last_version=1,
        updated_at=0,
    )


def ids(prompts: list[Prompt]) -> list[str]:
    return [p.prompt_id for p in prompts]


POOL = [Prompt("a", "d"), Prompt("b", "d"), Prompt("c", "d")]


def test_ewma_by_hand() -> None:
    assert ewma(None, 0.5, 0.3) == 0.5  # first value taken as is
    assert ewma(0.5, 1.0, 0.3) == pytest.approx(0.65)  # 0.3 * 1 + 0.7 * 0.5
    assert ewma(0.65, 0.0, 0.3) == pytest.approx(0.455)  # 0.7 * 0.65
    with pytest.raises(StrategyError):
        ewma(0.5, 1.0, 0.0)


def test_update_prompt_stats_sequence_by_hand() -> None:
    s1 = update_prompt_stats(
        None,
        [1, 0, 1, 1],
        [10, 20, 30, 40],
        3,
        alpha=0.5,
        prompt_id="p",
        dataset="d",
        policy="pi",
        updated_at=7,
    )
    assert (s1.groups, s1.samples, s1.last_pass_rate, s1.pass_rate_ewma) == (1, 4, 0.75, 0.75)
    assert s1.reward_mean == pytest.approx(0.75) and s1.reward_std == pytest.approx(math.sqrt(0.1875))
    assert (s1.mean_length, s1.zero_variance_streak, s1.last_version, s1.updated_at) == (25.0, 0, 3, 7)

    s2 = update_prompt_stats(s1, [1, 1], [50, 50], 2, alpha=0.5)
    assert s2.pass_rate_ewma == pytest.approx(0.875)  # 0.5 * 1 + 0.5 * 0.75
    # all six rewards [1, 0, 1, 1, 1, 1]: mean 5/6, population variance 5/6 - 25/36 = 5/36
    assert s2.reward_mean == pytest.approx(5 / 6) and s2.reward_std == pytest.approx(math.sqrt(5) / 6)
    assert s2.mean_length == pytest.approx(200 / 6)
    assert (s2.groups, s2.samples, s2.zero_variance_streak, s2.last_version) == (2, 6, 1, 3)

    s3 = update_prompt_stats(s2, [0, 0], [5, 5], 4, alpha=0.5)
    assert (s3.zero_variance_streak, s3.last_pass_rate, s3.pass_rate_ewma) == (2, 0.0, pytest.approx(0.4375))
    s4 = update_prompt_stats(s3, [0, 1], [5, 5], 5, alpha=0.5)
    assert s4.zero_variance_streak == 0 and s4.last_pass_rate == 0.5
    assert update_prompt_stats(s4, [0.6, 0.7], [1, 1], 5, pass_threshold=0.65).last_pass_rate == 0.5


def test_update_prompt_stats_rejects_bad_input() -> None:
    with pytest.raises(StrategyError, match="one length per sample"):
        update_prompt_stats(None, [1, 0], [3], 0, prompt_id="p", dataset="d", policy="pi")
    with pytest.raises(StrategyError, match="first update"):
        update_prompt_stats(None, [1, 0], [3, 3], 0)


def test_accept_all_round_robin_and_shuffled_epochs() -> None:
    rr = AcceptAll(shuffle=False)
    assert ids(rr(POOL, {}, 2).chosen) == ["a", "b"]
    assert ids(rr(POOL, {}, 2).chosen) == ["c", "a"]
    shuffled, again = AcceptAll(seed=7), AcceptAll(seed=7)
    picks = ids(shuffled(POOL, {}, 6).chosen)
    assert sorted(picks[:3]) == ["a", "b", "c"] and sorted(picks[3:]) == [
        "a",
        "b",
        "c",
    ]  # every epoch complete
    assert ids(again(POOL, {}, 6).chosen) == picks  # same seed, same order


def test_filter_solved_skips_solved_prompts() -> None:
    curator = FilterSolved(threshold=0.9, shuffle=False)
    out = curator(POOL, {"a": stats("a", ewma_rate=0.95), "b": stats("b", ewma_rate=0.5)}, 5)
    assert ids(out.chosen) == ["b", "c"]  # one pass over the pool, never spins
    assert [(s.prompt.prompt_id, s.reason) for s in out.skipped] == [
        ("a", "solved: EWMA pass rate 0.950 >= 0.9")
    ]
    young = FilterSolved(threshold=0.9, min_groups=5, shuffle=False)
    assert ids(young(POOL, {"a": stats("a", ewma_rate=0.95)}, 3).chosen) == ["a", "b", "c"]


def test_greso_probabilities_by_hand() -> None:
    assert greso_keep_probability(0, 0.5) == 1.0
    assert greso_keep_probability(1, 0.5) == 0.5
    assert greso_keep_probability(3, 0.5) == 0.125  # skip probability 1 - 0.5**3 = 0.875
    assert greso_keep_probability(3, 0.5, floor=0.2) == 0.2
    target_easy = 0.25 / 3
    assert adapt_exploration(0.5, 0.2, target_easy, 0.01, 0.05, 0.95) == pytest.approx(
        0.49
    )  # too many: skip more
    assert adapt_exploration(0.5, 0.0, target_easy, 0.01, 0.05, 0.95) == pytest.approx(0.51)
    assert adapt_exploration(0.05, 1.0, target_easy, 0.01, 0.05, 0.95) == 0.05  # exploration floor
    assert adapt_exploration(0.95, 0.0, target_easy, 0.01, 0.05, 0.95) == 0.95
    g = Greso(p_easy=0.5, p_hard=0.5)
    g.observe(easy=2, hard=1, total=10)  # easy 0.2 >= 1/12; hard 0.1 < 1/6
    assert (g.p_easy, g.p_hard) == (pytest.approx(0.49), pytest.approx(0.51))


def test_greso_choices_with_fixed_seed() -> None:
    g = Greso(p_easy=1.0, p_hard=0.05, shuffle=False, seed=3)
    table = {"b": stats("b", streak=4, last=1.0), "c": stats("c", streak=5, last=0.0)}
    assert g.keep_probability(table["b"]) == 1.0 and g.keep_probability(table["c"]) == pytest.approx(0.05**5)
    out = g(POOL, table, 3)
    assert ids(out.chosen) == ["a", "b"]
    assert [s.reason for s in out.skipped] == ["greso: all-failed streak 5, keep probability 0.000"]
    # a streak of 2 at p = 0.5 is rolled out a quarter of the time
    single = [Prompt("x", "d")]
    flips = Greso(p_hard=0.5, seed=11)
    kept = sum(len(flips(single, {"x": stats("x", streak=2, last=0.0)}, 1).chosen) for _ in range(4000))
    assert kept / 4000 == pytest.approx(0.25, abs=0.03)
    replay = Greso(p_hard=0.5, seed=11)
    assert (
        sum(len(replay(single, {"x": stats("x", streak=2, last=0.0)}, 1).chosen) for _ in range(4000)) == kept
    )


def test_curriculum_target_prefers_pass_rates_near_target() -> None:
    assert curriculum_weights([0.5, 0.4, 1.0], 0.5, 0.1) == pytest.approx([1.0, math.exp(-1), math.exp(-5)])
    pool = [*POOL, Prompt("d", "d")]
    table = {"a": stats("a", ewma_rate=1.0), "b": stats("b", ewma_rate=0.5), "c": stats("c", ewma_rate=0.0)}
    sharp = CurriculumTarget(temperature=0.01, seed=0)  # d is unseen: counts as the target
    assert sorted(ids(sharp(pool, table, 2).chosen)) == ["b", "d"]
    first, second = CurriculumTarget(seed=5), CurriculumTarget(seed=5)
    assert ids(first(pool, table, 3).chosen) == ids(second(pool, table, 3).chosen)
    assert len(set(ids(first(pool, table, 10).chosen))) == 4  # k > pool: each prompt once


def test_curriculum_ordered_moves_the_frontier() -> None:
    pool = [Prompt("a", "d", 1.0), Prompt("b", "d", 1.0), Prompt("c", "d", 2.0), Prompt("d", "d", 3.0)]
    curriculum = get("curator", "curriculum_ordered", advance_at=0.7, shuffle=False).impl
    assert isinstance(curriculum, CurriculumOrdered)
    out = curriculum(pool, {}, 2)  # nothing seen yet: only the easiest level
    assert ids(out.chosen) == ["a", "b"] and {s.prompt.prompt_id for s in out.skipped} == {"c", "d"}
    table = {"a": stats("a", ewma_rate=0.8), "b": stats("b", ewma_rate=0.9)}
    out = curriculum(pool, table, 3)  # level 1 solved (mean 0.85 >= 0.7): difficulty 2 opens
    assert curriculum.level == 1 and ids(out.chosen) == ["a", "b", "c"]
    table["c"] = stats("c", ewma_rate=0.2)  # mean (0.8 + 0.9 + 0.2) / 3 = 0.63 < 0.7: stays
    curriculum(pool, table, 1)
    assert curriculum.level == 1


def test_mix_follows_weights_exactly() -> None:
    pool = [Prompt("a1", "A"), Prompt("a2", "A"), Prompt("b1", "B"), Prompt("c1", "C")]
    mix = Mix(weights={"A": 2.0, "B": 1.0}, shuffle=False)
    # smooth weighted round robin: A, B, A, A, B, A; within a dataset in turn; C has no weight
    assert ids(mix(pool, {}, 6).chosen) == ["a1", "b1", "a2", "a1", "b1", "a2"]
    with pytest.raises(StrategyError):
        Mix(weights={"A": 0.0})
    assert Mix(weights={"Z": 1.0})(pool, {}, 3).chosen == []
