"""The figures of bench/multi_policy.py, as pure functions of its runs: the time-to-target rule
(smoothed curves, a target between the warm start and the lowest plateau, the first snapshot at or
above it; the rule itself is in multi_policy.py's module doc), a schedule's ratios against the
trainer-centred run, and means over seeds with 95% intervals (`bench/_stats.py`: every seed
counted, a run that missed the target censored at its wall time).

A curve is a list of (step, seconds since the run's start, held-out score) snapshots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from _stats import censored_ratio, geo_mean, mean_ci

if TYPE_CHECKING:
    from multi_policy import Run

POLICIES = ("solver", "verifier")


def smoothed(score: list[tuple[int, float, float]], window: int) -> list[tuple[int, float, float]]:
    """Each snapshot's figure replaced by the mean of it and the `window` - 1 before it (fewer at
    the start): known at the snapshot's time, so a time to target on it is no later than claimed."""
    return [(step, t, sum(x[2] for x in score[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)))
            for i, (step, t, _) in enumerate(score)]


def first_at_or_above(curve: list[tuple[int, float, float]], target: float | None) -> tuple[int, float] | None:
    """(step, time) of the first point of `curve` at or above `target`; None if none or no target."""
    if target is None:
        return None
    return next(((step, t) for step, t, s in curve if s >= target), None)


def targets_of(runs: list[Run], policy: str, frac: float, window: int) -> float | None:
    """The target of `policy` for these runs of one sigma and seed (module doc, "Time to target"):
    the warm start plus `frac` of the way to the lowest plateau; None if none ends above the start."""
    start = runs[0].policies[policy].score[0][2]
    ceiling = min(smoothed(r.policies[policy].score, window)[-1][2] for r in runs)
    return start + frac * (ceiling - start) if ceiling > start else None


def ratios(run: dict[str, Any], base: dict[str, Any], policy: str) -> dict[str, Any]:
    """A schedule's figures of `policy` against the trainer-centred run's (same sigma and seed;
    `Run.summary` rows). Time-to-target ratios count a run that missed the target at its wall
    time, and say so in `<key>_bound` (`_stats.censored_ratio`: `>=`, `<=`, `?` or exact "")."""
    a, b = run[policy], base[policy]
    out: dict[str, Any] = {"samples_per_s": a["trained_per_s"] / b["trained_per_s"]}
    for key, field in (("time_to_target", "time_to_target_s"), ("time_to_old_target", "time_to_old_target_s")):
        out[key], out[f"{key}_bound"] = censored_ratio(b[field], base["wall_s"], a[field], run["wall_s"])
    return {**out, "final_minus_baseline": a["final"] - b["final"],
            "final_last_minus_baseline": a["final_last"] - b["final_last"]}


def over_seeds(rows: list[dict[str, Any]], sigmas: list[float], modes: list[str]) -> list[dict[str, Any]]:
    """Per sigma, schedule and policy: means over every seed with 95% intervals. Finals are
    plateaus (means of the last snapshots, each of 2 x heldout episodes), so each also has a
    binomial s.e. of its own (`final_var_sampling`). Time-to-target ratios: geometric means over
    every seed, a seed that missed the target counted at its run's wall time (a bound, flagged)."""
    out = []
    for sigma in sigmas:
        for mode in modes:
            runs = [x for x in rows if x["sigma"] == sigma and x["mode"] == mode]
            for p in POLICIES:
                final = mean_ci([x[p]["final"] for x in runs])
                sampling_se = sum(x[p]["final_var_sampling"] for x in runs) ** 0.5 / len(runs)
                line: dict[str, Any] = {"sigma": sigma, "mode": mode, "policy": p, "seeds": len(runs),
                                        "final": final.as_json(), "final_se_sampling": sampling_se}
                text = f"sigma {sigma} {mode:<16} {p:<9} final {final.text('{:.3f}')} (s.e. {sampling_se:.3f} sampling)"
                if mode != "trainer-centred":
                    r = [x["vs_trainer_centred"][p] for x in runs]
                    diff = mean_ci([v["final_minus_baseline"] for v in r])
                    speed = geo_mean([v["samples_per_s"] for v in r])
                    line.update(final_minus_baseline=diff.as_json(), samples_per_s=speed.as_json())
                    text += f"; minus baseline {diff.text('{:+.3f}')}; samples/s {speed.text()}"
                    for key, name in (("time_to_target", "time to target"), ("time_to_old_target", "old target")):
                        m = geo_mean([v[key] for v in r], [v[f"{key}_bound"] for v in r])
                        line[key] = m.as_json()
                        text += f"; {name} {m.text()}"
                line["text"] = text
                out.append(line)
    return out


def per_seed(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per seed, each schedule's ratios against that seed's trainer-centred run, by sigma and policy."""
    out: dict[str, dict[str, Any]] = {}
    for x in rows:
        if "vs_trainer_centred" in x:
            out.setdefault(str(x["seed"]), {})[f"sigma {x['sigma']} {x['mode']}"] = x["vs_trainer_centred"]
    return out

