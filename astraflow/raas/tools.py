"""Tools an agent can call during a rollout: calculator, Python (in the sandbox), local search.

A tool is an async function from the argument text the model wrote to a result text. Tools may
be slow or fail: `ToolBox.call` times them, turns any failure into an error string the model
sees, and records a `ToolCall`, so a broken tool never ends a rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from astraflow.errors import ConfigError
from astraflow.records import ToolCall

ToolFn = Callable[[str], Awaitable[str]]


async def calculator(args: str) -> str:
    """Exact arithmetic on + - * / // % and parentheses (no eval: parsed with ast; powers are refused)."""
    from astraflow.models.arith import calculate

    return calculate(args)


async def python_exec(args: str, *, wall_s: float = 5.0) -> str:
    """Runs the code in the sandbox (separate process, limits, no network) and returns stdout."""
    from astraflow.sandbox import SandboxLimits, run_python_async

    res = await run_python_async(args, limits=SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s))))
    if not res.ok:
        reason = res.killed_reason or f"exit code {res.exit_code}"
        raise RuntimeError(f"python failed ({reason}): {res.stderr[-300:]}")
    return res.stdout[-2000:]


class LocalSearch:
    """Keyword search (BM25) over a small local corpus: a JSONL file of {"id", "text"} or a folder of .txt."""

    def __init__(self, corpus: str | Path | list[str], k: int = 3) -> None:
        self.docs = self._load(corpus)
        self.k = k
        self._tf = [Counter(self._tokens(d)) for d in self.docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / max(len(self._len), 1)
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.docs)
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    @staticmethod
    def _tokens(text: str) -> list[str]:
        return re.findall(r"\w+", text.lower())

    @staticmethod
    def _load(corpus: str | Path | list[str]) -> list[str]:
        if isinstance(corpus, list):
            return corpus
        path = Path(corpus)
        if path.is_dir():
            return [p.read_text() for p in sorted(path.glob("*.txt"))]
        return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]

    def search(self, query: str) -> list[str]:
        q = self._tokens(query)
        scores = []
        for i, tf in enumerate(self._tf):
            s = 0.0
            for t in q:
                f = tf.get(t, 0)
                if f:
                    s += self._idf[t] * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * self._len[i] / self._avg))
            scores.append((s, i))
        return [self.docs[i] for s, i in sorted(scores, reverse=True)[: self.k] if s > 0]

    async def __call__(self, args: str) -> str:
        hits = self.search(args)
        return "\n".join(hits) if hits else "no results"


def slow_tool(fn: ToolFn, median_s: float, sigma: float, seed: int | None = None) -> ToolFn:
    """`fn` behind a log-normal delay (median `median_s`, log-space std `sigma`), drawn per call.

    Remote tools and environments (web APIs, sandboxes, simulators) have heavy-tailed latency;
    benchmarks use this to put that tail on a local tool. `sigma` sets the tail weight: the p99
    delay is median * exp(2.33 * sigma) (0.5: 3.2x the median, 1.0: 10x, 1.5: 33x).
    """
    import random

    rng = random.Random(seed)

    async def slow(args: str) -> str:
        await asyncio.sleep(rng.lognormvariate(math.log(median_s), sigma))
        return await fn(args)

    return slow


class ToolBox:
    """The tools one rollout may use, with a timeout each; records every call."""

    def __init__(self, tools: dict[str, ToolFn], timeout_s: float = 10.0) -> None:
        self.tools = tools
        self.timeout_s = timeout_s

    async def call(self, name: str, args: str, turn: int) -> ToolCall:
        t0 = time.perf_counter()
        fn = self.tools.get(name)
        result, error = "", None
        if fn is None:
            error = f"unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        else:
            try:
                result = await asyncio.wait_for(fn(args), self.timeout_s)
            except TimeoutError:
                error = f"tool {name} timed out after {self.timeout_s:.0f}s"
            except Exception as exc:  # any tool failure becomes an observation, never a crash
                error = f"{type(exc).__name__}: {exc}"
        return ToolCall(turn, name, args, result, time.perf_counter() - t0, error)


def default_tools(search_corpus: str | Path | list[str] | None = None,
                  latency: dict[str, tuple[float, float]] | None = None, seed: int | None = None) -> dict[str, ToolFn]:
    """The node's tools; `latency` puts named tools behind `slow_tool` (name -> (median_s, sigma))."""
    tools: dict[str, ToolFn] = {"calc": calculator, "python": python_exec}
    if search_corpus is not None:
        tools["search"] = LocalSearch(search_corpus)
    for name, (median_s, sigma) in (latency or {}).items():
        if name not in tools:
            raise ConfigError(f"--tool-latency names the tool {name!r}, which this node does not have; "
                              f"its tools are: {', '.join(sorted(tools))}")
        tools[name] = slow_tool(tools[name], median_s, sigma, seed=seed)
    return tools


def parse_tool_latency(items: list[str]) -> dict[str, tuple[float, float]]:
    """`["calc=0.2:1.5"]` -> `{"calc": (0.2, 1.5)}` (NAME=MEDIAN_SECONDS:SIGMA, as `raas serve --tool-latency`)."""
    out: dict[str, tuple[float, float]] = {}
    for item in items:
        name, eq, spec = item.partition("=")
        median, colon, sigma = spec.partition(":")
        try:
            m, s = float(median), float(sigma)
        except ValueError:
            m = s = -1.0
        if not eq or not name.strip() or not colon or m <= 0 or s < 0:
            raise ConfigError(f"--tool-latency {item!r} must look like NAME=MEDIAN_SECONDS:SIGMA with a positive "
                              "median and a sigma >= 0, e.g. calc=0.2:1.5 (log-normal delay per call)")
        out[name.strip()] = (m, s)
    return out
