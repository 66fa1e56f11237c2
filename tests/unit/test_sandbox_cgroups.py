"""The cgroup v2 layout, on a directory tree shaped like /sys/fs/cgroup (this machine's kernel
checks the v1 layout for real in test_sandbox_isolation.py; no v2 kernel is at hand here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from astraflow.sandbox import cgroups

pytestmark = pytest.mark.unit
MIB = 1024 * 1024


def test_v2_parent_and_run_cgroups(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    parent = tmp_path / "astraflow-sandbox"
    parent.mkdir()  # the kernel makes these files with the directory
    (parent / "cgroup.subtree_control").write_text("\n")
    (parent / "memory.max").write_text("max\n")
    assert cgroups.version(tmp_path) == 2
    assert cgroups.unavailable(tmp_path) is None
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"

    run = cgroups.create(256, 16, 1024, root=tmp_path)
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (parent / "memory.max").read_text() == str(1024 * MIB)
    [own] = run.dirs
    assert own.parent == parent and (own / "memory.max").read_text() == str(256 * MIB)
    assert (own / "pids.max").read_text() == str(16 + cgroups.BWRAP_PROCESSES)
    assert not run.oom_killed()
    (own / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert run.oom_killed()


def test_v2_without_the_controllers_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert "memory and pids" in (cgroups.unavailable(tmp_path) or "")


def test_the_shell_enters_every_cgroup_then_runs_the_command(tmp_path: Path) -> None:
    run = cgroups.RunCgroup((tmp_path / "a", tmp_path / "b"), 1)
    for directory in run.dirs:
        directory.mkdir()
    argv = cgroups.enter_argv(run, ["/bin/sh", "-c", 'echo "ran $$ $1"', "sh", "--"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    pid = out[1]
    assert out == ["ran", pid, "--"]  # the command keeps its own arguments, "--" included
    assert [(d / "cgroup.procs").read_text().strip() for d in run.dirs] == [pid, pid]  # same process: exec
    (tmp_path / "a" / "cgroup.procs").unlink()
    (tmp_path / "a").rmdir()
    failed = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert failed.returncode == 125 and "ran" not in failed.stdout  # not in its cgroup: never runs
