"""A node starts its engine process before it imports torch itself (`engine_spawn`); the backend
adopts it only if it was started with the arguments the backend would use."""

from __future__ import annotations

import inspect
import socket
import subprocess
from pathlib import Path

from astraflow.raas.backends import engine_spawn
from astraflow.raas.backends.base import GenerateRequest
from astraflow.raas.backends.engine_spawn import StartedEngine, adopt_or_start, engine_args, start_engine


def test_engine_args_defaults_are_the_torch_backends() -> None:
    from astraflow.raas.backends.torch_backend import TorchBackend

    backend = inspect.signature(TorchBackend.__init__).parameters
    spawn = inspect.signature(engine_args).parameters
    shared = [n for n in spawn if n != "model_dir"]
    assert shared and all(n in backend for n in shared)
    assert {n: spawn[n].default for n in shared} == {n: backend[n].default for n in shared}


class _Proc:
    def __init__(self) -> None:
        self.waited = self.killed = False

    def wait(self, timeout: float | None = None) -> int:
        self.waited = True
        return 0

    def kill(self) -> None:
        self.killed = True


def test_an_engine_started_with_other_arguments_is_closed_and_another_started(monkeypatch) -> None:
    ours, theirs = socket.socketpair()
    stale = StartedEngine(engine_args("/m", max_batch=4), _Proc(), ours)  # type: ignore[arg-type]
    fresh: list[list[str]] = []
    monkeypatch.setattr(engine_spawn, "start_engine", lambda args: fresh.append(args) or "new")
    assert adopt_or_start(engine_args("/m", max_batch=8), stale) == "new"
    assert fresh == [engine_args("/m", max_batch=8)] and stale.proc.waited and ours.fileno() == -1
    theirs.close()
    same = StartedEngine(engine_args("/m"), _Proc(), socket.socket())  # type: ignore[arg-type]
    assert adopt_or_start(engine_args("/m"), same) is same and len(fresh) == 1  # adopted: nothing started
    same.sock.close()


def test_an_engine_started_early_is_adopted_and_serves(tiny_model_dir: Path) -> None:
    from astraflow.raas.backends.torch_backend import TorchBackend

    started = start_engine(engine_args(str(tiny_model_dir), max_batch=4, threads=1, seed=0))
    backend = TorchBackend("policy", str(tiny_model_dir), max_batch=4, threads=1, seed=0, process=True, started=started)
    try:
        assert backend._proc is not None and backend._proc.proc is started.proc
        gen = backend.generate_sync(GenerateRequest([1, 5, 7], 3, 1.0))
        assert len(gen.token_ids) == 3
    finally:
        backend.close()
    assert started.proc.wait(timeout=60) is not None
    assert isinstance(started.proc, subprocess.Popen)
