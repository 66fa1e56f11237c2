"""Builds stream workers by app name, in-process (tests, benchmarks) or as a command (supervisors).

    worker = build_worker("reward", EngineSettings("exp", kafka))
    thread = worker.start_thread(); ...; worker.stop(); thread.join()

    subprocess.Popen(app_command("curate", "exp", "--policy", "solver"))

Each call builds a fresh handler; a worker (a `StreamEngine`: one Faust app) runs one handler. Slot defaults can be overridden
per worker (`defaults={"reward": SlotDefault("numeric")}`); the control topic overrides both.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from astraflow.errors import ConfigError
from stream_apps.engine import EngineSettings, StreamEngine
from stream_apps.handler import AppHandler
from stream_apps.slots import SlotDefault

APPS = ("reward", "curate", "curator")


@dataclass
class AppOptions:
    """App-specific options (each app reads the ones it knows)."""

    policies: Sequence[str] = ()  # curate: policies routed; curator: Task.policies
    defaults: dict[str, SlotDefault] = field(default_factory=dict)  # slot -> default strategy
    group_timeout_s: float = 300.0  # curate
    min_group_size: int = 2  # curate
    emitted_ttl_s: float = 86_400.0  # curate: how long emitted group ids are remembered
    curator: object | None = None  # curator: a stream_apps.curator.CuratorOptions


def build_handler(app: str, options: AppOptions | None = None) -> AppHandler:
    """The handler of a built-in app."""
    o = options or AppOptions()
    if app == "reward":
        from stream_apps.reward import RewardApp

        return RewardApp(o.defaults)
    if app == "curate":
        from stream_apps.curate import CurateApp

        return CurateApp(o.policies, group_timeout_s=o.group_timeout_s, min_group_size=o.min_group_size,
                         emitted_ttl_s=o.emitted_ttl_s, defaults=o.defaults)
    if app == "curator":
        from stream_apps.curator import CuratorApp, CuratorOptions

        if not isinstance(o.curator, CuratorOptions):
            raise ConfigError("the curator app needs CuratorOptions (datasets, policies, n_samples, max_ahead)")
        return CuratorApp(o.curator, o.defaults)
    raise ConfigError(f"unknown app {app!r}; apps are {', '.join(APPS)} (user code runs with `astraflow process run`)")


def build_worker(app: str, settings: EngineSettings, options: AppOptions | None = None) -> StreamEngine:
    """A worker for a built-in app (not started)."""
    return StreamEngine(build_handler(app, options), settings)


def build_processor_worker(spec: str | object, settings: EngineSettings, max_consecutive_failures: int | None = None,
                           progress_interval_s: float = 10.0) -> StreamEngine:
    """A worker for a user processor, given as `module:function` or as the Processor itself
    (`stream_apps.process`: it stops after `max_consecutive_failures` failures in a row, 0 = never)."""
    from astraflow.processor import Processor, load_processor
    from stream_apps.process import DEFAULT_MAX_CONSECUTIVE_FAILURES, ProcessorApp

    proc = spec if isinstance(spec, Processor) else load_processor(str(spec))
    settings.max_inflight = proc.concurrency
    limit = DEFAULT_MAX_CONSECUTIVE_FAILURES if max_consecutive_failures is None else max_consecutive_failures
    return StreamEngine(ProcessorApp(proc, limit, progress_interval_s), settings)


def app_command(app: str, experiment: str, *args: str, python: str | None = None) -> list[str]:
    """The command line that runs `app` as its own process (e.g. for a supervisor)."""
    return [python or sys.executable, "-m", "astraflow_cli.main", "app", "run", app, "--experiment", experiment, *args]
