"""Safe record filters (`--filter "reward > 0.5 and workflow == 'tool_use'"`) and time arguments.

A filter is parsed with `ast` and compiled into a tree of small closures; nothing is ever passed
to `eval`. Allowed: comparisons (`== != < <= > >= in not in is is not`, chained), `and`, `or`,
`not`, unary minus, literals (strings, numbers, booleans, None, and lists / tuples / sets of
them), field names, attribute access into nested records (`node.region`) and subscripts with a
literal (`reward_components['exact_match']`, `segments[0].role`). No calls, no arithmetic, no
comprehensions, no lambdas.

Names are the fields of the decoded record, in the current schema version, plus the Kafka
coordinates `_topic`, `_partition`, `_offset`, `_timestamp` (ms), `_key` (text) and `_schema`
(record full name). A top-level name the record lacks is an error (it catches typos); a missing
map key or a null along an attribute path gives None, and ordering comparisons with None are
false, as in SQL.
"""

from __future__ import annotations

import ast
import operator
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from astraflow.archive.errors import FilterError

MAX_EXPR_CHARS = 2000
META_FIELDS = ("_topic", "_partition", "_offset", "_timestamp", "_key", "_schema")

Env = dict[str, Any]
Node = Callable[[Env], Any]

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: b is not None and a in b,
    ast.NotIn: lambda a, b: b is None or a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_MISSING = object()


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _literal(node.operand)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = [_literal(e) for e in node.elts]
        return frozenset(items) if isinstance(node, ast.Set) else tuple(items)
    raise FilterError(f"only literals are allowed here, not {ast.unparse(node)!r}")


def _compile(node: ast.AST) -> Node:
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda env: all(p(env) for p in parts)
        return lambda env: any(p(env) for p in parts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _compile(node.operand)
        return lambda env: not inner(env)
    if isinstance(node, ast.Compare):
        left = _compile(node.left)
        ops = []
        for op, right in zip(node.ops, node.comparators, strict=True):
            fn = _COMPARE.get(type(op))
            if fn is None:  # pragma: no cover - _COMPARE covers every ast comparison
                raise FilterError(f"comparison {type(op).__name__} is not allowed")
            ops.append((fn, _compile(right)))

        def compare(env: Env) -> bool:
            a = left(env)
            for fn, right in ops:
                b = right(env)
                try:
                    if not fn(a, b):
                        return False
                except TypeError:  # e.g. None > 0.5, or 'a' < 1: false, like SQL NULL
                    return False
                a = b
            return True

        return compare
    if isinstance(node, ast.Name):
        name = node.id

        def lookup(env: Env) -> Any:
            v = env.get(name, _MISSING)
            if v is _MISSING:
                fields = ", ".join(sorted(k for k in env if not k.startswith("_"))) + ", " + ", ".join(META_FIELDS)
                raise FilterError(f"filter names {name!r}, which the record does not have; fields: {fields}")
            return v

        return lookup
    if isinstance(node, ast.Attribute):
        base = _compile(node.value)
        attr = node.attr
        return lambda env: _get(base(env), attr)
    if isinstance(node, ast.Subscript):
        base = _compile(node.value)
        key = _literal(node.slice)
        return lambda env: _get(base(env), key)
    try:
        value = _literal(node)
    except FilterError:
        raise FilterError(
            f"{ast.unparse(node)!r} is not allowed in a filter: use comparisons, and/or/not, field names "
            "and literals (no calls or arithmetic)"
        ) from None
    return lambda env: value


def _get(obj: Any, key: Any) -> Any:
    """Field, map key or list index; None when absent (records are dicts, never Python objects)."""
    if isinstance(obj, dict):
        return obj.get(key)
    if isinstance(obj, list | tuple) and isinstance(key, int) and not isinstance(key, bool):
        return obj[key] if -len(obj) <= key < len(obj) else None
    return None


class RecordFilter:
    """A compiled filter expression; call it with the record's fields (and meta fields)."""

    def __init__(self, expr: str) -> None:
        if len(expr) > MAX_EXPR_CHARS:
            raise FilterError(f"filter is {len(expr)} characters; keep it under {MAX_EXPR_CHARS}")
        self.expr = expr
        try:
            tree = ast.parse(expr.strip(), mode="eval")
        except SyntaxError as exc:
            raise FilterError(f"filter {expr!r} is not a valid expression: {exc.msg}") from exc
        self._fn = _compile(tree.body)

    def __call__(self, env: Env) -> bool:
        try:
            return bool(self._fn(env))
        except RecursionError as exc:  # pragma: no cover - absurdly nested input
            raise FilterError("filter is nested too deeply") from exc


def record_env(fullname: str | None, datum: dict[str, Any] | None, topic: str, partition: int, offset: int,
               timestamp_ms: int, key: bytes | None) -> Env:
    """The names a filter sees for one record."""
    env: Env = dict(datum or {})
    env.update(
        _topic=topic,
        _partition=partition,
        _offset=offset,
        _timestamp=timestamp_ms,
        _key=key.decode("utf-8", "replace") if key is not None else None,
        _schema=fullname,
    )
    return env


# ---- time arguments ------------------------------------------------------------------------------

_REL = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_time(text: str, now_ms: int | None = None) -> int:
    """A time argument as ms since the epoch.

    Accepts `now`; a duration meaning that long ago (`90s`, `15m`, `2h`, `7d`, `1w`); an epoch
    number (seconds below 10^11, milliseconds above); an ISO 8601 date or datetime (without a
    zone it is UTC).
    """
    t = text.strip()
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    if t == "now":
        return now
    m = _REL.match(t)
    if m:
        return now - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    if re.fullmatch(r"\d+(\.\d+)?", t):
        v = float(t)
        return int(v * 1000) if v < 1e11 else int(v)
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise FilterError(
            f"cannot read time {text!r}: use an ISO datetime (2026-05-01T12:00:00Z), epoch seconds or ms, "
            "a duration ago (30m, 2h, 7d) or 'now'"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)
