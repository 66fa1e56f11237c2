"""`astraflow kafka up | down | status | logs | kill | start`: the local Apache Kafka (one node or
several), and `grant | credentials | acls`: per-role principals and ACLs on a secure cluster."""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

from astraflow_cli.common import console, handle_errors, load

if TYPE_CHECKING:
    from astraflow.kafka.local import LocalKafka

app = typer.Typer(help="Run a real Apache Kafka (KRaft) locally, without Docker: one node or a cluster.", no_args_is_help=True)


def _local(ctx: typer.Context, data_dir: str | None, port: int | None, brokers: int | None = None, secure: bool | None = None,
           wan_proxy_port: int | None = None) -> LocalKafka:
    from astraflow.kafka.local import LocalKafka

    overrides = []
    if data_dir:
        overrides.append(f"local_kafka.data_dir={data_dir}")
    if port:
        overrides += [f"local_kafka.port={port}", f"local_kafka.controller_port={port + 1}"]
    if brokers:
        overrides.append(f"local_kafka.brokers={brokers}")
    if secure:
        overrides.append("local_kafka.secure=true")
    if wan_proxy_port:
        overrides.append(f"local_kafka.wan_proxy_port={wan_proxy_port}")
    settings = load(ctx, *overrides).local_kafka
    # A formatted data directory knows its cluster: `down`, `status`, `kill` need no --brokers.
    layout = settings.data_dir.expanduser() / "layout.json"
    if layout.exists():
        found = json.loads(layout.read_text())
        settings = settings.model_copy(update={
            "brokers": brokers or found.get("brokers", settings.brokers),
            "secure": secure or found.get("secure", settings.secure),
            "port": port or found.get("port", settings.port),
            "controller_port": (port + 1) if port else found.get("controller_port", settings.controller_port),
            "wan_proxy_port": wan_proxy_port or found.get("wan_proxy_port", settings.wan_proxy_port),
            "wan_port": found.get("wan_port", settings.wan_port),
        })
    return LocalKafka(settings)


DATA_DIR = typer.Option(None, "--data-dir", help="Where storage, logs, pid files (and credentials) live.")
PORT = typer.Option(None, "--port", help="Client port of node 1 on 127.0.0.1 (its controller: port+1; node i: +2*(i-1)).")
BROKERS = typer.Option(None, "--brokers", help="Nodes (broker+controller each); 3 survives the loss of any one.")
SECURE = typer.Option(False, "--secure", help="SASL/SCRAM-SHA-512 and ACLs (see docs/deploy-secure.md).")
NODE = typer.Argument(..., help="Node id (1..brokers).")
WAN = typer.Option(None, "--wan-proxy-port", help="Also advertise a WAN listener through `astraflow wan up`'s proxy "
                   "at this port (node i: +2*(i-1); the broker listens on port+1); see docs/deploy-regions.md.")


def _on_cluster(secure: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a command the options that name a local cluster (--data-dir, --port, --brokers) and
    calls it with that cluster (`local`, its first parameter) in their place; `secure`: the
    cluster is the secure one."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(fn).parameters.values())[1:]  # after `local`
        own = [p.replace(annotation=eval(p.annotation, fn.__globals__) if isinstance(p.annotation, str) else p.annotation)
               for p in own]
        shared = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
                  *(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=opt, annotation=int | None)
                    for name, opt in (("port", PORT), ("brokers", BROKERS))),
                  inspect.Parameter("data_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=DATA_DIR,
                                    annotation=str | None)]

        @functools.wraps(fn)
        def command(ctx: typer.Context, data_dir: str | None = None, port: int | None = None,
                    brokers: int | None = None, **kwargs: Any) -> Any:
            return fn(_local(ctx, data_dir, port, brokers, secure or None), **kwargs)

        params = [shared[0], *own, shared[3], shared[1], shared[2]]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return deco


@app.command()
@handle_errors
def up(
    ctx: typer.Context,
    data_dir: str | None = DATA_DIR,
    port: int | None = PORT,
    brokers: int | None = BROKERS,
    secure: bool = SECURE,
    wan_proxy_port: int | None = WAN,
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Secure: also grant this experiment's roles."),
    policy: list[str] = typer.Option([], "--policy", "-p", help="Secure: a policy of that experiment (repeatable)."),
) -> None:
    """Start every node (no-op for those already running) and wait until all are registered."""
    t0 = time.monotonic()
    local = _local(ctx, data_dir, port, brokers, secure, wan_proxy_port)
    st = local.up(echo=console.print)
    console.print(f"[green]ready[/] bootstrap.servers={st.bootstrap} pids={[n.pid for n in st.nodes]} ({time.monotonic() - t0:.1f}s)")
    if local.wan_bootstrap:
        console.print(f"region B: bootstrap.servers={local.wan_bootstrap} (start the proxy: `astraflow wan up`)")
    if local.settings.secure:
        console.print(f"admin credentials: {local.root / 'credentials.json'} (mode 0600)")
        if experiment:
            _grant(local, experiment, policy)


@app.command()
@handle_errors
@_on_cluster()
def down(local: LocalKafka) -> None:
    """Stop every node that `up` started from this data directory (and nothing else)."""
    local.down(echo=console.print)


@app.command()
@handle_errors
@_on_cluster()
def kill(local: LocalKafka, node: int = NODE) -> None:
    """kill -9 one node (fault testing); `astraflow kafka start NODE` brings it back."""
    pid = local.kill(node)
    console.print(f"node {node}: " + (f"killed (pid {pid})" if pid else "was not running"))


@app.command()
@handle_errors
@_on_cluster()
def start(local: LocalKafka, node: int = NODE) -> None:
    """Start one node of a formatted cluster and wait until it is registered again."""
    st = local.start(node, echo=console.print)
    console.print(f"node {node}: running pid={st.pid}")


@app.command()
@handle_errors
@_on_cluster()
def status(local: LocalKafka, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Is every node running and registered? One line per node; exit code 3 when any is not."""
    st = local.status()
    if as_json:
        console.print_json(json.dumps(st.to_json()))
    else:
        for n in st.nodes:
            state = "[green]running[/]" if n.answering else ("[yellow]starting[/]" if n.running else "[red]stopped[/]")
            console.print(f"Kafka node {n.node_id} {state} bootstrap={n.bootstrap} pid={n.pid}")
        console.print(f"data_dir={st.data_dir} bootstrap.servers={st.bootstrap}")
    if not st.answering:
        raise typer.Exit(3)


@app.command()
@handle_errors
@_on_cluster()
def logs(local: LocalKafka, lines: int = typer.Option(50, "-n", help="How many lines from the end.")) -> None:
    """Print the end of every node's logs."""
    console.print(local.log_tail(lines), markup=False, highlight=False)


def _grant(local: LocalKafka, experiment: str, policies: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    from astraflow.kafka.acl import apply_grants, principals, role_grants
    from astraflow.kafka.secure import CredentialStore, upsert_users

    grants = role_grants(experiment, policies)
    store = CredentialStore(local.root)
    admin = AdminClient(local.admin_settings().client_config())
    users = principals(grants)
    upsert_users(admin, {u: store.password(u) for u in users})
    n = apply_grants(admin, grants)
    console.print(f"granted {n} ACLs to {', '.join(users)} on experiment {experiment} (and nothing of any other "
                  f"experiment); `astraflow kafka credentials ROLE -e {experiment}` prints one role's environment")


EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name.")
POLICIES = typer.Option([], "--policy", "-p", help="Policy name (repeatable).")


@app.command()
@handle_errors
@_on_cluster(secure=True)
def grant(local: LocalKafka, experiment: str = EXPERIMENT, policy: list[str] = POLICIES) -> None:
    """Secure local cluster: create each role's SCRAM user and its ACLs for an experiment."""
    _grant(local, experiment, policy)


@app.command()
@handle_errors
@_on_cluster(secure=True)
def credentials(
    local: LocalKafka,
    role: str = typer.Argument(..., help="curator, reward, curate, raas, trainer, archive, monitor or operator."),
    experiment: str = EXPERIMENT,
    policy: str | None = typer.Option(None, "--policy", "-p", help="The trainer's policy."),
) -> None:
    """Print `export` lines that give one process exactly one role's credentials, for one experiment."""
    import shlex

    from astraflow.kafka.acl import principal_of
    from astraflow.kafka.secure import CredentialStore

    try:
        user = principal_of(role, experiment, policy)
    except ValueError as exc:
        from astraflow.errors import ConfigError

        raise ConfigError(str(exc)) from None
    for k, v in CredentialStore(local.root).env(local.bootstrap, user).items():
        print(f"export {k}={shlex.quote(v)}")


@app.command()
@handle_errors
def acls(
    experiment: str = EXPERIMENT,
    policy: list[str] = POLICIES,
    commands: bool = typer.Option(False, "--commands", help="As kafka-acls.sh commands, for a managed cluster."),
) -> None:
    """Print the per-role ACL table of an experiment (or the kafka-acls.sh commands for it)."""
    from rich.table import Table

    from astraflow.kafka.acl import kafka_acls_commands, role_grants

    grants = role_grants(experiment, policy)
    if commands:
        print("\n".join(kafka_acls_commands(grants)))
        return
    table = Table("principal", "resource", "name", "pattern", "operations", "why")
    for g in grants:
        table.add_row(g.principal, g.resource, g.name, g.pattern.lower(), ", ".join(g.operations), g.why)
    console.print(table)


mirror_app = typer.Typer(help="MirrorMaker 2 between region A's cluster and region B's, for one experiment "
                              "(docs/deploy-regions.md).", no_args_is_help=True)
app.add_typer(mirror_app, name="mirror")
MIRROR_DIR = typer.Option(None, "--data-dir", help="Where mm2.properties, the pid file and the log live "
                          "(default: ~/.cache/astraflow/mirror/EXP-REGION).")
REGION = typer.Option("b", "--region", help="Region B's name: its tasks topic is af.EXP.tasks.REGION.")


def _mirror_dir(data_dir: str | None, experiment: str, region: str):
    from pathlib import Path

    from astraflow.config import default_home

    return Path(data_dir) if data_dir else default_home() / "mirror" / f"{experiment}-{region}"


@mirror_app.command("up")
@handle_errors
def mirror_up(
    ctx: typer.Context,
    experiment: str = EXPERIMENT,
    policy: list[str] = POLICIES,
    source_bootstrap: str = typer.Option(..., "--source-bootstrap", help="Region A's cluster (the trainer's)."),
    target_bootstrap: str = typer.Option(..., "--target-bootstrap", help="Region B's cluster (its nodes')."),
    region: str = REGION,
    replication_factor: int = typer.Option(1, "--replication-factor", help="Of the topics created on B and MM2's own."),
    exactly_once: bool = typer.Option(True, "--exactly-once/--at-least-once",
                                      help="KIP-618 exactly-once source support (transactional writes), or not."),
    data_dir: str | None = MIRROR_DIR,
) -> None:
    """Create the experiment's topics on region B's cluster (and af.EXP.tasks.REGION on A), then
    start MirrorMaker 2: that tasks topic, the weights and policies to B; rollouts, metrics and
    the DLQ back to A. Logs to DATA_DIR/logs/mirror.log; `mirror down` stops it."""
    from astraflow.kafka.local import LocalKafka
    from astraflow.kafka.mirror import Mirror, MirrorPlan, prepare_topics

    cfg = load(ctx)
    plan = MirrorPlan(experiment, region, source_bootstrap, target_bootstrap, replication_factor=replication_factor,
                      max_message_bytes=cfg.topics.max_message_bytes, exactly_once=exactly_once)
    made = prepare_topics(plan, policy, cfg.topics)
    for side, res in made.items():
        console.print(f"region {side}: {sum(v == 'created' for v in res.values())} topic(s) created, "
                      f"{sum(v == 'exists' for v in res.values())} existed")
    local = LocalKafka(cfg.local_kafka)
    local.resolve_jars(console.print)
    mirror = Mirror(plan, _mirror_dir(data_dir, experiment, region), local.libs)
    pid = mirror.up(echo=console.print)
    console.print(f"[green]mirroring[/] pid={pid}; region {region}'s nodes: `raas serve --tasks-region {region}` at "
                  f"{target_bootstrap}; the curator: `--region-share {region}=FRACTION`")


@mirror_app.command("down")
@handle_errors
def mirror_down(experiment: str = EXPERIMENT, region: str = REGION, data_dir: str | None = MIRROR_DIR) -> None:
    """Stop the MirrorMaker that `mirror up` started from this data directory (and nothing else)."""
    from astraflow.kafka.mirror import Mirror, MirrorPlan

    Mirror(MirrorPlan(experiment, region, "", ""), _mirror_dir(data_dir, experiment, region)).down(echo=console.print)


@mirror_app.command("status")
@handle_errors
def mirror_status(experiment: str = EXPERIMENT, region: str = REGION, data_dir: str | None = MIRROR_DIR,
                  lines: int = typer.Option(0, "-n", help="Also print this many lines of its log.")) -> None:
    """Is the MirrorMaker of this experiment and region running? Exit code 3 when not."""
    from astraflow.kafka.mirror import Mirror, MirrorPlan

    mirror = Mirror(MirrorPlan(experiment, region, "", ""), _mirror_dir(data_dir, experiment, region))
    pid = mirror.pid()
    console.print(f"MirrorMaker {'[green]running[/] pid=' + str(pid) if pid else '[red]stopped[/]'} "
                  f"config={mirror.properties} log={mirror.log}")
    if lines:
        console.print(mirror.log_tail(lines), markup=False, highlight=False)
    if pid is None:
        raise typer.Exit(3)
