"""Workflow registry: code the operator chose, never code a record chose.

A Task names its workflow. The name is looked up in the registry (the built-ins and whatever
the node's own code registered with `register_workflow`) or, as `package.module:function`,
imported from a module the node's config allows (`raas.workflow_modules`: a listed module or
one of its submodules). Any other name is refused before anything is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence

from astraflow.errors import AstraflowError
from astraflow.raas.workflows.base import RolloutContext
from astraflow.raas.workflows.builtin import POLICY_COUNTS, extract_answer, rlvr, solver_verifier, tool_use
from astraflow.raas.workflows.code_pair import coder_tester
from astraflow.raas.workflows.envs import ENV_WORKFLOWS
from astraflow.records import Trajectory

Workflow = Callable[[RolloutContext], Awaitable[Trajectory]]

WORKFLOWS: dict[str, Workflow] = {"rlvr": rlvr, "tool_use": tool_use, "solver_verifier": solver_verifier,
                                  "coder_tester": coder_tester, **ENV_WORKFLOWS}


POLICIES: dict[str, tuple[int, int | None]] = {**POLICY_COUNTS, "coder_tester": (2, 2), **dict.fromkeys(ENV_WORKFLOWS, (1, 1))}


def register_workflow(name: str, policies: tuple[int, int | None] = (1, None)) -> Callable[[Workflow], Workflow]:
    """Decorator: makes a workflow available by `name` in tasks; `policies` = (fewest, most) policies
    a task of it may name (None: no upper bound), distinct ones; the node refuses other tasks."""

    def deco(fn: Workflow) -> Workflow:
        WORKFLOWS[name] = fn
        POLICIES[name] = policies
        return fn

    return deco


def policy_count(name: str, workflow: Workflow) -> tuple[int, int | None]:
    """(fewest, most) policies a task of this workflow may name: what it was registered with, else
    the function's `policies` attribute, else (1, None)."""
    return POLICIES.get(name) or getattr(workflow, "policies", (1, None))


class WorkflowNotAllowedError(AstraflowError):
    """Raised when a task names a workflow that is neither registered nor inside the modules
    the node allows (`raas.workflow_modules`), or that cannot be imported from them."""


def _allowed(module: str, allowed: Sequence[str]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in allowed)


def resolve_workflow(name: str, allowed_modules: Sequence[str] = ()) -> Workflow:
    """A registered name, or `module:function` from a module in `allowed_modules` (or below it)."""
    if name in WORKFLOWS:
        return WORKFLOWS[name]
    known = ", ".join(sorted(WORKFLOWS))
    module, sep, attr = name.partition(":")
    if not sep:
        raise WorkflowNotAllowedError(
            f"unknown workflow {name[:200]!r}; registered: {known}, or module:function from a module "
            "listed in raas.workflow_modules"
        )
    if not (attr.isidentifier() and all(part.isidentifier() for part in module.split("."))):
        raise WorkflowNotAllowedError(f"workflow {name[:200]!r} is not a valid module:function name")
    if not _allowed(module, allowed_modules):
        raise WorkflowNotAllowedError(
            f"workflow {name[:200]!r} is not allowed: module {module[:200]!r} is not in raas.workflow_modules "
            f"({list(allowed_modules)}); the operator allows it with raas.workflow_modules=[{module[:200]}] "
            f"in the node's config (or ASTRAFLOW__RAAS__WORKFLOW_MODULES), or use a registered workflow: {known}"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise WorkflowNotAllowedError(f"workflow {name!r} cannot be imported: {exc}") from exc
    except BaseException as exc:  # operator code that fails at import (even SystemExit) must not stop the node
        raise WorkflowNotAllowedError(
            f"workflow {name!r}: importing {module} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(fn):
        raise WorkflowNotAllowedError(f"workflow {name!r} is a {type(fn).__name__}, not an async function")
    return fn


__all__ = [
    "WORKFLOWS",
    "RolloutContext",
    "Workflow",
    "WorkflowNotAllowedError",
    "extract_answer",
    "policy_count",
    "register_workflow",
    "resolve_workflow",
]
