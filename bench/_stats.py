"""The statistics of the benchmarks' figures over seeds or pairs, in one place (issue 44, "Every seed counted").

* **Time-to-target ratios count every seed.** A run that never reaches the target is *censored*
  at its budget (the run's wall time: it would have reached the target no earlier than that), so
  the ratio against it is a bound, not a figure: `censored_ratio` says which way. A seed that
  misses the target stays in the mean instead of dropping out of it.
* **Ratios are averaged geometrically** (a 2x and a 0.5x average to 1x), with a 95% interval
  from the t distribution on the logs of the ratios (`geo_mean`). A mean that mixes bounds of
  one direction with exact ratios is a bound of that direction; with bounds both ways (or a
  seed where neither side reached the target) it is neither, and says so.
* **Every other mean over seeds or pairs** gets a 95% t-interval (`mean_ci`). One seed: no interval.

Pure functions of plain numbers, so scripts/figures.py renders results files with them (and
tests/unit/test_bench_stats.py checks them without running a benchmark).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t (0.975) for 1..30 degrees of freedom; beyond, the
# Cornish-Fisher expansion around the normal's 1.96 (error below 1e-3 there).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
EXACT, AT_LEAST, AT_MOST, UNKNOWN = "", ">=", "<=", "?"  # how a ratio (or a mean of ratios) relates to the true one


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def censored_ratio(base_s: float | None, base_budget_s: float, ours_s: float | None,
                   ours_budget_s: float) -> tuple[float, str]:
    """Speed-up of ours over the baseline in time to target, `base_s / ours_s`, with a side that
    missed the target (None) censored at its budget: (ratio, bound). Ours missed: the ratio is at
    most that (`<=`); the baseline missed: at least (`>=`); both: the budgets' ratio, no bound (`?`)."""
    if base_budget_s <= 0 or ours_budget_s <= 0:
        raise ValueError(f"budgets must be positive, got baseline {base_budget_s}, ours {ours_budget_s}")
    base, ours = base_s if base_s is not None else base_budget_s, ours_s if ours_s is not None else ours_budget_s
    if base <= 0 or ours <= 0:
        raise ValueError(f"times to target must be positive, got baseline {base}, ours {ours}")
    bound = (EXACT if base_s is not None else AT_LEAST) if ours_s is not None else \
        (AT_MOST if base_s is not None else UNKNOWN)
    return base / ours, bound


def ratio_text(ratio: float, bound: str) -> str:
    """One censored ratio (`censored_ratio`): `3.00x`, `>=2.10x`, `<=0.90x`, `~1.00x` (neither reached)."""
    return ("~" if bound == UNKNOWN else bound) + f"{ratio:.2f}x"


def combined_bound(bounds: list[str]) -> str:
    """The bound of a mean of ratios with these bounds: exact only if all are; one direction if
    the censored ones all go that way; otherwise none (`?`)."""
    kinds = set(bounds) - {EXACT}
    if not kinds:
        return EXACT
    return kinds.pop() if len(kinds) == 1 and UNKNOWN not in kinds else UNKNOWN


@dataclass(frozen=True)
class Mean:
    """A mean over n seeds or pairs with its 95% interval (None with one value), and its bound."""

    value: float
    n: int
    low: float | None = None  # 95% interval; None when n == 1
    high: float | None = None
    bound: str = EXACT  # EXACT, AT_LEAST, AT_MOST or UNKNOWN (module doc)
    censored: int = 0  # how many of the n values were bounds rather than figures

    def text(self, fmt: str = "{:.2f}x") -> str:
        """e.g. `>=2.10x (95% CI 1.52–2.90x, n=5, 1 censored)` or `1.30x (n=1, no interval)`."""
        bound = "~" if self.bound == UNKNOWN else self.bound
        ci = "" if self.low is None or self.high is None else \
            f"95% CI {fmt.format(self.low).removesuffix('x')}–{fmt.format(self.high)}, "
        tail = f"n={self.n}" + (", no interval" if not ci else "") + (f", {self.censored} censored" if self.censored else "")
        return f"{bound}{fmt.format(self.value)} ({ci}{tail})"

    def as_json(self) -> dict[str, object]:
        return {"mean": self.value, "n": self.n, "ci95": [self.low, self.high] if self.low is not None else None,
                "bound": self.bound, "censored": self.censored}


def mean_ci(xs: list[float]) -> Mean:
    """Arithmetic mean with a 95% t-interval."""
    if not xs:
        raise ValueError("a mean needs at least one value")
    n, m = len(xs), math.fsum(xs) / len(xs)
    if n == 1:
        return Mean(m, 1)
    half = t975(n - 1) * (math.fsum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5
    return Mean(m, n, m - half, m + half)


def geo_mean(ratios: list[float], bounds: list[str] | None = None) -> Mean:
    """Geometric mean of positive ratios with a 95% t-interval on their logs; `bounds` (one per
    ratio, from `censored_ratio`) make it a bound where censored ratios are in it."""
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"a geometric mean needs positive ratios, got {ratios}")
    bounds = bounds or [EXACT] * len(ratios)
    if len(bounds) != len(ratios):
        raise ValueError(f"{len(ratios)} ratios but {len(bounds)} bounds")
    logs = mean_ci([math.log(r) for r in ratios])
    low, high = (math.exp(logs.low), math.exp(logs.high)) if logs.low is not None and logs.high is not None \
        else (None, None)
    return Mean(math.exp(logs.value), logs.n, low, high, combined_bound(bounds),
                sum(1 for b in bounds if b != EXACT))
