"""The figures of bench/multi_policy.py, as pure functions of its runs: the time-to-target rule
(smoothed curves, a target between the warm start and the lowest plateau, the first snapshot at or
above it; the rule itself is in multi_policy.py's module doc), a schedule's ratios against the
trainer-centred run, and means with standard errors over seeds.

A curve is a list of (step, seconds since the run's start, held-out score) snapshots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def ratios(run: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """A schedule's figures of one policy against the trainer-centred run's (same sigma and seed)."""
    def speedup(key: str) -> float | None:
        a, b = run[key], base[key]
        return b / a if a and b else None

    return {"samples_per_s": run["trained_per_s"] / base["trained_per_s"], "time_to_target": speedup("time_to_target_s"),
            "time_to_old_target": speedup("time_to_old_target_s"), "final_minus_baseline": run["final"] - base["final"],
            "final_last_minus_baseline": run["final_last"] - base["final_last"]}


def _mean_se(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5


def over_seeds(rows: list[dict[str, Any]], sigmas: list[float], modes: list[str]) -> list[dict[str, Any]]:
    """Per sigma, schedule and policy: means over seeds with standard errors (see the module doc).
    Finals are plateaus (means of the last snapshots, each of 2 x heldout episodes), so each has a
    binomial s.e. of its own (`final_var_sampling`)."""
    out = []
    for sigma in sigmas:
        for mode in modes:
            runs = [x for x in rows if x["sigma"] == sigma and x["mode"] == mode]
            for p in POLICIES:
                finals = [x[p]["final"] for x in runs]
                final, final_se = _mean_se(finals)
                sampling_se = sum(x[p]["final_var_sampling"] for x in runs) ** 0.5 / len(runs)
                line: dict[str, Any] = {"sigma": sigma, "mode": mode, "policy": p, "seeds": len(runs), "final": final,
                                        "final_se_seeds": final_se, "final_se_sampling": sampling_se}
                text = (f"sigma {sigma} {mode:<16} {p:<9} final {final:.3f} (s.e. {final_se or 0:.3f} over seeds, "
                        f"{sampling_se:.3f} sampling)")
                if mode != "trainer-centred":
                    r = [x["vs_trainer_centred"][p] for x in runs]
                    diff, diff_se = _mean_se([v["final_minus_baseline"] for v in r])
                    speed = _mean_se([v["samples_per_s"] for v in r])
                    line.update(final_minus_baseline=diff, final_minus_baseline_se=diff_se, samples_per_s=speed[0],
                                samples_per_s_se=speed[1])
                    text += (f"; minus baseline {diff:+.3f} (s.e. {diff_se or 0:.3f}); samples/s {speed[0]:.2f}x "
                             f"(s.e. {speed[1] or 0:.2f})")
                    for key, name in (("time_to_target", "time to target"), ("time_to_old_target", "old target")):
                        reached = [v[key] for v in r if v[key]]
                        m, se = _mean_se(reached) if reached else (None, None)
                        line.update({key: m, f"{key}_se": se, f"{key}_seeds": len(reached)})
                        text += f"; {name} " + (f"{m:.2f}x (s.e. {se or 0:.2f}, {len(reached)} seeds)" if reached
                                                else "not reached")
                line["text"] = text
                out.append(line)
    return out
