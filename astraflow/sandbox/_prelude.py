"""Prelude of the untrusted interpreter (stdlib only; executed as `python -I -c <source> <json> <script> ...`).

Sets the resource limits on itself before any untrusted code runs (they are inherited by every
process it forks); in the weak mode, where no bwrap loaded it, loads the seccomp filter itself
(`cfg["seccomp"]`, the program of `astraflow.sandbox.seccomp` in hex); installs an audit hook that
refuses to create network sockets; then runs the script as `__main__` the way `python script.py`
would (its directory first on sys.path).

The audit hook only turns a refused socket into a clear PermissionError: the seccomp filter (and
in bwrap mode the empty network namespace) is what refuses network sockets, whatever the code
uses (ctypes, another program).
"""

import json
import os
import resource
import runpy
import socket
import sys
import traceback

cfg = json.loads(sys.argv[1])
for name, soft, hard in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))


def _load_seccomp(program: bytes) -> None:
    """prctl(PR_SET_NO_NEW_PRIVS) then prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog)."""
    try:
        import ctypes
    except ImportError as exc:  # fail closed: the code never runs unfiltered
        sys.stderr.write(f"sandbox: cannot load the seccomp filter without ctypes: {exc}\n")
        os._exit(125)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    prog = SockFprog(len(program) // 8, program)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"sandbox: cannot load the seccomp filter: {os.strerror(err)}\n")
        os._exit(125)


if cfg.get("seccomp"):
    _load_seccomp(bytes.fromhex(cfg["seccomp"]))

_LOCAL_ONLY = int(socket.AF_UNIX)
_RESOLVER_EVENTS = {
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
}


def _no_network(event: str, args: tuple) -> None:
    if (event == "socket.__new__" and int(args[1]) != _LOCAL_ONLY) or event in _RESOLVER_EVENTS:
        raise PermissionError("network access is disabled in the sandbox")


sys.addaudithook(_no_network)

script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    raise
except BaseException as exc:  # report like `python script.py`, without the prelude's frames
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ("<string>", "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.exit(1)
