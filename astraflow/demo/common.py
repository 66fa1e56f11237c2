"""What every demo scenario shares: the role processes' command lines, the warm-start model cache
and the run directory's setup.

The arithmetic demo (`astraflow.demo.run`), the solver-verifier pair (`astraflow.demo.pair`) and
the AgentBench-style scenarios (`astraflow.demo.scenarios`) differ in their models, datasets and
live view; the roles they start (one process each, as in production) are built here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from astraflow.config import AstraflowConfig, default_home, write_resolved
from astraflow.demo.supervisor import Role, RoleFailed, Supervisor
from astraflow.kafka.topics import TopicAdmin, topic_specs

PY = [sys.executable, "-m", "astraflow_cli.main"]


def role_env(bootstrap_servers: str) -> dict[str, str]:
    """Environment of every role process: the cluster, one torch thread, nothing from a hub."""
    return {"ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": bootstrap_servers, "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def cached_model(name: str, console: Console, build: Callable[[Path], None]) -> Path:
    """The model `name` in ~/.cache/astraflow/demo-models, made by `build(directory)` the first time.

    Each process builds into a directory of its own and renames it into place: two demos started
    at once must not build into the same directory (the second one's rmtree would cut the first
    one's model in half); the first to finish is kept.
    """
    cached = default_home() / "demo-models" / name
    if (cached / "config.json").exists():
        console.print(f"Reusing the warm-started tiny model in {cached}")
        return cached
    tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another process cached the same model first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def start_run(cfg: AstraflowConfig, run_dir: Path, exp: str, policies: Sequence[str], meta: dict[str, Any]) -> int:
    """Creates the run directory (resolved config, `demo.json` = experiment + `meta`) and the
    experiment's topics; returns how many topics."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, run_dir)
    (run_dir / "demo.json").write_text(json.dumps({"experiment": exp, **meta}, indent=2) + "\n")
    specs = topic_specs(exp, list(policies), cfg.topics)
    TopicAdmin(cfg.kafka).create(specs, cfg.topics.replication_factor)
    return len(specs)


def trainer_role(name: str, exp: str, policy: str, model: Path, run_dir: Path, lr: float, batch_size: int,
                 env: dict[str, str], publish_dtype: str = "float32") -> Role:
    """A trainer of `policy` (`astraflow train`), without progress bar, publishing `publish_dtype`
    (the tiny model is 1.5 MB in fp32: bf16 would round away most of its small RL updates)."""
    return Role(name, [*PY, "train", "-e", exp, "-p", policy, "-m", str(model), "--set", f"run_dir={run_dir}",
                       "--set", f"trainer.lr={lr}", "--set", f"trainer.batch_size={batch_size}",
                       "--set", "trainer.progress_bar=false", "--set", "trainer.max_wait_s=5",
                       "--set", f"trainer.publish_dtype={publish_dtype}"], env)


def node_role(node_id: str, exp: str, served: dict[str, Path], max_inflight: int, seed: int,
              env: dict[str, str], name: str | None = None, extra: Sequence[str] = ()) -> Role:
    """A RaaS node (`astraflow raas serve`) serving each policy of `served` from its model, one thread;
    the role is named `name` (its log file's name), by default as the node; `extra`: more options
    (e.g. the backend)."""
    args = [a for policy, model in served.items() for a in ("-p", f"{policy}={model}")]
    return Role(name or node_id, [*PY, "raas", "serve", "-e", exp, *args, "--max-inflight", str(max_inflight),
                          "--node-id", node_id, "--threads", "1", "--seed", str(seed), *extra], env)


def curate_role(exp: str, policies: Sequence[str], env: dict[str, str]) -> Role:
    """The curate app, writing each policy's samples to its own train topic."""
    return Role("curate", [*PY, "app", "run", "curate", "-e", exp, *(a for p in policies for a in ("--policy", p))], env)


def print_failure(console: Console, failed: RoleFailed) -> None:
    """Says which role failed, with what exit code, and the last lines of its log."""
    console.print(f"[bold red]{failed.role.name} failed[/] (exit code {failed.code}); last lines of {failed.role.log}:")
    console.print(failed.tail, markup=False, highlight=False)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


@dataclass(frozen=True)
class Supervised:
    """How a run's learning phase ended."""

    stopped_by: str  # "time budget", "Ctrl-C", or the reason `step` gave
    failed: RoleFailed | None  # the role that died, if one did
    wall_s: float


def supervise(console: Console, sup: Supervisor, monitor: Any, roles: Iterable[Role], *, minutes: float,
              period_s: float, step: Callable[[], str | None],
              view: Callable[[], AbstractContextManager[Any]] | None = None) -> Supervised:
    """Starts `roles` and the `monitor`, then every `period_s` checks that no role died and calls
    `step()` (which may print, and returns a reason to stop early or None) until `minutes` have
    passed, a role dies or Ctrl-C; `view` is a context open meanwhile (a live page). Every role and
    the monitor are stopped on the way out, whatever happened."""
    t0, stopped_by, failed = time.monotonic(), "time budget", None
    try:
        for role in roles:
            sup.start(role)
        monitor.start()
        with view() if view is not None else contextlib.nullcontext():
            while time.monotonic() - t0 < minutes * 60:
                time.sleep(period_s)
                sup.check()
                reason = step()
                if reason is not None:
                    stopped_by = reason
                    break
    except RoleFailed as exc:
        failed = exc
    except KeyboardInterrupt:
        stopped_by = "Ctrl-C"
    finally:
        console.print("Stopping all roles...")
        sup.stop_all()
        monitor.stop()
    return Supervised(stopped_by, failed, time.monotonic() - t0)


def print_next_steps(console: Console, exp: str, policy: str, run_dir: Path) -> None:
    """What to run next, with this run's names: the `astraflow` command (the virtualenv's), a sample
    id and its path, the run's status, its curves, and how to remove its topics."""
    venv_bin = Path(sys.executable).parent
    console.print(f"The astraflow command is in {venv_bin}: export PATH=\"{venv_bin}:$PATH\"", soft_wrap=True)
    steps = [(f"astraflow status -e {exp}", "what the run did, counted in records"),
             (f"astraflow logs show -e {exp} -t {policy}.train -n 1", "a sample: its id is a SAMPLE_ID"),
             (f"astraflow trace SAMPLE_ID -e {exp}", "that sample's path, hop by hop"),
             (f"tensorboard --logdir {run_dir}", "training curves"),
             (f"astraflow experiments delete {exp}", "remove its topics when done")]
    width = max(len(cmd) for cmd, _ in steps)
    for cmd, what in steps:
        console.print(f"  {cmd:<{width}}  {what}", soft_wrap=True, highlight=False, markup=False)
