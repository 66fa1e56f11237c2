"""Starting a torch engine process (`engine_proc`) from a module that imports no torch.

The engine child imports torch and transformers and loads its model: seconds on a loaded CPU. A
node starts its engine processes before anything of its own imports torch (`serve_node`), so the
child's start-up runs while the node imports its own modules, not after them; `EngineProcess`
adopts a started child whose arguments are the ones it would use (otherwise it closes it, says
so, and starts its own). No pickle: the child reads its arguments from its command line.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("astraflow.raas.engine")


def engine_args(model_dir: str, *, max_batch: int = 16, cache_slots: int | None = None, device: str | None = None,
                version: int = 0, seed: int | None = None, threads: int | None = None, batch_wait_s: float = 0.002,
                max_cache_lag: int = 0) -> list[str]:
    """The child's arguments (after its socket's fd); the defaults are `TorchBackend`'s."""
    args = ["--model", model_dir, "--max-batch", str(max_batch), "--version", str(version),
            "--batch-wait-s", str(batch_wait_s), "--max-cache-lag", str(max_cache_lag)]
    for flag, value in (("--cache-slots", cache_slots), ("--device", device), ("--seed", seed), ("--threads", threads)):
        if value is not None:
            args += [flag, str(value)]
    return args


@dataclass
class StartedEngine:
    """An engine child started, not yet adopted: its arguments, process and our end of its socket."""

    args: list[str]
    proc: subprocess.Popen
    sock: socket.socket

    def close(self) -> None:
        """Ends a child nobody adopted (closing its socket ends it; killed if it does not go)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_engine(args: list[str]) -> StartedEngine:
    """Starts `python -m astraflow.raas.backends.engine_proc` with `args` (from `engine_args`)."""
    parent, child = socket.socketpair()
    # Its own session: a signal to the node's process group (Ctrl-C, a group SIGTERM) does not
    # cut the rollouts in flight; the node ends it by closing the socket (and it exits when
    # the node dies: its read of the socket ends).
    proc = subprocess.Popen([sys.executable, "-m", "astraflow.raas.backends.engine_proc", "--fd", str(child.fileno()),
                             *args], pass_fds=(child.fileno(),), env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)
    child.close()
    return StartedEngine(args, proc, parent)


def adopt_or_start(args: list[str], started: StartedEngine | None) -> StartedEngine:
    """`started` if it was started with `args`; else a new child (a mismatched one is closed)."""
    if started is not None and started.args != args:
        log.warning("the engine process started early has other arguments (%s, not %s); starting another",
                    started.args, args)
        started.close()
        started = None
    return started if started is not None else start_engine(args)
