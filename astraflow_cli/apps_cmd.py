"""`astraflow app run | list`, `astraflow control set | show | unset`, `astraflow process run`.

Stream apps (reward, curate, curator), the control topic that hot-swaps their strategies, and
the runner of user processors. Heavy imports (Kafka clients, numpy, the apps) happen inside
the commands, so `--help` stays instant.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from astraflow_cli.common import console, err_console, handle_errors, load

app_app = typer.Typer(help="Run the stream apps (Faust workers): reward, curate, curator.", no_args_is_help=True)
control_app = typer.Typer(help="Select the strategies of running apps (hot swap, no restart).", no_args_is_help=True)
process_app = typer.Typer(help="Run user processors written with @astraflow.processor.", no_args_is_help=True)

EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name (topics are af.<experiment>.*).")

# Slots of the built-in apps: slot -> (strategy kind, default), for `app list` and validation.
SLOT_KINDS = {"reward": "reward", "advantage": "advantage", "curator": "curator"}


def _kind(slot: str) -> str | None:
    return "filter" if slot.startswith("filter.") else SLOT_KINDS.get(slot)


def _settings(ctx: typer.Context, experiment: str, group: str | None, instance_id: str | None,
              max_inflight: int, metrics_interval: float, guarantee: str = "exactly_once",
              commit_idle: float = 0.02, commit_interval: float = 1.0, compression: str = "snappy") -> object:
    from astraflow.errors import ConfigError
    from stream_apps.engine import COMPRESSIONS, EngineSettings

    if guarantee not in ("exactly_once", "at_least_once"):
        raise ConfigError(f"--guarantee must be exactly_once or at_least_once, got {guarantee!r}")
    if commit_interval <= 0:
        raise ConfigError(f"--commit-interval must be above 0, got {commit_interval}")
    if compression not in COMPRESSIONS:
        raise ConfigError(f"--compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    cfg = load(ctx)
    return EngineSettings(experiment, cfg.kafka, group_id=group, instance_id=instance_id, max_inflight=max_inflight,
                          metrics_interval_s=metrics_interval, guarantee=guarantee,  # type: ignore[arg-type]
                          commit_idle_s=commit_idle, commit_interval_s=commit_interval, topics=cfg.topics,
                          compression=compression)  # type: ignore[arg-type]


def _logging(level: str) -> None:
    from stream_apps.log_notes import install

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if level.lower() != "debug":  # Faust and aiokafka narrate every service start and stop at INFO
        for name in ("faust", "mode", "aiokafka"):
            logging.getLogger(name).setLevel(logging.WARNING)
    install()  # aiokafka's NotEnoughReplicas retries: explained once, then counted (stream_apps/log_notes.py)


def _run(worker: object) -> None:
    from astraflow.metrics_export import serve_role

    w: Any = worker
    endpoint = serve_role(w.settings.experiment, w.handler.name, w.instance_id)  # opt-in: ASTRAFLOW_METRICS_PORT
    if endpoint is not None:
        w.metric_observers.append(endpoint.observe)
    w.install_signal_handlers()
    try:
        w.run()
    finally:
        w.close()
        if endpoint is not None:
            endpoint.close()


@app_app.command("run")
@handle_errors
def run_app(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="reward | curate | curator"),
    experiment: str = EXPERIMENT,
    policy: list[str] = typer.Option([], "--policy", "-p", help="curate: policies to route (default: all); curator: the tasks' policies."),
    default: list[str] = typer.Option([], "--default", help="Slot default: slot=strategy[:{json params}] (control records override it)."),
    group: str | None = typer.Option(None, help="Faust app id = consumer group (default af.<experiment>.<app>)."),
    instance_id: str | None = typer.Option(None, help="Instance name in metrics (default app-host-pid-random)."),
    max_inflight: int = typer.Option(16, help="Slow records (async rewards) handled at once per worker."),
    guarantee: str = typer.Option("exactly_once", help="exactly_once (Kafka transactions) | at_least_once."),
    metrics_interval: float = typer.Option(10.0, help="Seconds between metrics records."),
    commit_idle: float = typer.Option(0.02, help="Exactly-once: commit once no record came or finished for this "
                                      "long, before the 1 s commit interval (a burst's outputs show sooner)."),
    commit_interval: float = typer.Option(1.0, help="Exactly-once: most seconds between commits under steady input; "
                                          "downstream sees outputs when they commit, so this bounds the added latency."),
    compression: str = typer.Option("snappy", help="Codec of the batches the worker writes: snappy | zstd | lz4 | gzip | "
                                    "none (snappy costs the worker least; see docs/processors.md)."),
    group_timeout: float | None = typer.Option(None, help="curate: seconds before an incomplete group is emitted or dropped (300)."),
    min_group_size: int | None = typer.Option(None, help="curate: smallest timed-out group still trained on (2)."),
    emitted_ttl: float | None = typer.Option(None, help="curate: seconds emitted group ids are remembered (86400)."),
    dataset: list[str] = typer.Option([], "--dataset", help="curator: a JSONL / Parquet / Arrow / CSV file, a save_to_disk "
                                      "directory or a hub name (repeatable; docs/data.md)."),
    split: str | None = typer.Option(None, help="curator: the datasets' split (train, or the only one)."),
    preset: str | None = typer.Option(None, help="curator: the datasets' hub schema: gsm8k | math | mbpp."),
    columns: str | None = typer.Option(None, help="curator: FIELD=COLUMN,... e.g. prompt=question,reference=answer."),
    system_prompt: str | None = typer.Option(None, help="curator: system prompt of every task, for models with a chat "
                                             "template (Task.metadata system_prompt)."),
    n_samples: int | None = typer.Option(None, help="curator: samples per prompt, one group (8)."),
    max_ahead: int | None = typer.Option(None, help="curator: most tasks ahead of the trainer (64)."),
    workflow: str | None = typer.Option(None, help="curator: workflow of rows that name none (rlvr)."),
    temperature: float | None = typer.Option(None, help="curator: sampling temperature (1.0)."),
    top_p: float | None = typer.Option(None, help="curator: nucleus mass (1.0)."),
    max_tokens: int | None = typer.Option(None, help="curator: tokens per model call (256)."),
    max_turns: int | None = typer.Option(None, help="curator: model turns per rollout (1)."),
    max_tasks: int | None = typer.Option(None, help="curator: stop after this many tasks (0 = never)."),
    trainer_group: str | None = typer.Option(None, help="curator: trainer's consumer group (af.<exp>.<policy>.trainer; 'none' ignores it)."),
    throttle: list[str] = typer.Option([], "--throttle", help="curator: policies whose trainers bound tasks ahead (default: every --policy)."),
    region_share: list[str] = typer.Option([], "--region-share", help="curator: REGION=FRACTION of the tasks to "
                                           "af.<exp>.tasks.REGION, for a region fed by MirrorMaker 2 (repeatable): "
                                           "the share until nodes report; then it follows their speed and backlog."),
    region_dead_s: float | None = typer.Option(None, "--region-dead-s", help="curator: a region with no node metric "
                                               "for this long gets no new tasks and its outstanding ones are given "
                                               "back to live regions (15)."),
    log_level: str = typer.Option("info", help="debug | info | warning"),
) -> None:
    """Run one worker of a stream app until SIGTERM / Ctrl-C; start more to split partitions."""
    from astraflow.errors import ConfigError
    from stream_apps.launch import APPS, AppOptions, build_worker
    from stream_apps.slots import parse_default

    if name not in APPS:
        raise ConfigError(f"unknown app {name!r}; apps are {', '.join(APPS)} (user code: `astraflow process run`)")
    curate_only = {"--group-timeout": group_timeout, "--min-group-size": min_group_size, "--emitted-ttl": emitted_ttl}
    curator_only = {"--dataset": dataset or None, "--split": split, "--preset": preset, "--columns": columns,
                    "--system-prompt": system_prompt, "--n-samples": n_samples, "--max-ahead": max_ahead, "--workflow": workflow,
                    "--temperature": temperature, "--top-p": top_p, "--max-tokens": max_tokens, "--max-turns": max_turns,
                    "--max-tasks": max_tasks, "--trainer-group": trainer_group, "--throttle": throttle or None,
                    "--region-share": region_share or None, "--region-dead-s": region_dead_s}
    for owner, opts in (("curate", curate_only), ("curator", curator_only)):
        given = [k for k, v in opts.items() if v is not None]
        if given and name != owner:
            raise ConfigError(f"{', '.join(given)}: only for the {owner} app")
    _logging(log_level)
    options = AppOptions(policies=policy, defaults=dict(parse_default(d) for d in default))
    if group_timeout is not None:
        options.group_timeout_s = group_timeout
    if min_group_size is not None:
        options.min_group_size = min_group_size
    if emitted_ttl is not None:
        options.emitted_ttl_s = emitted_ttl
    if name == "curator":
        from astraflow.records import SamplingParams
        from stream_apps.curator import CuratorOptions
        from stream_apps.datasets import as_specs

        if not dataset:
            raise ConfigError("the curator needs --dataset (a .jsonl / .parquet file, a save_to_disk directory, ...); "
                              "repeat it for several")
        sp = SamplingParams()
        given = {"n_samples": n_samples, "max_ahead": max_ahead, "workflow": workflow, "max_tasks": max_tasks}
        options.curator = CuratorOptions(  # what is not given (or 0) keeps CuratorOptions' default
            datasets=as_specs(dataset, split, preset, columns), policies=policy, system_prompt=system_prompt,
            trainer_group=trainer_group, throttle=throttle,
            region_share=_shares(region_share),
            **({"region_dead_s": region_dead_s} if region_dead_s else {}),
            sampling=SamplingParams(temperature if temperature is not None else sp.temperature,
                                    top_p if top_p is not None else sp.top_p, max_tokens or sp.max_tokens, [],
                                    max_turns or sp.max_turns),
            **{k: v for k, v in given.items() if v},
        )
    settings = _settings(ctx, experiment, group, instance_id, max_inflight, metrics_interval, guarantee, commit_idle,
                         commit_interval, compression)
    worker = build_worker(name, settings, options)  # type: ignore[arg-type]
    console.print(f"{name} worker (Faust app {worker.group_id}, {guarantee}) for experiment {experiment}; Ctrl-C stops it")
    _run(worker)


def _shares(given: list[str]) -> dict[str, float]:
    """`--region-share b=0.4` -> {"b": 0.4}."""
    from astraflow.errors import ConfigError

    out = {}
    for item in given:
        region, _, frac = item.partition("=")
        try:
            out[region.strip()] = float(frac)
        except ValueError:
            raise ConfigError(f"--region-share {item!r}: expected REGION=FRACTION, e.g. b=0.4") from None
    return out


@app_app.command("list")
def list_apps() -> None:
    """The built-in apps and the default strategy of each of their slots."""
    from stream_apps.curate import DEFAULTS as CURATE
    from stream_apps.curator import DEFAULTS as CURATOR
    from stream_apps.reward import DEFAULTS as REWARD

    table = Table("app", "slot", "default", "params")
    for app_name, defaults in (("reward", REWARD), ("curate", CURATE), ("curator", CURATOR)):
        for slot, d in defaults.items():
            table.add_row(app_name, slot, d.strategy, json.dumps(d.params) if d.params else "")
    table.add_row("curator", "pause", "off", "on | off")
    console.print(table)


@control_app.command("set")
@handle_errors
def control_set(
    ctx: typer.Context,
    app: str = typer.Argument(..., help="reward | curate | curator | trainer | <processor name> | * (every app)."),
    slot: str = typer.Argument(..., help="reward | advantage | filter.<name> | curator | pause | <policy>.loss (trainer) | ..."),
    strategy: str = typer.Argument(..., help="Registered strategy name, 'none' to switch an optional slot off, or a value."),
    experiment: str = EXPERIMENT,
    param: list[str] = typer.Option([], "--param", help="Strategy parameter name=value (JSON values decoded); repeatable."),
    check: bool = typer.Option(True, help="Build the strategy here first, so a typo never reaches the workers."),
) -> None:
    """Select STRATEGY for SLOT of APP: every worker of the app applies it within a second."""
    from astraflow.control import ControlWriter, parse_param_args

    params = parse_param_args(param)
    kind = _kind(slot)
    if check and kind is not None:
        from astraflow.dataflow.registry import parse_params
        from stream_apps.slots import build_strategy

        build_strategy(kind, strategy, parse_params(params))
    if check and app == "trainer" and slot.endswith(".loss"):  # a policy's loss (trainers/loss_control.py)
        from trainers.config import LossSettings
        from trainers.loss_control import loss_from_control

        loss_from_control(LossSettings(), strategy, params)
    cfg = load(ctx)
    control = ControlWriter(cfg.kafka, experiment).set(app, slot, strategy, params)
    shown = " ".join(f"{k}={v}" for k, v in control.params.items())
    console.print(f"{control.key} = {control.strategy} {shown} (version {control.version})".replace("  ", " "))


@control_app.command("unset")
@handle_errors
def control_unset(
    ctx: typer.Context,
    app: str = typer.Argument(...),
    slot: str = typer.Argument(...),
    experiment: str = EXPERIMENT,
) -> None:
    """Remove the selection of SLOT of APP: the app goes back to its default."""
    from astraflow.control import ControlWriter

    ControlWriter(load(ctx).kafka, experiment).unset(app, slot)
    console.print(f"{app}/{slot} back to its default")


@control_app.command("show")
@handle_errors
def control_show(ctx: typer.Context, experiment: str = EXPERIMENT, as_json: bool = typer.Option(False, "--json")) -> None:
    """What the control topic selects now, per app and slot."""
    from astraflow.control import ControlWriter

    state = ControlWriter(load(ctx).kafka, experiment).current()
    rows = [state.controls[k] for k in sorted(state.controls)]
    if as_json:
        console.print_json(json.dumps([{**c.to_avro()} for c in rows]))
        return
    table = Table("app/slot", "strategy", "params", "version", "issued by")
    for c in rows:
        table.add_row(c.key, c.strategy, " ".join(f"{k}={v}" for k, v in c.params.items()), str(c.version), c.issued_by)
    console.print(table)


@process_app.command("run")
@handle_errors
def process_run(
    ctx: typer.Context,
    spec: str = typer.Argument(..., help="my_module:my_function, decorated with @astraflow.processor."),
    experiment: str = EXPERIMENT,
    group: str | None = typer.Option(None, help="Consumer group (default af.<experiment>.proc.<name>)."),
    instance_id: str | None = typer.Option(None, help="Instance name in metrics."),
    metrics_interval: float = typer.Option(10.0, help="Seconds between metrics records."),
    guarantee: str = typer.Option("exactly_once", help="exactly_once (Kafka transactions) | at_least_once."),
    compression: str = typer.Option("snappy", help="Codec of the batches the worker writes: snappy | zstd | lz4 | gzip | "
                                    "none (snappy costs the worker least; see docs/processors.md)."),
    max_consecutive_failures: int = typer.Option(1000, "--max-consecutive-failures", help="Stop (exit status 1) after "
                                                 "this many records in a row raised (0: never stop)."),
    progress_interval: float = typer.Option(10.0, "--progress-interval", help="Seconds between progress lines "
                                            "(in, out, dead-lettered, rate)."),
    log_level: str = typer.Option("info", help="debug | info | warning"),
) -> None:
    """Run one worker of a user processor until SIGTERM / Ctrl-C; start more to split partitions.
    It logs its progress every 10 s, an error when more than half of its last 100 records
    failed, and stops after --max-consecutive-failures failures in a row."""
    from astraflow.kafka.topics import TopicAdmin
    from stream_apps.launch import build_processor_worker

    if os.getcwd() not in sys.path:  # console scripts do not put the working directory on sys.path
        sys.path.insert(0, os.getcwd())
    _logging(log_level)
    settings: Any = _settings(ctx, experiment, group, instance_id, 16, metrics_interval, guarantee, compression=compression)
    TopicAdmin(settings.kafka).experiment(experiment)  # a typo in -e: one line naming it, before Kafka clients start
    worker = build_processor_worker(spec, settings, max_consecutive_failures, progress_interval)
    proc = worker.handler.proc  # type: ignore[attr-defined]
    console.print(f"processor {proc.name}: {proc.source} -> {proc.sink or '(Emit topics)'} (group {worker.group_id}); "
                  f"dead letters go to {worker.topics.dlq} as component {worker.handler.name}")
    _run(worker)
    gave_up = worker.handler.gave_up  # type: ignore[attr-defined]
    if gave_up:
        err_console.print(Text.assemble(("error: ", "bold red"), gave_up), soft_wrap=True)
        raise typer.Exit(1)
