"""Shared CLI plumbing: loading the config from the global options, printing errors nicely."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from astraflow.errors import AstraflowError

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def load(ctx: typer.Context, *extra_overrides: str) -> Any:
    """The resolved config: file from --config, env ASTRAFLOW__*, then --set overrides."""
    from astraflow.config import load_config
    from astraflow.sandbox.settings import configure

    obj = ctx.find_root().obj or {}
    overrides = list(obj.get("overrides", [])) + [o for o in extra_overrides if o]
    cfg = load_config(obj.get("config_path"), overrides)
    configure(cfg.sandbox)  # untrusted code run by this process follows the operator's config
    return cfg


def handle_errors(fn: F) -> F:
    """Turns AstraflowError into one line, `error: <what is wrong and what to do>`, and exit code 1:
    no traceback, no internal exception name (the message says what is missing and how to list
    what exists)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AstraflowError as exc:
            err_console.print(Text.assemble(("error: ", "bold red"), str(exc)), soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def path_opt(p: str | None) -> Path | None:
    return Path(p) if p else None


def serve_until_stopped(*closers: Callable[[], object], sigterm: bool = False) -> None:
    """Blocks while a server runs in the background, until Ctrl-C (and SIGTERM when `sigterm`:
    `docker stop` sends it), then calls each of `closers` in order, whatever stopped it."""
    import signal
    import time

    if sigterm:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for close in closers:
            close()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
