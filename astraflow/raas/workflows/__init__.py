"""Workflow registry: built-ins by name, user workflows by import path (`package.module:function`)."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable

from astraflow.errors import ConfigError
from astraflow.raas.workflows.base import RolloutContext
from astraflow.raas.workflows.builtin import extract_answer, rlvr, solver_verifier, tool_use
from astraflow.records import Trajectory

Workflow = Callable[[RolloutContext], Awaitable[Trajectory]]

WORKFLOWS: dict[str, Workflow] = {"rlvr": rlvr, "tool_use": tool_use, "solver_verifier": solver_verifier}


def register_workflow(name: str) -> Callable[[Workflow], Workflow]:
    """Decorator: makes a workflow available by `name` in tasks."""

    def deco(fn: Workflow) -> Workflow:
        WORKFLOWS[name] = fn
        return fn

    return deco


def resolve_workflow(name: str) -> Workflow:
    """A registered name, or `module:function` imported on first use."""
    if name in WORKFLOWS:
        return WORKFLOWS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"workflow {name!r} cannot be imported: {exc}") from exc
        WORKFLOWS[name] = fn
        return fn
    raise ConfigError(f"unknown workflow {name!r}; registered: {', '.join(sorted(WORKFLOWS))}, or use module:function")


__all__ = ["WORKFLOWS", "RolloutContext", "Workflow", "extract_answer", "register_workflow", "resolve_workflow"]
