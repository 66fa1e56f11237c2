"""The Faust-native way to run a stream app: `faust -A stream_apps.faust_worker worker`.

    ASTRAFLOW_APP=reward ASTRAFLOW_EXPERIMENT=exp faust -A stream_apps.faust_worker worker -l info
    ASTRAFLOW_APP=curate ASTRAFLOW_EXPERIMENT=exp ASTRAFLOW_POLICIES=solver \\
        faust -A stream_apps.faust_worker worker -l info --without-web
    ASTRAFLOW_PROCESSOR=my_module:my_function ASTRAFLOW_EXPERIMENT=exp faust -A stream_apps.faust_worker worker

Importing this module builds the `faust.App` (`app`) of one AstraFlow worker, exactly as
`astraflow app run` / `astraflow process run` do (same engine, agent, tables, exactly-once
transaction manager), from environment variables: `ASTRAFLOW_APP` (reward | curate) or
`ASTRAFLOW_PROCESSOR` (module:function), `ASTRAFLOW_EXPERIMENT`, and optionally
`ASTRAFLOW_POLICIES` (comma-separated, curate), `ASTRAFLOW_GUARANTEE` (exactly_once |
at_least_once), `ASTRAFLOW_COMPRESSION` (snappy | zstd | lz4 | gzip | none), `ASTRAFLOW_CONFIG` (a config file; `ASTRAFLOW__*` variables apply as usual).
Faust's own worker then runs it: its logging, signals and `--web-port` options apply. The
difference with `astraflow app run`: when the app crashes (a broker gone longer than the
timeouts), Faust's worker exits and its supervisor must restart it, where `astraflow app run`
rebuilds the app in-process. The curator (a source app with no input topic) runs with
`astraflow app run curator` only.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from astraflow.config import load_config
from astraflow.errors import ConfigError
from stream_apps.engine import EngineSettings, StreamEngine


def build_from_env(env: dict[str, str] | None = None) -> StreamEngine:
    """The engine the environment describes (see the module doc); not started."""
    from stream_apps.launch import AppOptions, build_processor_worker, build_worker

    env = dict(os.environ if env is None else env)
    experiment = env.get("ASTRAFLOW_EXPERIMENT")
    if not experiment:
        raise ConfigError("set ASTRAFLOW_EXPERIMENT (and ASTRAFLOW_APP or ASTRAFLOW_PROCESSOR) for faust -A stream_apps.faust_worker")
    cfg = load_config(env.get("ASTRAFLOW_CONFIG"), [])
    settings = EngineSettings(experiment, cfg.kafka, guarantee=env.get("ASTRAFLOW_GUARANTEE", "exactly_once"),  # type: ignore[arg-type]
                              topics=cfg.topics, compression=env.get("ASTRAFLOW_COMPRESSION", "snappy"))  # type: ignore[arg-type]
    if env.get("ASTRAFLOW_PROCESSOR"):
        return build_processor_worker(env["ASTRAFLOW_PROCESSOR"], settings)
    name = env.get("ASTRAFLOW_APP", "")
    if name not in ("reward", "curate"):
        raise ConfigError(f"ASTRAFLOW_APP must be reward or curate here (got {name!r}); run the curator with `astraflow app run`")
    policies = [p for p in env.get("ASTRAFLOW_POLICIES", "").split(",") if p]
    return build_worker(name, settings, AppOptions(policies=policies))


def _app() -> Any:
    engine = build_from_env()
    engine.bind()
    app = engine.build()
    app.conf.datadir = tempfile.mkdtemp(prefix=f"faust-{engine.handler.name}-")  # memory tables: nothing kept there

    @app.task
    async def started() -> None:  # Faust's worker started the app: timers may run the handler now
        engine.started.set()

    return app


app = _app() if os.environ.get("ASTRAFLOW_EXPERIMENT") else None
