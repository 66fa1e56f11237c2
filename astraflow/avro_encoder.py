"""Avro binary encoders compiled from a schema: one Python function per record type.

`compile_encoder(parsed_schema)` turns a fastavro-parsed schema into `write(datum, append)`,
which appends the Avro binary encoding of `datum` (a dict, as `to_avro()` returns) to a list
through `append`; the caller joins the parts once (with its framing header in front). The field
order, the defaults, the enum indices and the union branches are resolved when the schema is
compiled, so encoding a record is straight-line code with no walk over the schema: on a
4,096-token Trajectory it is several times faster than fastavro's generic writer
(`bench/serde.py`). The bytes are the same as fastavro's (`tests/unit/test_avro_encoder.py`).

Every value is still checked against its schema type on the way out (a wrong type or an int
out of range raises `TypeError`/`ValueError`/`KeyError`, which `AvroSerde.encode` turns into a
`SchemaValidationError` naming the field). Decoding is not done here: the untrusted side keeps
fastavro's reader (strict, and it resolves old schema versions).

Supported: every Avro type the schemas in `schemas/` use (null, boolean, int, long, float,
double, bytes, string, record, enum, array, map, and unions of null with one other type).
Anything else is refused when the schema is compiled.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Encoder = Callable[[Any, Callable[[bytes], None]], None]

_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_TABLE_SIZE = 1 << 14  # zigzagged values below this come from a table of ready-made varints


def _varint(z: int) -> bytes:
    """Varint of a non-negative (already zigzagged) integer."""
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


_TABLE = [_varint(z) for z in range(_TABLE_SIZE)]
_index = operator.index
_pack_float = struct.Struct("<f").pack
_pack_double = struct.Struct("<d").pack


def _count(n: int) -> bytes:
    """Zigzag varint of a length or block count (never negative)."""
    z = n << 1
    return _TABLE[z] if z < _TABLE_SIZE else _varint(z)


def _str_bytes(v: Any) -> bytes:
    if not isinstance(v, str):
        raise TypeError(f"{type(v).__name__} value {v!r:.60} is not a string")
    return v.encode()


def _as_bytes(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"{type(v).__name__} value is not bytes")


def _as_list(v: Any) -> Sequence:
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes, bytearray)):
        return v
    raise TypeError(f"{type(v).__name__} value is not a list")


def _as_dict(v: Any) -> Mapping:
    if isinstance(v, Mapping):
        return v
    raise TypeError(f"{type(v).__name__} value is not a dict")


def _out_of_range(n: int, avro_type: str) -> None:
    raise ValueError(f"{n} is out of range for an Avro {avro_type}")


def _not_null(v: Any) -> None:
    raise TypeError(f"{v!r:.60} is not null")


def _bad_bool(v: Any) -> bytes:
    raise TypeError(f"{v!r:.60} is not a boolean")


class _Compiler:
    def __init__(self) -> None:
        self.ns: dict[str, Any] = {
            "_count": _count, "_pack_float": _pack_float, "_pack_double": _pack_double,
            "_TABLE": _TABLE, "_TS": _TABLE_SIZE, "_varint": _varint, "_str_bytes": _str_bytes,
            "_as_bytes": _as_bytes, "_as_list": _as_list, "_as_dict": _as_dict, "_not_null": _not_null,
            "_out_of_range": _out_of_range, "_index": _index,
            "_bad_bool": _bad_bool, "_bytes": bytes, "_str": str, "_list": list, "_dict": dict,
        }
        self.funcs: dict[str, str] = {}  # record full name -> function name
        self.named: dict[str, dict[str, Any]] = {}  # full name -> record/enum schema
        self.sources: list[str] = []
        self.n = 0

    def var(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def const(self, value: Any) -> str:
        name = self.var("_c")
        self.ns[name] = value
        return name

    def resolve(self, schema: Any) -> Any:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return schema
            if schema in self.named:
                return self.named[schema]
            raise ValueError(f"unknown Avro type {schema!r}")
        if isinstance(schema, dict):
            t = schema["type"]
            if t in ("record", "error", "enum", "fixed"):
                self.named.setdefault(schema["name"], schema)
            elif isinstance(t, str) and t in _PRIMITIVES:
                return t
        return schema

    def emit(self, schema: Any, v: str, out: list[str], ind: str) -> None:
        """Appends lines that write the value held in local variable `v`."""
        s = self.resolve(schema)
        if s == "null":
            out.append(f"{ind}if {v} is not None: _not_null({v})")
        elif s == "boolean":
            out.append(f"{ind}ap(b'\\x01' if {v} is True else b'\\x00' if {v} is False else _bad_bool({v}))")
        elif s in ("int", "long"):  # inlined _int/_long: a Python call per value is most of the cost
            n, z = self.var("n"), self.var("z")
            lo, hi, shift = (_INT_MIN, _INT_MAX, 31) if s == "int" else (_LONG_MIN, _LONG_MAX, 63)
            out.append(f"{ind}{n} = _index({v})")
            out.append(f"{ind}if not {lo} <= {n} <= {hi}: _out_of_range({n}, {s!r})")
            out.append(f"{ind}{z} = ({n} << 1) ^ ({n} >> {shift})")
            out.append(f"{ind}ap(_TABLE[{z}] if {z} < _TS else _varint({z}))")
        elif s == "float":
            out.append(f"{ind}ap(_pack_float({v}))")  # struct.error for a non-number
        elif s == "double":
            out.append(f"{ind}ap(_pack_double({v}))")
        elif s == "bytes":
            out.append(f"{ind}if {v}.__class__ is not _bytes: {v} = _as_bytes({v})")
            self.emit_length(v, out, ind)
            out.append(f"{ind}ap({v})")
        elif s == "string":
            b = self.var("b")
            out.append(f"{ind}{b} = {v}.encode() if {v}.__class__ is _str else _str_bytes({v})")
            self.emit_length(b, out, ind)
            out.append(f"{ind}ap({b})")
        elif isinstance(s, list):
            self.emit_union(s, v, out, ind)
        elif s["type"] in ("record", "error"):
            out.append(f"{ind}{self.record(s)}({v}, ap)")
        elif s["type"] == "enum":
            table = {sym: _count(i) for i, sym in enumerate(s["symbols"])}
            out.append(f"{ind}ap({self.const(table)}[{v}])")
        elif s["type"] == "array":
            x = self.var("x")
            out.append(f"{ind}if {v}.__class__ is not _list: {v} = _as_list({v})")
            out.append(f"{ind}if {v}:")
            out.append(f"{ind}    ap(_count(len({v})))")
            out.append(f"{ind}    for {x} in {v}:")
            self.emit(s["items"], x, out, ind + "        ")
            out.append(f"{ind}ap(b'\\x00')")
        elif s["type"] == "map":
            k, x, kb = self.var("k"), self.var("x"), self.var("b")
            out.append(f"{ind}if {v}.__class__ is not _dict: {v} = _as_dict({v})")
            out.append(f"{ind}if {v}:")
            out.append(f"{ind}    ap(_count(len({v})))")
            out.append(f"{ind}    for {k}, {x} in {v}.items():")
            out.append(f"{ind}        {kb} = {k}.encode() if {k}.__class__ is _str else _str_bytes({k})")
            self.emit_length(kb, out, ind + "        ")
            out.append(f"{ind}        ap({kb})")
            self.emit(s["values"], x, out, ind + "        ")
            out.append(f"{ind}ap(b'\\x00')")
        else:
            raise ValueError(f"Avro type {s!r} is not supported by the compiled encoder")

    def emit_length(self, b: str, out: list[str], ind: str) -> None:
        z = self.var("z")
        out.append(f"{ind}{z} = len({b}) << 1")
        out.append(f"{ind}ap(_TABLE[{z}] if {z} < _TS else _varint({z}))")

    def emit_union(self, branches: list[Any], v: str, out: list[str], ind: str) -> None:
        resolved = [self.resolve(b) for b in branches]
        if len(resolved) != 2 or "null" not in resolved:
            raise ValueError(f"union {branches!r} is not supported (only null and one other type)")
        null_at = resolved.index("null")
        other = branches[1 - null_at]
        out.append(f"{ind}if {v} is None:")
        out.append(f"{ind}    ap({_TABLE[null_at << 1]!r})")
        out.append(f"{ind}else:")
        out.append(f"{ind}    ap({_TABLE[(1 - null_at) << 1]!r})")
        self.emit(other, v, out, ind + "    ")

    def record(self, schema: dict[str, Any]) -> str:
        name = schema["name"]
        fn = self.funcs.get(name)
        if fn is not None:
            return fn
        fn = self.funcs[name] = f"_w{len(self.funcs)}"
        lines = [f"def {fn}(d, ap):  # {name}", "    if d.__class__ is not _dict: d = _as_dict(d)"]
        for f in schema["fields"]:
            v = self.var("v")
            if "default" in f:
                lines.append(f"    {v} = d.get({f['name']!r}, {self.const(f['default'])})")
            else:
                lines.append(f"    {v} = d[{f['name']!r}]")
            self.emit(f["type"], v, lines, "    ")
        self.sources.append("\n".join(lines))
        return fn


def compile_encoder(parsed_schema: dict[str, Any]) -> Encoder:
    """`write(datum, append)` for a record schema as `fastavro.parse_schema` returns it."""
    c = _Compiler()
    schema = c.resolve(parsed_schema)
    if not isinstance(schema, dict) or schema.get("type") not in ("record", "error"):
        raise ValueError("compile_encoder takes a record schema")
    top = c.record(schema)
    exec(compile("\n\n".join(c.sources), f"<avro encoder {schema['name']}>", "exec"), c.ns)
    return c.ns[top]
