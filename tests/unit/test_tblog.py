"""TensorBoard event files written without TensorBoard: CRC-32C, protobuf framing, round trip."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from trainers.tblog import EventFile, TensorBoardScalars, crc32c, masked_crc, read_scalars, scalar_event


def test_crc32c_matches_the_standard_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720's CRC-32C check value
    assert crc32c(b"") == 0


def test_a_scalar_event_is_the_protobuf_tensorboard_expects() -> None:
    # Event{wall_time: 2.0 (1, fixed64), step: 300 (2, varint), summary (5){value (1){tag "a" (1), simple_value 0.5 (2, fixed32)}}}
    value = b"\x0a\x01a" + b"\x15" + struct.pack("<f", 0.5)
    expected = b"\x09" + struct.pack("<d", 2.0) + b"\x10\xac\x02" + b"\x2a\x0a" + b"\x0a\x08" + value
    assert scalar_event(2.0, 300, {"a": 0.5}) == expected


def test_event_files_round_trip_and_detect_corruption(tmp_path: Path) -> None:
    f = EventFile(tmp_path / "tb")
    f.add(1, {"train/loss": 0.25, "train/reward": 1.0}, wall_time=10.0)
    f.add(2, {"train/loss": -3.5}, wall_time=11.0)
    f.close()
    assert read_scalars(f.path) == [(1, 10.0, {"train/loss": 0.25, "train/reward": 1.0}), (2, 11.0, {"train/loss": -3.5})]
    data = bytearray(f.path.read_bytes())
    data[-6] ^= 0xFF  # inside the last record's payload
    f.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt record"):
        read_scalars(f.path)
    assert masked_crc(b"x") != crc32c(b"x")


def test_the_logger_adds_samples_per_second(tmp_path: Path) -> None:
    log = TensorBoardScalars(tmp_path)
    log.log_metrics({"train/samples": 8.0, "train/loss": 1.0, "epoch": 0.0}, step=1)
    log.log_metrics({"train/samples": 8.0, "train/loss": 0.5}, step=2)
    log.finalize("success")
    [path] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    events = read_scalars(path)
    assert [s for s, _, _ in events] == [1, 2]
    assert "epoch" not in events[0][2] and "train/samples_per_s" not in events[0][2]
    assert events[1][2]["train/samples_per_s"] > 0 and events[1][2]["train/loss"] == 0.5


def test_tensorboard_itself_reads_the_files(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    f = EventFile(tmp_path)
    for step in range(1, 4):
        f.add(step, {"train/loss": 1.0 / step})
    f.close()
    acc = accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
