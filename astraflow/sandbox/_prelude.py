"""Prelude of the untrusted interpreter (stdlib only; executed as `python -I -c <source> <json> <script> ...`).

Sets the resource limits on itself before any untrusted code runs (they are inherited by every
process it forks), installs an audit hook that refuses to create network sockets, then runs the
script as `__main__` the way `python script.py` would (its directory first on sys.path).

The audit hook is defence in depth, not a boundary: code that loads a C extension (ctypes) or
execs another program can bypass it. In namespace mode the empty network namespace is what
guarantees no network; in process mode this hook is all there is.
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
