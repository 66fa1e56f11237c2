"""The headline figures of README.md and docs/benchmarks.md, made from bench/results/*.json.

Each headline benchmark writes its results file (`_common.write_json`: figures plus the commit,
machine, terms and whether it was a `--quick` run); this script turns the files into the README's
figure table and the figures section of docs/benchmarks.md, between `<!-- figures:begin -->` and
`<!-- figures:end -->`, so that no figure there is typed by hand.

    python scripts/figures.py write                  # regenerate both blocks from bench/results/
    python scripts/figures.py check                  # fail if either block differs (the fast tier runs it)
    python scripts/figures.py print [--results DIR]  # print the table of a results folder
    python scripts/figures.py run [--quick] [NAME ...]  # run headline benchmarks, then write (full) or print (quick)

`make bench` is `run`, `make bench-quick` is `run --quick` (results in bench/results/quick/,
git-ignored, so the full results are never overwritten), `make bench B=multi_policy` runs one.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _load_stats() -> Any:
    """bench/_stats.py, the benchmarks' one statistics helper (loaded by path: bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_stats", ROOT / "bench" / "_stats.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


stats = _load_stats()
REQUIRED = ("benchmark", "commit", "machine", "terms", "quick")  # what `_common.write_json` writes on top
BLOCK = re.compile(r"(<!-- figures:begin[^>]*-->\n)(.*?)(<!-- figures:end -->)", re.S)

Rows = list[tuple[str, str]]  # (what, figure)


@dataclass(frozen=True)
class Headline:
    """A headline benchmark: how its full and quick runs are made and how its figures read."""

    name: str  # its results file: bench/results/NAME.json
    script: str  # bench/SCRIPT.py
    title: str  # what it measures, as the README's "what" column says it
    full: str  # arguments of the full run behind the docs' figures
    quick: str  # arguments of its `make bench-quick` run
    readme: bool  # a row of the README's table (every headline is in docs/benchmarks.md)
    render: Callable[[dict[str, Any]], tuple[str, Rows]]  # results -> (README figure, docs rows)

    def command(self, quick: bool) -> str:
        return f"python bench/{self.script}.py {self.quick if quick else self.full}".rstrip()


def _x(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}x"


def _rate(v: float) -> str:
    return f"{v:,.0f}/s"


def _time_to_target(run: dict[str, Any], base: dict[str, Any], policy: str) -> tuple[float, str]:
    """A run's time-to-target ratio against its baseline row, a side that missed counted at its wall time."""
    return stats.censored_ratio(base[policy]["time_to_target_s"], base["wall_s"], run[policy]["time_to_target_s"],
                                run["wall_s"])


def _pm(mean: float, se: float | None, n: int) -> str:
    """mean ± s.e. over n seeds, with the 95% t-interval (`stats.t975`); one seed: no interval."""
    if n < 2 or se is None or math.isnan(se):
        return f"{mean:.3f} (n={n}, no interval)"
    half = stats.t975(n - 1) * se
    return f"{mean:.3f} ± {se:.3f} (95% CI {mean - half:.3f}–{mean + half:.3f}, n={n})"


def multi_policy(d: dict[str, Any]) -> tuple[str, Rows]:
    """Per sigma and schedule: time-to-target ratios against the trainer-centred run of the same
    seed, geometric mean over every seed with a 95% interval (a run that missed the target counted
    at its wall time, so its ratio and any mean holding it is a bound), and per seed."""
    rows: Rows = []
    heads = []
    for sigma, mode in dict.fromkeys((x["sigma"], x["mode"]) for x in d["rows"] if x["mode"] != "trainer-centred"):
        runs = [x for x in d["rows"] if (x["sigma"], x["mode"]) == (sigma, mode)]
        bases = {x["seed"]: x for x in d["rows"] if (x["sigma"], x["mode"]) == (sigma, "trainer-centred")}
        means, per_seed, shorts = [], [], []
        for p in ("solver", "verifier"):
            ttt = [_time_to_target(x, bases[x["seed"]], p) for x in runs]
            m = stats.geo_mean([r for r, _ in ttt], [b for _, b in ttt])
            means.append(m.text())
            shorts.append(stats.ratio_text(m.value, m.bound) + ("" if m.low is None else f" (95% CI {m.low:.2f}–{m.high:.2f}x)"))
            per_seed.append((f"sigma {sigma}, {mode}: {p} time to target, per seed",
                             ", ".join(f"seed {x['seed']} {stats.ratio_text(*v)}" for x, v in zip(runs, ttt, strict=True))))
        sps = stats.geo_mean([math.sqrt(x["vs_trainer_centred"]["solver"]["samples_per_s"]
                                        * x["vs_trainer_centred"]["verifier"]["samples_per_s"]) for x in runs])
        rows += [(f"sigma {sigma}, {mode} vs trainer-centred",
                  f"time to target solver {means[0]}, verifier {means[1]} (geometric mean over every seed; a run "
                  f"that missed the target counted at its wall time: a bound, >= or <=, ~ when neither reached it); "
                  f"samples/s {sps.text()}"), *per_seed]
        n = len(runs)
        heads.append(f"{shorts[0]} / {shorts[1]} (sigma {sigma}, {mode}, {n} seed{'s' * (n > 1)}"
                     f"{', no interval' if n == 1 else ''})")
    return "time to target, solver / verifier: " + "; ".join(heads), rows


def async_vs_sync(d: dict[str, Any]) -> tuple[str, Rows]:
    rows: Rows = []
    best: dict[str, list[str]] = {}
    for case in dict.fromkeys((x["workload"], x["sigma"]) for x in d["rows"]):
        label = "a" if case[0] == "a" else f"b sigma {case[1]}"
        got = {x["mode"]: x for x in d["rows"] if (x["workload"], x["sigma"]) == case}
        for prefix, where in (("pipeline-", "pipeline"), ("", "in one process")):
            s, f = got.get(prefix + "sync"), got.get(prefix + "dataflow")
            if not (s and f):
                continue
            ratio = f["trained_per_s"] / s["trained_per_s"]
            tt = stats.ratio_text(*stats.censored_ratio(s["time_to_target_s"], s["wall_s"], f["time_to_target_s"], f["wall_s"]))
            rows.append((f"{label}, {where}: dataflow vs sync",
                         f"samples/s {_x(ratio)} ({f['trained_per_s']:.1f} vs {s['trained_per_s']:.1f}); time to target {tt}; "
                         f"success {s['start_success']:.3f} -> sync {s['final_success']:.3f}, dataflow {f['final_success']:.3f}"))
            if case[0] == "b":
                best.setdefault(where, []).append(f"{_x(ratio)} (sigma {case[1]})")
    where = "pipeline" if "pipeline" in best else "in one process"
    return (f"trained samples/s {', '.join(best[where])}, {where}" if best else "no agentic case in this run"), rows


def _case(label: str) -> str:
    """vs_trl's case label, e.g. "b (sigma 1.0) #2", without the workload: "sigma 1.0 #2"."""
    return label.removeprefix("b (").replace(")", "", 1) if label.startswith("b (") else label


def _vs_trl_time_to_target(d: dict[str, Any], name: str) -> str:
    """TRL / AstraFlow time to target of ratio `name`, a side that missed counted at its wall time."""
    r = d["ratios"][name]
    if "time_to_target_bound" in r:
        return stats.ratio_text(r["time_to_target_trl_over_astraflow"], r["time_to_target_bound"])
    case, side = name.rsplit(" ", 1)  # a file from before the bound: made from its rows
    got = {x["side"]: x for x in d["rows"] if x["case"] == case}
    t, a = got["trl"], got[side]
    return stats.ratio_text(*stats.censored_ratio(t["time_to_target_s"], t["wall_s"], a["time_to_target_s"], a["wall_s"]))


def vs_trl(d: dict[str, Any]) -> tuple[str, Rows]:
    rows: Rows = [(f"{case}: {side} vs TRL", f"samples/s {_x(r['samples_per_s_astraflow_over_trl'])}; time to target "
                   + _vs_trl_time_to_target(d, name))
                  for name, r in d["ratios"].items() for case, side in [name.rsplit(" ", 1)]]
    sides = {name.rsplit(" ", 1)[1] for name in d["ratios"]}
    side = "pipeline" if "pipeline" in sides else "astraflow"
    picked = [f"{_x(r['samples_per_s_astraflow_over_trl'])} ({_case(name.rsplit(' ', 1)[0])})"
              for name, r in d["ratios"].items() if name.endswith(" " + side)]
    return f"samples/s {', '.join(picked)}, {side}", rows


def vs_trl_single(d: dict[str, Any]) -> tuple[str, Rows]:
    summary = d["repeat_summary"]
    rows: Rows = []
    headline = ""
    for name, s in summary.items():
        every = s["every"]
        figure = (f"samples/s {stats.mean_ci(every).text()} mean, {_x(s['median'])} median of {len(every)} pairs "
                  f"({_x(min(every))}–{_x(max(every))})") if len(every) > 1 else \
            f"samples/s {_x(every[0])} (1 pair, no interval)"
        side = name.rsplit(" ", 1)[1]
        rows.append((f"{side} vs TRL, alternated pairs", figure))
        rows.append((f"{side} vs TRL, every pair", ", ".join(_x(x) for x in every)))
        headline = headline or figure
    return headline, rows


def weights(d: dict[str, Any]) -> tuple[str, Rows]:
    rs = d["rows"]
    rows: Rows = [(f"lr {r['lr']:g}", f"{r['changed_fraction']:.0%} of elements changed per step; "
                   f"{r['ours_bytes_per_changed']:.2f} bytes per changed element, {r['reference_over_ours']:.1f}x "
                   "smaller than the reference format") for r in rs]
    per = [r["ours_bytes_per_changed"] for r in rs]
    span = f"{min(per):.2f}–{max(per):.2f}" if len(per) > 1 else f"{per[0]:.2f}"
    return f"{span} bytes per changed element (bf16, {rs[0]['params'] / 1e6:.0f}M params)", rows


def staleness(d: dict[str, Any]) -> tuple[str, Rows]:
    if "figures" not in d:  # it writes after every run: a stopped grid has rows but no summary
        return f"incomplete: {d['completed_runs']} of {d['planned_runs']} runs", []
    rows: Rows = [(f["setting"], f"{f['seeds']} seed{'s' * (f['seeds'] > 1)}; samples/s {f['samples_per_s']:.1f} "
                   f"({_x(f['x_sync'])} sync); staleness mean {f['staleness_mean']:.2f} / max {f['staleness_max']:.0f}; "
                   f"held-out success after the budget {_pm(f['final_mean'], f['final_sem'], f['seeds'])}")
                  for f in d["figures"]]
    rows += [(f"seed {seed}: held-out success after the budget", ", ".join(
        f"{setting} {v['final_success']:.3f}" for setting, v in settings.items())) for seed, settings in d["per_seed"].items()]
    return "held-out success after the budget (mean ± s.e. over seeds, 95% interval): " + "; ".join(
        f"{f['setting']} {_pm(f['final_mean'], f['final_sem'], f['seeds'])}" + ("" if f["setting"] == "sync" else f" at {_x(f['x_sync'])}")
        for f in d["figures"]) + " sync's samples/s", rows


def raas(d: dict[str, Any]) -> tuple[str, Rows]:
    rows: Rows = [(r["setup"], f"{r['tokens_per_s']:,.0f} tokens/s, {r['rollouts_per_s']:.1f} rollouts/s, "
                                f"{r['mean_new_tokens']:.1f} tokens a rollout")
                  for r in d["rows"]]
    return (f"tokens/s {_x(d['ratio_node16_vs_plain_batched_tokens'])} (single-sample), "
            f"{_x(d['ratio_grouped_node16_vs_plain_tokens'])} (groups of {d['group']})"), rows


def dataplane(d: dict[str, Any]) -> tuple[str, Rows]:
    return (f"{_x(d['ratio_vs_raw'])} raw Kafka's trajectories/s",
            [("ours: serde + reward + curate + TrainStream", _rate(d["ours_per_s"])),
             ("raw confluent-kafka, 2 copy loops", _rate(d["raw_per_s"])),
             ("records x repeats", f"{d['records']:,} x {d['repeats']}")])


def apps(d: dict[str, Any]) -> tuple[str, Rows]:
    return (f"{_x(d['ratio_vs_plain'])} a plain copy loop's records/s (exactly-once)",
            [("reward + curate, exactly-once", f"{_rate(d['ours_pipeline_per_s'])}, {_x(d['ratio_vs_plain'])} plain"),
             ("reward + curate, at-least-once",
              f"{_rate(d['at_least_once_pipeline_per_s'])}, {_x(d['at_least_once_ratio_vs_plain'])} plain"),
             ("hand-written exactly-once loops", f"{_rate(d['hand_pipeline_per_s'])}; apps / hand "
                                                 f"{_x(d['ratio_vs_hand']['pipeline'])}"),
             ("plain copy loops", _rate(d["plain_pipeline_per_s"]))])


def serde(d: dict[str, Any]) -> tuple[str, Rows]:
    return (f"{_x(d['ratio_vs_bare'])} bare fastavro's round trips/s ({d['tokens']:,}-token trajectory)",
            [(f"Trajectory, {d['tokens']:,} tokens", f"{_rate(d['roundtrip_per_s'])} round trips (encode "
                                                     f"{_rate(d['encode_per_s'])}, decode {_rate(d['decode_per_s'])}); "
                                                     f"bare {_rate(d['bare_roundtrip_per_s'])}; {_x(d['ratio_vs_bare'])}"),
             ("Task", f"{_rate(d['task']['roundtrip_per_s'])}; bare {_rate(d['task']['bare_roundtrip_per_s'])}; "
                      f"{_x(d['task']['ratio_vs_bare'])}")])


def faults(d: dict[str, Any]) -> tuple[str, Rows]:
    t = d["totals"]
    rows: Rows = [(p["phase"], f"{len(p['faults'])} faults, {p['tasks_issued']} tasks issued, {p['lost']} lost, "
                   f"{p['trained_twice']} trained twice, {len(p['exits'])} roles exited") for p in d["phases"]]
    return (f"{t['lost']} lost, {t['trained_twice']} trained twice of {t['samples_expected']:,} samples "
            f"({sum(len(p['faults']) for p in d['phases'])} faults)"), rows


HEADLINES = (
    Headline("multi_policy", "multi_policy", "two policies (solver + verifier), agentic task",
             "--modes trainer-centred,pipeline --sigmas 2.0 --seeds 0,1,2,3,4", "--quick", True, multi_policy),
    Headline("async_vs_sync", "async_vs_sync", "agentic task, one policy", "", "--quick", True, async_vs_sync),
    Headline("vs_trl_single", "vs_trl", "single turn vs TRL",
             "--workloads a --sides trl,pipeline --steps 64 --repeats 12", "--quick --workloads a --sides trl,pipeline",
             True, vs_trl_single),
    Headline("vs_trl", "vs_trl", "agentic task vs TRL", "--workloads b --sigmas 1.0,1.5", "--quick --workloads b", True,
             vs_trl),
    Headline("weights", "weights", "weight deltas", "", "--quick", True, weights),
    Headline("staleness", "staleness", "learning at high staleness",
             "--staleness 1,2,4,8 --corrections decoupled,stale --seeds 0,1,2,3,4,5 --steps 16 --eval-every 4 --heldout 192",
             "--quick", False, staleness),
    Headline("raas", "raas", "RaaS node vs plain generate", "", "--quick", False, raas),
    Headline("dataplane", "dataplane", "data plane vs raw Kafka", "", "--quick", False, dataplane),
    Headline("apps", "apps", "stream apps (reward + curate)", "", "--quick", False, apps),
    Headline("serde", "serde", "serde", "", "--quick", False, serde),
    Headline("faults", "faults", "faults, counted", "--brokers 3", "--quick", False, faults),
)
# Figures the docs describe that no results file holds yet: (what, why, a README row).
NO_RESULTS_FILE = (
    ("the demo's learning (`make demo`)", "it writes runs/<experiment>/summary.json, not a results file", True),
    ("bad input into the live pipeline (`python bench/bad_inputs.py`)", "it writes no JSON", False),
)


def load(results: Path) -> dict[str, dict[str, Any]]:
    """Every headline's results file found in `results`, checked for the fields write_json adds."""
    out = {}
    for h in HEADLINES:
        path = results / f"{h.name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if missing := [k for k in REQUIRED if k not in data]:
            raise SystemExit(f"{path}: no {', '.join(missing)}: rerun the benchmark (it writes them through "
                             "bench/_common.write_json)")
        out[h.name] = data
    return out


def _run_words(d: dict[str, Any]) -> str:
    m = d["machine"]
    kind = "quick run" if d["quick"] else "full run"
    seeds = d.get("seeds")
    seeds = f", seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}" if isinstance(seeds, list) and seeds else ""
    w = d.get("wall_s")
    wall = "" if w is None else f", {w:.0f} s" if w < 120 else f", {w / 60:.1f} min"
    return f"{kind}{seeds}{wall}; {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB"


def _missing(found: dict[str, Any], quick: bool = False) -> list[str]:
    lines = [f"`{h.name}` (`{h.command(quick)}`)" for h in HEADLINES if h.name not in found]
    lines += [f"{what}: {why}" for what, why, _ in NO_RESULTS_FILE]
    return lines


def readme_block(found: dict[str, dict[str, Any]]) -> str:
    out = ["| what | figure | against, in the same run | command |", "|---|---|---|---|"]
    for h in HEADLINES:
        if h.readme and h.name in found:
            d = found[h.name]
            figure = h.render(d)[0] + (" (quick run)" if d["quick"] else "")
            out.append(f"| {h.title} | {figure} | {d['terms']['against']} | `{h.command(d['quick'])}` |")
    missing = [f"{h.title} (`{h.name}`)" for h in HEADLINES if h.readme and h.name not in found]
    missing += [what for what, _, readme in NO_RESULTS_FILE if readme]
    out += ["", f"No committed result yet, so no figure here: {'; '.join(missing)}."]
    return "\n".join(out) + "\n"


def docs_block(found: dict[str, dict[str, Any]], missing: str = "No committed result yet:", quick: bool = False) -> str:
    out = []
    for h in HEADLINES:
        if h.name not in found:
            continue
        d = found[h.name]
        headline, rows = h.render(d)
        t = d["terms"]
        out += [f"### {h.title}: `{h.name}`", "", f"`{h.command(d['quick'])}`: {_run_words(d)}.", "",
                f"- **ours**: {t['ours']}", f"- **against**: {t['against']}", f"- **settings**: {t['settings']}", "",
                "| | figure |", "|---|---|", f"| **headline** | **{headline}** |",
                *(f"| {what} | {figure} |" for what, figure in rows), ""]
    out += [missing, "", *(f"- {line}" for line in _missing(found, quick))]
    return "\n".join(out) + "\n"


def render_file(text: str, block: str, path: Path) -> str:
    if len(BLOCK.findall(text)) != 1:
        raise SystemExit(f"{path}: needs exactly one <!-- figures:begin --> ... <!-- figures:end --> block")
    return BLOCK.sub(lambda m: m.group(1) + block + m.group(3), text)


def expected(root: Path, results: Path | None = None) -> dict[Path, str]:
    """README.md and docs/benchmarks.md as the results in `results` (default root/bench/results) make them."""
    found = load(results or root / "bench" / "results")
    return {path: render_file(path.read_text(), block, path)
            for path, block in ((root / "README.md", readme_block(found)),
                                (root / "docs" / "benchmarks.md", docs_block(found)))}


def check(root: Path) -> list[str]:
    """Unified diffs of the files whose figures differ from the results (empty: all agree)."""
    return ["".join(difflib.unified_diff(path.read_text().splitlines(True), want.splitlines(True), str(path),
                                         f"{path} (from bench/results)"))
            for path, want in expected(root).items() if path.read_text() != want]


def run(names: list[str], quick: bool) -> int:
    """Run the headline benchmarks `names` (all if empty) one after the other; the failed ones' names."""
    known = {h.name: h for h in HEADLINES}
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown benchmark(s) {unknown}: choose from {', '.join(known)}")
    failed = []
    for h in (known[n] for n in names) if names else HEADLINES:
        out = ROOT / "bench" / "results" / ("quick" if quick else "") / f"{h.name}.json"
        cmd = [sys.executable, f"bench/{h.script}.py", *shlex.split(h.quick if quick else h.full), "--json", str(out)]
        print(f"== {h.name}: {shlex.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd, cwd=ROOT)
        print(f"== {h.name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(h.name)
    return len(failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("write", help="regenerate the figures blocks of README.md and docs/benchmarks.md")
    sub.add_parser("check", help="exit 1 if the blocks differ from what bench/results says")
    p = sub.add_parser("print", help="print the docs' figures of a results folder")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    r = sub.add_parser("run", help="run headline benchmarks, then write (full) or print (quick)")
    r.add_argument("--quick", action="store_true", help="their --quick forms, results in bench/results/quick/")
    r.add_argument("names", nargs="*", help=f"of {', '.join(h.name for h in HEADLINES)} (default: all)")
    args = ap.parse_args()
    if args.cmd == "check":
        if diffs := check(ROOT):
            print("".join(diffs))
            raise SystemExit("the figures in the docs differ from bench/results: run `python scripts/figures.py write`")
        print("figures: README.md and docs/benchmarks.md agree with bench/results")
    elif args.cmd == "write":
        for path, text in expected(ROOT).items():
            path.write_text(text)
            print(f"wrote the figures of {path.relative_to(ROOT)}")
    elif args.cmd == "print":
        print(docs_block(load(args.results), f"No result in {args.results}:"))
    else:
        failed = run(args.names, args.quick)
        if args.quick:
            print(docs_block(load(ROOT / "bench" / "results" / "quick"), "No quick result (it failed or did not run):", True))
        else:
            for path, text in expected(ROOT).items():
                path.write_text(text)
        raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
