"""Parsing a command line with the real `astraflow` CLI without running anything (for tests)."""

from __future__ import annotations

from typing import Any

import typer


def parse_cli(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Parses `argv` group by group; returns the command path and the options of the last command.
    Raises a usage error (unknown command or option, missing required one, bad value)."""
    from astraflow_cli.main import app

    cmd: Any = typer.main.get_command(app)
    ctx = cmd.make_context("astraflow", list(argv))
    path: list[str] = []
    while hasattr(cmd, "resolve_command"):  # a group: descend into the subcommand
        args = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, args)
        assert sub is not None, f"no command {name!r}"
        path.append(name)
        cmd, ctx = sub, sub.make_context(name, rest, parent=ctx)
    return path, ctx.params
