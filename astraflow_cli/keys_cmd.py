"""`astraflow keys create | list | rotate | revoke`: the signing keys of an experiment.

Weights and `policies` records are signed by the experiment's trainer key, `control` records
by its operator key; every reader verifies them against the experiment's `trust.json`
(`astraflow.kafka.signing`, docs/security.md). Keys live under $ASTRAFLOW_KEYS_DIR (default
~/.astraflow/keys), one folder per experiment.
"""

from __future__ import annotations

import datetime as dt

import typer
from rich.table import Table

from astraflow_cli.common import console, handle_errors

app = typer.Typer(help="Make, list, rotate and revoke an experiment's signing keys.", no_args_is_help=True)

EXPERIMENT = typer.Option(..., "--experiment", "-e", help="Experiment name.")
ROLE = typer.Option(None, "--role", "-r", help="trainer, operator, raas, apps or curator; every signing role when left out.")


def _roles(role: str | None) -> tuple[str, ...]:
    from astraflow.kafka.signing import ROLES, KeysError

    if role is None:
        return ROLES
    if role not in ROLES:
        raise KeysError(f"role {role!r} signs nothing; roles that sign: {', '.join(ROLES)}")
    return (role,)


@app.command()
@handle_errors
def create(experiment: str = EXPERIMENT, role: str | None = ROLE) -> None:
    """Make the experiment's keys (first time: one per role; later: one for each role that has
    none), or one more key for --role."""
    from astraflow.kafka.signing import KeyStore

    store = KeyStore(experiment)
    if not store.exists():
        store.ensure()
        console.print(f"made the keys of {experiment} in {store.dir}")
    elif role is not None:
        console.print(f"new {role} key {store.create(role)} in {store.dir}")
    else:
        # A trust file made before a role signed anything (raas, apps: their metrics) gets its keys.
        held = {k.role for k in store.trusted().values()}
        missing = [r for r in _roles(None) if r not in held]
        for r in missing:
            console.print(f"new {r} key {store.create(r)} in {store.dir}")
        if not missing:
            console.print(f"{experiment} already has keys in {store.dir}; add one with --role, or rotate")
    _print(store)


@app.command("list")
@handle_errors
def list_(experiment: str = EXPERIMENT) -> None:
    """The experiment's public keys, their role and state, and which private keys this host holds."""
    from astraflow.kafka.signing import KeysError, KeyStore

    store = KeyStore(experiment)
    if not store.exists():
        raise KeysError(f"no keys for {experiment} in {store.dir.parent}: `astraflow keys create -e {experiment}`")
    _print(store)


@app.command()
@handle_errors
def rotate(experiment: str = EXPERIMENT, role: str | None = ROLE) -> None:
    """A new key per role (or --role); the old ones are retired: what they signed stays valid."""
    from astraflow.kafka.signing import KeyStore

    store = KeyStore(experiment).ensure()
    for r in _roles(role):
        console.print(f"{r}: new key {store.rotate(r)}")
    console.print(f"ship {store.trust_file} to every host, and each new private key to its role's hosts")
    _print(store)


@app.command()
@handle_errors
def revoke(key_id: str = typer.Argument(..., help="The key id (`astraflow keys list`)."),
           experiment: str = EXPERIMENT) -> None:
    """Refuse everything a key ever signed (a leaked key); then `keys create --role` a new one."""
    from astraflow.kafka.signing import KeyStore

    store = KeyStore(experiment)
    store.revoke(key_id)
    console.print(f"revoked {key_id}; ship {store.trust_file} to every host")
    _print(store)


def _print(store) -> None:  # type: ignore[no-untyped-def]
    def when(ms: int | None) -> str:
        return "" if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")

    table = Table("role", "created (UTC)", "state", "private key here")
    table.add_column("key", no_wrap=True)
    for k in sorted(store.trusted().values(), key=lambda k: (k.role, k.created_ms)):
        state = "revoked " + when(k.revoked_ms) if k.revoked_ms else "retired " + when(k.retired_ms) if k.retired_ms \
            else "active"
        table.add_row(k.role, when(k.created_ms), state,
                      "yes" if (store.dir / "private" / f"{k.key_id}.pem").is_file() else "no", k.key_id)
    console.print(table)
