"""The seccomp program, run by a small classic-BPF interpreter for both architectures (the
kernel's verdict on this machine is tested in test_sandbox.py)."""

from __future__ import annotations

import errno
import struct

import pytest

from astraflow.sandbox import seccomp

pytestmark = pytest.mark.unit


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """The action `program` returns for one system call (loads, jeq/jge/jset and ret only)."""
    full = (*args, 0, 0, 0, 0, 0, 0)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *full)
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += jt if hit else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


EPERM = seccomp.RET_ERRNO | errno.EPERM


@pytest.mark.parametrize("machine", list(seccomp.ARCHES))
def test_filter_denies_the_dangerous_calls_and_allows_the_rest(machine: str) -> None:
    arch, table, has_x32 = seccomp.ARCHES[machine]
    prog = seccomp.build_filter(machine)
    for name in seccomp.DENIED:
        assert run_bpf(prog, table[name], arch) == EPERM, name
    assert run_bpf(prog, table["clone3"], arch) == seccomp.RET_ERRNO | errno.ENOSYS
    assert run_bpf(prog, table["socket"], arch, (2,)) == seccomp.RET_ERRNO | errno.EAFNOSUPPORT  # AF_INET
    assert run_bpf(prog, table["socket"], arch, (16,)) == seccomp.RET_ERRNO | errno.EAFNOSUPPORT  # netlink
    assert run_bpf(prog, table["socket"], arch, (1,)) == seccomp.RET_ALLOW  # AF_UNIX
    assert run_bpf(prog, table["clone"], arch, (0x10000000 | 17,)) == EPERM  # CLONE_NEWUSER
    assert run_bpf(prog, table["clone"], arch, (0x40000000,)) == EPERM  # CLONE_NEWNET
    assert run_bpf(prog, table["clone"], arch, (0x003D0F00,)) == seccomp.RET_ALLOW  # a thread
    for allowed in (0, 1, 2, 3, 60, 63, 231):  # read/write/open/close-ish numbers of both tables
        if allowed not in {table[n] for n in (*seccomp.DENIED, "socket", "clone", "clone3")}:
            assert run_bpf(prog, allowed, arch) == seccomp.RET_ALLOW
    other_arch = 0x40000003  # i386
    assert run_bpf(prog, 0, other_arch) == seccomp.RET_KILL_PROCESS
    if has_x32:
        assert run_bpf(prog, 0x40000000 | 1, arch) == EPERM


def test_unknown_architecture_has_no_filter() -> None:
    assert not seccomp.supported("riscv64")
    with pytest.raises(ValueError, match="riscv64"):
        seccomp.build_filter("riscv64")
