"""Operator settings of the sandbox (`sandbox` section of the config, `astraflow.config.SandboxSettings`),
the same for every run, and where this process takes them from.

They live in the config, not in `SandboxLimits`, because they decide how much a run is trusted:
a reward's parameters (which a control record may set) can tighten a run's limits but can never
weaken its isolation. A process gets them from `configure(cfg.sandbox)` (every `astraflow`
command calls it with the config it loaded, file included), else from the environment
(`ASTRAFLOW__SANDBOX__FIELD`) at each run.
"""

from __future__ import annotations

import os

from astraflow.config import SandboxSettings, load_config

_configured: list[SandboxSettings] = []  # what configure() set for this process, if anything


def configure(settings: SandboxSettings | None) -> None:
    """Sets this process's sandbox settings (None: back to reading the environment)."""
    _configured[:] = [settings] if settings is not None else []


def current_settings(env: dict[str, str] | None = None) -> SandboxSettings:
    """This process's settings: those of `configure`, else the `ASTRAFLOW__SANDBOX__*` variables
    of `env` (default: this process's environment)."""
    if env is None and _configured:
        return _configured[0]
    env = os.environ if env is None else env
    ours = {k: v for k, v in env.items() if k.upper().startswith("ASTRAFLOW__SANDBOX__")}
    return load_config(env=ours).sandbox
