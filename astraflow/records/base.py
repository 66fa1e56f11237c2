"""Shared helpers for typed records: the `Record` protocol and packed-array conversion."""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, Self

import numpy as np

# Wire dtypes of the packed arrays (DESIGN.md, "Wire format").
INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
UINT8 = np.dtype("u1")


def now_ms() -> int:
    """Milliseconds since the epoch, the unit of every timestamp field."""
    return int(time.time() * 1000)


def pack(arr: Any, dtype: np.dtype) -> bytes:
    """Packs a sequence or array into little-endian bytes of `dtype`: the very bytes an array wraps
    whole (`unpack`'s, or bytes joined by the caller), else a copy."""
    a = np.asarray(arr)
    if a.dtype != dtype:
        a = a.astype(dtype)
    base = a.base
    if base.__class__ is bytes and a.nbytes == len(base) and a.flags.c_contiguous:  # type: ignore[union-attr]
        return base  # type: ignore[return-value]
    return a.tobytes()


def unpack(buf: bytes, dtype: np.dtype) -> np.ndarray:
    """Wraps packed bytes as a read-only numpy array without copying."""
    return np.frombuffer(buf, dtype=dtype)


class Record(Protocol):
    """What every typed record offers: its schema name and dict conversion both ways."""

    SCHEMA: ClassVar[str]

    def to_avro(self) -> dict[str, Any]: ...

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> Self: ...


class FlatRecord:
    """Mixin for dataclass records whose fields are all Avro-native (str, numbers, maps, bytes).

    `to_avro` copies the fields into a dict, `from_avro` passes them back to the constructor
    (positionally, in field order: the decoder's dict holds every field of the current schema).
    Records with nested types or packed arrays override both.
    """

    __slots__ = ()

    def to_avro(self) -> dict[str, Any]:
        names, get = _attr_getter(type(self))
        return dict(zip(names, get(self), strict=True))

    @classmethod
    def from_avro(cls, d: dict[str, Any]) -> Self:
        return cls(*_field_getter(cls)(d))


@functools.cache
def _attr_getter(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The field names of `cls` and a C-level getter of their values, in field order."""
    names = field_names(cls)
    if len(names) == 1:
        return names, lambda obj: (getattr(obj, names[0]),)
    return names, operator.attrgetter(*names)


@functools.cache
def _field_getter(cls: type) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The fields of `cls` out of a decoded dict, as a tuple in field order (C-level itemgetter)."""
    names = field_names(cls)
    if len(names) == 1:
        return lambda d: (d[names[0]],)
    return operator.itemgetter(*names)


@functools.cache
def field_names(cls: type) -> tuple[str, ...]:
    """Names of a dataclass's instance fields (ClassVars such as SCHEMA excluded)."""
    return tuple(f.name for f in dataclasses.fields(cls))
