"""TensorBoard logging without the `tensorboard` package: scalar event files TensorBoard reads.

`TensorBoardScalars` is a Lightning logger that writes every logged metric as a TensorBoard
scalar (`events.out.tfevents.*` under `<run dir>/tensorboard/`), so `tensorboard --logdir RUN_DIR`
shows the training curves (loss, reward, KL, entropy, staleness, samples/s) without the trainer
depending on TensorBoard or TensorFlow. Besides what the module logs it adds
`train/samples_per_s`: samples of the step over the wall time since the previous step was logged.

The file format: a sequence of TFRecords (length, masked CRC-32C of the length, the bytes, masked
CRC-32C of the bytes), each an `Event` protocol buffer: first `file_version = "brain.Event:2"`,
then one per step with `wall_time`, `step` and a `Summary` of `{tag, simple_value}` values.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE = _table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (negative: ten bytes)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint((number << 3) | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def scalar_event(wall_time: float, step: int, values: dict[str, float]) -> bytes:
    """An `Event` with a `Summary` of simple values."""
    summary = b"".join(
        _field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", float(v)))) for tag, v in values.items()
    )
    return _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step)) + _field(5, 2, summary)


def version_event(wall_time: float) -> bytes:
    return _field(1, 1, struct.pack("<d", wall_time)) + _field(3, 2, b"brain.Event:2")


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


class EventFile:
    """Appends scalar events to one new event file in `directory`."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.0"
        self._f = open(self.path, "ab")  # noqa: SIM115 (kept open for the run; closed by close())
        self._f.write(tfrecord(version_event(now)))
        self._f.flush()

    def add(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        self._f.write(tfrecord(scalar_event(time.time() if wall_time is None else wall_time, step, values)))
        self._f.flush()  # a reader (TensorBoard, the dashboard) sees each step as it is trained

    def close(self) -> None:
        self._f.close()


class TensorBoardScalars(Logger):
    """Lightning logger: every metric a TensorBoard scalar under `<root>/tensorboard/` (see the module doc)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self._root = Path(root) / "tensorboard"
        self._file: EventFile | None = None
        self._last: float | None = None

    @property
    def name(self) -> str:
        return "tensorboard"

    @property
    def version(self) -> int:
        return 0

    @property
    def log_dir(self) -> str:
        return str(self._root)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are in trainer-config.json next to the run; not repeated here."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._file is None:
            self._file = EventFile(self._root)
        now = time.time()
        values = {k: float(v) for k, v in metrics.items() if k != "epoch"}
        if "train/samples" in values and self._last is not None and now > self._last:
            values["train/samples_per_s"] = values["train/samples"] / (now - self._last)
        self._last = now
        self._file.add(int(step or 0), values, now)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        n |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return n, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    out, i = [], 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            size, i = _read_varint(buf, i)
            value, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, wire, value))
    return out


def read_scalars(path: Path) -> list[tuple[int, float, dict[str, float]]]:
    """(step, wall time, {tag: value}) of every scalar event of one event file, CRCs checked;
    a torn last record (a file being written) ends the list."""
    data, out, i = Path(path).read_bytes(), [], 0
    while i + 12 <= len(data):
        header = data[i:i + 8]
        (size,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != masked_crc(header):
            raise ValueError(f"{path}: corrupt record length at byte {i}")
        body, end = data[i + 12:i + 12 + size], i + 16 + size
        if end > len(data):
            break
        if struct.unpack("<I", data[end - 4:end])[0] != masked_crc(body):
            raise ValueError(f"{path}: corrupt record at byte {i}")
        i = end
        wall, step, values = 0.0, 0, {}
        for number, _, value in _fields(body):
            if number == 1:
                (wall,) = struct.unpack("<d", value)
            elif number == 2:
                step = value
            elif number == 5:
                for _, _, v in _fields(value):
                    parts = {n: x for n, _, x in _fields(v)}
                    if 1 in parts and 2 in parts:
                        values[parts[1].decode()] = struct.unpack("<f", parts[2])[0]
        if values:
            out.append((step, wall, values))
    return out
