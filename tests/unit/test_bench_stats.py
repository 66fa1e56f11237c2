"""bench/_stats.py and bench/_mp_figures.over_seeds: every seed is in every mean, a seed that missed
the target counts at its run's wall time as a bound, and every mean has its 95% interval."""

from __future__ import annotations

import math
from typing import Any

import pytest
from _mp_figures import over_seeds, ratios
from _stats import AT_LEAST, AT_MOST, EXACT, UNKNOWN, censored_ratio, combined_bound, geo_mean, mean_ci, t975

pytestmark = pytest.mark.unit


def test_t_quantiles_match_the_tables() -> None:
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042
    assert t975(40) == pytest.approx(2.021, abs=1e-3) and t975(120) == pytest.approx(1.980, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_a_side_that_missed_the_target_is_counted_at_its_budget_as_a_bound() -> None:
    assert censored_ratio(30.0, 50.0, 10.0, 20.0) == (3.0, EXACT)
    assert censored_ratio(30.0, 50.0, None, 20.0) == (1.5, AT_MOST)  # ours would have needed more than 20 s
    assert censored_ratio(None, 50.0, 10.0, 20.0) == (5.0, AT_LEAST)  # the baseline would have needed more than 50 s
    assert censored_ratio(None, 50.0, None, 20.0) == (2.5, UNKNOWN)
    assert combined_bound([EXACT, AT_LEAST, AT_LEAST]) == AT_LEAST
    assert combined_bound([EXACT, AT_LEAST, AT_MOST]) == UNKNOWN
    assert combined_bound([EXACT, UNKNOWN]) == UNKNOWN


def test_geometric_mean_has_a_t_interval_on_the_logs() -> None:
    m = geo_mean([2.0, 8.0])
    assert m.value == pytest.approx(4.0) and m.n == 2 and m.bound == EXACT
    half = 12.706 * (math.log(8) - math.log(2)) / 2  # t(1) x sd of the logs / sqrt(2)
    assert m.low == pytest.approx(4.0 * math.exp(-half)) and m.high == pytest.approx(4.0 * math.exp(half))
    assert geo_mean([2.0, 8.0], [EXACT, AT_LEAST]).text().startswith(">=4.00x (95% CI ")
    one = geo_mean([1.3])
    assert one.low is None and one.text() == "1.30x (n=1, no interval)"
    a = mean_ci([1.0, 2.0, 3.0])
    assert a.value == 2.0 and a.high - a.value == pytest.approx(4.303 * 1.0 / math.sqrt(3))


def _row(mode: str, seed: int, wall_s: float, t_solver: float | None, t_verifier: float | None) -> dict[str, Any]:
    def policy(t: float | None) -> dict[str, Any]:
        return {"trained_per_s": 64 * 4 / wall_s, "time_to_target_s": t, "time_to_old_target_s": t,
                "final": 0.6, "final_last": 0.6, "final_var_sampling": 0.001}

    return {"sigma": 2.0, "mode": mode, "seed": seed, "wall_s": wall_s,
            "solver": policy(t_solver), "verifier": policy(t_verifier)}


def test_over_seeds_counts_the_seed_that_missed_instead_of_dropping_it() -> None:
    base = [_row("trainer-centred", 0, 50.0, 40.0, 40.0), _row("trainer-centred", 1, 50.0, 40.0, 40.0)]
    ours = [_row("pipeline", 0, 25.0, 10.0, 10.0), _row("pipeline", 1, 25.0, 20.0, None)]
    for x, b in zip(ours, base, strict=True):
        x["vs_trainer_centred"] = {p: ratios(x, b, p) for p in ("solver", "verifier")}
    assert ours[1]["vs_trainer_centred"]["verifier"]["time_to_target"] == pytest.approx(40 / 25)
    assert ours[1]["vs_trainer_centred"]["verifier"]["time_to_target_bound"] == AT_MOST
    lines = {(x["mode"], x["policy"]): x for x in over_seeds([*base, *ours], [2.0], ["trainer-centred", "pipeline"])}
    solver, verifier = lines[("pipeline", "solver")], lines[("pipeline", "verifier")]
    assert solver["time_to_target"]["mean"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert solver["time_to_target"]["bound"] == EXACT and solver["time_to_target"]["ci95"] is not None
    # the old arithmetic (mean over the seeds that reached the target) said 4.00x over 1 seed
    assert verifier["time_to_target"]["mean"] == pytest.approx(math.sqrt(4.0 * 1.6))
    assert verifier["time_to_target"]["n"] == 2 and verifier["time_to_target"]["censored"] == 1
    assert verifier["time_to_target"]["bound"] == AT_MOST and verifier["text"].count("<=") == 2  # target and old target
    assert lines[("trainer-centred", "solver")]["final"]["ci95"] == [pytest.approx(0.6), pytest.approx(0.6)]
