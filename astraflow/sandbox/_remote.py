"""Calls from one sandboxed interpreter into another over two pipes (stdlib only).

Shipped into both sandboxes of `astraflow.sandbox.split` as `_astraflow_remote.py`:

* the **solution** side runs `serve(fd_in, fd_out)`: it executes solution.py, then answers
  requests about the objects it holds;
* the **driver** side calls `connect(fd_in, fd_out)` and gets the solution's top-level names as
  plain values or `Remote` proxies, whose calls, attributes, items, length, iteration,
  truth and text are requests to the solution (membership is decided by the driver on the items:
asking would show the solution what the tests look for). Arguments are copied over; what a
  call did to a list, dict or set argument is copied back into the caller's object.

Only plain data crosses the pipes, as JSON lines: None, bool, int (huge ones tagged), float
(nan and infinities tagged), str, list, and tagged tuple, set, frozenset, dict, bytes and complex. Anything else (an
instance of a solution class, a function, a subclass of a builtin type) stays in the solution's
process and crosses as a numbered handle. A value the driver receives is therefore always built
by the driver's own, unpatched types: a solution cannot hand over an object whose `__eq__`
always says yes, and a proxy compares by identity only. Exceptions cross as the names of their
classes (the driver raises the first builtin exception class among them, else `RemoteError`).

The driver trusts nothing that runs in the solution's process, this module's copy there
included: which names it accepts (`entry_name`: no dunders, no builtins' names, only the entry
points the task names) and every value it decodes are decided on the driver's side.
"""

import base64
import builtins
import json
import keyword
import math
import os
import sys

MAX_LINE = 16 * 1024 * 1024  # largest message either side accepts
_TAGS = ("$t", "$s", "$F", "$d", "$b", "$c", "$f", "$h", "$x")
_MUTABLE = (list, dict, set)  # containers whose changes by a call are copied back to the caller
_BIG = 10**1000  # ints this large cross as hex: JSON's decimal form is capped at 4,300 digits


class RemoteError(Exception):
    """The solution raised an exception of a class the driver does not have."""


class SolutionGone(Exception):
    """The solution's process ended or broke the protocol; no further call can succeed."""


def encode(value, handle, depth=0):
    """JSON-ready form of `value`; `handle(obj) -> int` numbers what is not plain data."""
    if depth > 100:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if value is None or value is True or value is False:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        i = int(value)
        return i if -_BIG < i < _BIG else {"$x": hex(i)}
    if isinstance(value, float):
        f = float(value)
        return f if math.isfinite(f) else {"$f": repr(f)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, list):
        return [encode(v, handle, d) for v in list(value)]
    if isinstance(value, tuple):
        return {"$t": [encode(v, handle, d) for v in tuple(value)]}
    if isinstance(value, frozenset):
        return {"$F": [encode(v, handle, d) for v in frozenset(value)]}
    if isinstance(value, set):
        return {"$s": [encode(v, handle, d) for v in set(value)]}
    if isinstance(value, dict):
        return {"$d": [[encode(k, handle, d), encode(v, handle, d)] for k, v in dict(value).items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        c = complex(value)
        return {"$c": [encode(c.real, handle, d), encode(c.imag, handle, d)]}
    return {"$h": handle(value)}


def decode(data, resolve, depth=0):
    """The value `encode` made; `resolve(n)` turns handle n back into an object (or a proxy)."""
    if depth > 100:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, resolve, d) for v in data]
    if type(data) is not dict or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise ValueError("not a value of the protocol")
    tag, body = next(iter(data.items()))
    if tag == "$f":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError("bad float")
        return float(body)
    if tag == "$b":
        return base64.b64decode(body, validate=True)
    if tag == "$x":
        return int(body, 16)
    if tag == "$h":
        if type(body) is not int:
            raise ValueError("bad handle")
        return resolve(body)
    if type(body) is not list:
        raise ValueError("bad container")
    items = [decode(v, resolve, d) for v in body]
    if tag == "$t":
        return tuple(items)
    if tag == "$s":
        return set(items)
    if tag == "$F":
        return frozenset(items)
    if tag == "$c":
        return complex(*items)
    if not all(type(kv) is list and len(kv) == 2 for kv in items):
        raise ValueError("bad dict")
    return {k: v for k, v in items}


class _Pipe:
    """JSON lines over a pair of descriptors."""

    def __init__(self, fd_in, fd_out):
        self.rx = os.fdopen(fd_in, "rb", buffering=65536)
        self.tx = os.fdopen(fd_out, "wb", buffering=0)

    def send(self, obj):
        self.tx.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def receive(self):
        line = self.rx.readline(MAX_LINE + 1)
        if not line:
            return None
        if len(line) > MAX_LINE:
            raise ValueError("message too long")
        return json.loads(line)


# --- solution side ------------------------------------------------------------------------------


def serve(fd_in, fd_out, path="solution.py"):
    """Runs `path`, sends its names, then answers requests until the driver hangs up."""
    pipe = _Pipe(fd_in, fd_out)
    held = []

    def handle(obj):
        held.append(obj)
        return len(held) - 1

    def resolve(n):
        if not 0 <= n < len(held):
            raise ValueError("unknown handle")
        return held[n]

    def fail(exc):
        return {"raise": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:500]}

    namespace = {"__name__": "solution"}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), namespace)
        names = {k: encode(v, handle) for k, v in list(namespace.items()) if not k.startswith("__")}
        pipe.send({"names": names})
    except BaseException as exc:  # SystemExit too: it is reported, not obeyed
        pipe.send({"load_error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        return
    while (msg := pipe.receive()) is not None:
        args, kwargs = [], {}
        try:
            target = resolve(msg["target"])
            args = decode(msg.get("args", []), resolve)
            kwargs = decode(msg.get("kwargs", {"$d": []}), resolve)
            op = msg["op"]
            if op == "call":
                out = target(*args, **kwargs)
            elif op == "getattr":
                out = getattr(target, *args)
            elif op == "setattr":
                out = setattr(target, *args)
            elif op == "getitem":
                out = target[args[0]]
            elif op == "setitem":
                target[args[0]] = args[1]
                out = None
            elif op == "len":
                out = len(target)
            elif op == "list":
                out = list(target)
            elif op == "bool":
                out = bool(target)
            elif op == "str":
                out = str(target)
            elif op == "repr":
                out = repr(target)
            else:
                raise ValueError(f"unknown operation {op!r}")
            reply = {"value": encode(out, handle)}
        except BaseException as exc:
            reply = fail(exc)
        try:  # what the call did to mutable arguments goes back, so in-place changes are seen
            reply["after"] = [encode(a, handle) if type(a) in _MUTABLE else None for a in args]
            reply["kwafter"] = {k: encode(v, handle) for k, v in dict(kwargs).items() if type(v) in _MUTABLE}
        except BaseException as exc:
            reply = fail(exc)
        pipe.send(reply)


# --- driver side --------------------------------------------------------------------------------


class Remote:
    """A proxy for an object that lives in the solution's process; compares by identity."""

    __slots__ = ("_conn", "_id")

    def __init__(self, conn, n):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_id", n)

    def _ask(self, op, *args, **kwargs):
        return self._conn.request(op, self._id, list(args), kwargs)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name, value):
        self._ask("setattr", name, value)

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __contains__(self, item):
        # Decided here, on the items as plain data: asking the solution would hand it the value
        # the tests look for (`assert expected in result`), and let it say yes to anything.
        return any(item is x or item == x for x in self)

    def __len__(self):
        n = self._ask("len")
        if type(n) is not int:
            raise TypeError("len() of the solution's object is not an int")
        return n

    def __iter__(self):
        items = self._ask("list")
        if type(items) is not list:
            raise TypeError("the solution's object did not iterate to a list")
        return iter(items)

    def __bool__(self):
        return self._ask("bool") is True

    def __str__(self):
        return str(self._ask("str"))

    def __repr__(self):
        return str(self._ask("repr"))

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


class _Connection:
    def __init__(self, fd_in, fd_out):
        self.pipe = _Pipe(fd_in, fd_out)
        self.gone = None  # why the solution can no longer answer

    def resolve(self, n):
        return Remote(self, n)

    def _receive(self):
        if self.gone is not None:
            raise SolutionGone(self.gone)
        try:
            msg = self.pipe.receive()
        except (OSError, ValueError) as exc:
            msg, self.gone = None, f"the solution broke the protocol: {exc}"
        if msg is None or type(msg) is not dict:
            self.gone = self.gone or "the solution's process ended"
            raise SolutionGone(self.gone)
        return msg

    def _copy_back(self, args, after, kwargs, kwafter):
        """Applies the solution's changes to list, dict and set arguments to ours, in place."""
        pairs = list(zip(args, after if type(after) is list else [], strict=False))
        if type(kwafter) is dict:
            pairs += [(kwargs[k], v) for k, v in kwafter.items() if k in kwargs]
        for mine, theirs in pairs:
            if type(mine) not in _MUTABLE or theirs is None:
                continue
            new = decode(theirs, self.resolve)
            if type(new) is not type(mine):
                raise ValueError("an argument came back as another type")
            if type(mine) is list:
                mine[:] = new
            else:
                mine.clear()
                mine.update(new)

    def request(self, op, target, args, kwargs):
        if self.gone is not None:
            raise SolutionGone(self.gone)

        def handle(obj):  # a proxy goes back as its own handle; nothing else of ours crosses
            if type(obj) is Remote and object.__getattribute__(obj, "_conn") is self:
                return object.__getattribute__(obj, "_id")
            raise TypeError(f"only plain data can be passed to the solution, not {type(obj).__name__}")

        message = {"op": op, "target": target, "args": encode(args, handle), "kwargs": encode(kwargs, handle)}
        try:
            self.pipe.send(message)
        except OSError as exc:
            self.gone = f"the solution's process ended ({exc})"
            raise SolutionGone(self.gone) from None
        reply = self._receive()
        try:
            self._copy_back(args, reply.get("after"), kwargs, reply.get("kwafter"))
            if "value" in reply:
                return decode(reply["value"], self.resolve)
            names, message = reply["raise"], str(reply.get("message", ""))
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            self.gone = f"the solution broke the protocol: {exc}"
            raise SolutionGone(self.gone) from None
        for name in names if type(names) is list else []:
            cls = getattr(builtins, str(name), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(message)
        raise RemoteError(f"{names[0] if names else 'Exception'}: {message}")


def entry_name(name, entry_points=None):
    """True when a name the solution sends may enter the driver's namespace.

    Decided in the driver's process (the solution's own filter runs where the solution can
    patch it or write to the pipe itself): an identifier, no dunder (`__builtins__` would
    become the tests' builtins), not a keyword, nothing that shadows a builtin (`sorted`,
    `len`, `set`, ...), and, when the task names its entry points, one of them.
    """
    return (
        type(name) is str
        and name.isidentifier()
        and not name.startswith("__")
        and not keyword.iskeyword(name)
        and not hasattr(builtins, name)
        and (entry_points is None or name in entry_points)
    )


def connect(fd_in, fd_out, entry_points=None):
    """The solution's top-level names (plain values or proxies); raises SolutionGone if it failed.

    Only names `entry_name` accepts are given (with `entry_points`, a collection of names, only
    those), so code that the driver runs with these names always gets its own builtins and
    nothing of the solution it did not ask for.
    """
    allowed = None if entry_points is None else frozenset(str(n) for n in entry_points)
    conn = _Connection(fd_in, fd_out)
    hello = conn._receive()
    if "load_error" in hello:
        raise SolutionGone(f"solution failed to load: {hello['load_error']}")
    names = hello.get("names")
    if type(names) is not dict:
        raise SolutionGone("the solution broke the protocol: no names")
    try:
        return {k: decode(v, conn.resolve) for k, v in names.items() if entry_name(k, allowed)}
    except (TypeError, ValueError, RecursionError) as exc:
        raise SolutionGone(f"the solution broke the protocol: {exc}") from None


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
