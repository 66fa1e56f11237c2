"""The sandbox's seccomp filter, as the classic BPF program `bwrap --seccomp FD` loads.

Written by hand (about sixty instructions) instead of generated with libseccomp: Debian ships
libseccomp's Python bindings only for its system interpreter, not for the one AstraFlow runs on,
so generating would need a setup step and a cache file that can go stale; this module needs
nothing, is the same on every machine and is read in one sitting.

The program, for the machine's own architecture (x86_64 or aarch64; others have no filter and
the sandbox refuses to run unless weak isolation is allowed):

* any other architecture's calling convention (e.g. 32-bit `int 0x80` on x86_64) kills the process;
* x32 system calls (numbers with bit 30 set on x86_64) fail with EPERM;
* the calls in `DENIED` fail with EPERM: tracing other processes, mounting, namespaces,
  keyrings, BPF, perf events, kexec, kernel modules, io_uring (which would bypass this filter),
  userfaultfd, cross-process memory access, clock and system settings;
* `socket` with any family but AF_UNIX fails with EAFNOSUPPORT (no IP, netlink, packet, vsock);
* `clone` with any namespace flag fails with EPERM; `clone3` fails with ENOSYS, because its flags
  sit in memory a filter cannot read (the C library then falls back to `clone`);
* everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF instruction classes and modes (linux/bpf_common.h)
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

# seccomp return actions (linux/seccomp.h)
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000

# offsets in struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (little-endian low word first)
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16

AF_UNIX = 1
X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "vhangup",
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
)  # fmt: skip


# System call numbers, from the kernel's asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64).
_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
    "pivot_root": 155, "chroot": 161, "move_mount": 429, "open_tree": 428, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248,
    "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "reboot": 169, "swapon": 167, "swapoff": 168, "syslog": 103, "acct": 163, "quotactl": 179,
    "vhangup": 153, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "socket": 41, "clone": 56, "clone3": 435,
}  # fmt: skip
_AARCH64 = {
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40, "umount2": 39,
    "pivot_root": 41, "chroot": 51, "move_mount": 429, "open_tree": 428, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_by_handle_at": 265,
    "name_to_handle_at": 264, "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217,
    "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "reboot": 142, "swapon": 224, "swapoff": 225, "syslog": 116, "acct": 89, "quotactl": 60,
    "vhangup": 58, "settimeofday": 170, "clock_settime": 112, "adjtimex": 171, "clock_adjtime": 266,
    "socket": 198, "clone": 220, "clone3": 435,
}  # fmt: skip
# machine name -> (AUDIT_ARCH_* value, syscall table, whether x32 numbers exist)
ARCHES = {
    "x86_64": (0xC000003E, _X86_64, True),
    "aarch64": (0xC00000B7, _AARCH64, False),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _ret(action: int, err: int = 0) -> bytes:
    return _insn(_RET_K, action | err)


def supported(machine: str | None = None) -> bool:
    """Whether a filter exists for `machine` (default: this one)."""
    return (machine or platform.machine()) in ARCHES


def build_filter(machine: str | None = None) -> bytes:
    """The BPF program (8-byte `struct sock_filter` entries) for `machine` (default: this one)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no seccomp filter for architecture {machine!r} (known: {', '.join(ARCHES)})")
    audit_arch, table, has_x32 = ARCHES[machine]
    eperm = _ret(RET_ERRNO, errno.EPERM)
    prog = [
        _insn(_LD_W_ABS, _OFF_ARCH),
        _insn(_JEQ_K, audit_arch, jt=1),
        _ret(RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFF_NR),
    ]
    if has_x32:
        prog += [_insn(_JGE_K, X32_SYSCALL_BIT, jf=1), eperm]
    for name in DENIED:
        prog += [_insn(_JEQ_K, table[name], jf=1), eperm]
    prog += [_insn(_JEQ_K, table["clone3"], jf=1), _ret(RET_ERRNO, errno.ENOSYS)]
    prog += [
        _insn(_JEQ_K, table["socket"], jf=4),
        _insn(_LD_W_ABS, _OFF_ARG0),  # the family (an int: the low word is all of it)
        _insn(_JEQ_K, AF_UNIX, jf=1),
        _ret(RET_ALLOW),
        _ret(RET_ERRNO, errno.EAFNOSUPPORT),
    ]
    prog += [
        _insn(_JEQ_K, table["clone"], jf=4),
        _insn(_LD_W_ABS, _OFF_ARG0),  # the flags: every namespace flag is in the low word
        _insn(_JSET_K, CLONE_NAMESPACE_FLAGS, jf=1),
        eperm,
        _ret(RET_ALLOW),
    ]
    prog.append(_ret(RET_ALLOW))
    return b"".join(prog)
