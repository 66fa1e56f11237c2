"""Operator settings of the sandbox (`sandbox` section of the config), the same for every run.

They live in the config, not in `SandboxLimits`, because they decide how much a run is trusted:
a reward's parameters (which a control record may set) can tighten a run's limits but can never
weaken its isolation. A process gets them from `configure(cfg.sandbox)` (every `astraflow`
command calls it with the config it loaded, file included), else from the environment
(`ASTRAFLOW__SANDBOX__FIELD`) at each run.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


class SandboxSettings(BaseModel):
    """How sandbox runs are isolated on this machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow_weak_isolation: bool = False
    """Run untrusted code with resource limits only (no namespaces, seccomp or cgroups) where
    bubblewrap, user namespaces, seccomp or the cgroup controllers are missing. Off by default:
    without it such a machine refuses to run the code at all."""
    bwrap: str = "bwrap"
    """The bubblewrap binary (a name looked up on PATH, or a path)."""
    python: str | None = None
    """Interpreter for the untrusted code (its installation is shown read-only inside the
    sandbox); None: the base interpreter of the running one (not a virtualenv)."""
    total_memory_mb: int = Field(default=8192, ge=64)
    """Memory of all sandbox runs on this machine together (a cgroup above every run's own)."""
    cgroup_parent: str = Field(default="astraflow-sandbox", pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of that cgroup (in the memory and pids hierarchies); runs sharing it share the total."""


_configured: list[SandboxSettings] = []  # what configure() set for this process, if anything


def configure(settings: SandboxSettings | None) -> None:
    """Sets this process's sandbox settings (None: back to reading the environment)."""
    _configured[:] = [settings] if settings is not None else []


def current_settings(env: dict[str, str] | None = None) -> SandboxSettings:
    """This process's settings: those of `configure`, else the `ASTRAFLOW__SANDBOX__*` variables
    of `env` (default: this process's environment)."""
    from astraflow.config import load_config

    if env is None and _configured:
        return _configured[0]
    env = os.environ if env is None else env
    ours = {k: v for k, v in env.items() if k.upper().startswith("ASTRAFLOW__SANDBOX__")}
    return load_config(env=ours).sandbox
