"""Archive files without a broker: format, manifests, rolling, recovery, corruption, fsspec stores."""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path

import fastavro
import pytest

from astraflow.archive import ArchiveCorruptError, ArchivedRecord, ArchiveReader, ArchiveWriter, RollPolicy
from astraflow.archive.manifest import Manifest
from astraflow.archive.writer import PartitionArchive
from astraflow.serde import AvroSerde
from astraflow.testing import make_task, make_trajectory

TOPIC = "af.exp.rollouts"


def records(n: int, partition: int = 0, start: int = 0, serde: AvroSerde | None = None) -> list[ArchivedRecord]:
    serde = serde or AvroSerde()
    out = []
    for i in range(start, start + n):
        t = make_trajectory(48, task_id=f"task-{i}", seed=i, reward=i / 100)
        out.append(ArchivedRecord(TOPIC, partition, i, 1_700_000_000_000 + i * 10, serde.dumps(t), f"g-{i % 5}".encode(),
                                  [("trace", f"t{i}".encode()), ("empty", None)]))
    return out


def write(root: Path | str, recs: list[ArchivedRecord], **policy: object) -> list[Manifest]:
    w = ArchiveWriter(root, RollPolicy(**policy))  # type: ignore[arg-type]
    sealed = [m for r in recs if (m := w.append(r)) is not None]
    return sealed + w.close()


def test_round_trip_keeps_every_field_and_byte(tmp_path: Path) -> None:
    recs = records(30) + records(20, partition=1)
    manifests = write(tmp_path, recs, block_records=7)
    assert sorted((m.partition, m.records) for m in manifests) == [(0, 30), (1, 20)]
    reader = ArchiveReader(tmp_path)
    assert reader.topics() == [TOPIC] and reader.partitions(TOPIC) == [0, 1]
    assert list(reader.read_partition(TOPIC, 0)) == recs[:30]
    assert list(reader.read_partition(TOPIC, 1)) == recs[30:]
    merged = list(reader.read_topic(TOPIC))
    assert len(merged) == 50 and [r.timestamp_ms for r in merged] == sorted(r.timestamp_ms for r in merged)
    assert reader.count(TOPIC) == 50


def test_files_are_standard_avro_containers_with_zstd(tmp_path: Path) -> None:
    write(tmp_path, records(10), block_records=4)
    (path,) = (tmp_path / TOPIC / "p0000").glob("*.avro")
    with open(path, "rb") as f:
        rd = fastavro.reader(f)
        rows = list(rd)
        assert rd.codec == "zstandard" and rd.writer_schema["name"] == "astraflow.archive.ArchivedRecord"
    assert [r["offset"] for r in rows] == list(range(10))
    assert AvroSerde().decode(rows[3]["value"])[1]["task_id"] == "task-3"


def test_manifest_describes_the_file(tmp_path: Path) -> None:
    serde = AvroSerde()
    recs = records(9, serde=serde)
    recs.append(ArchivedRecord(TOPIC, 0, 12, 1_700_000_000_500, serde.dumps(make_task(1)), None))  # offset gap
    recs.append(ArchivedRecord(TOPIC, 0, 13, 1_699_999_999_000, None, b"deleted"))  # tombstone, older timestamp
    (m,) = write(tmp_path, recs, block_records=4)
    assert m.file == "00000000000000000000-00000000000000000013.avro"
    assert (m.first_offset, m.last_offset, m.records) == (0, 13, 11)
    assert m.min_timestamp_ms == 1_699_999_999_000 and m.max_timestamp_ms == 1_700_000_000_500
    assert m.first_timestamp_ms == recs[0].timestamp_ms and m.last_timestamp_ms == 1_699_999_999_000
    traj_fp = serde.catalog.latest("astraflow.Trajectory").fingerprint.hex()
    assert m.schemas[traj_fp].records == 9 and m.schemas[traj_fp].name == "astraflow.Trajectory"
    assert m.schemas[traj_fp].version == AvroSerde().catalog.latest("astraflow.Trajectory").version and m.schemas["tombstone"].records == 1
    assert [b.records for b in m.blocks] == [4, 4, 3] and m.blocks[2].first_offset == 8
    on_disk = tmp_path / TOPIC / "p0000" / "00000000000000000000-00000000000000000013.manifest.json"
    assert Manifest.from_json(on_disk.read_text()) == m
    assert m.bytes == (tmp_path / TOPIC / "p0000" / m.file).stat().st_size


def test_files_roll_by_records_size_and_age(tmp_path: Path) -> None:
    by_records = write(tmp_path / "r", records(25), max_file_records=10)
    assert [(m.first_offset, m.last_offset) for m in by_records] == [(0, 9), (10, 19), (20, 24)]
    size = len(records(1)[0].value or b"")
    by_size = write(tmp_path / "s", records(20), max_file_bytes=5 * size, block_records=1)
    # Size counts compressed bytes on disk: a file closes once it passes the limit.
    assert len(by_size) >= 2 and sum(m.records for m in by_size) == 20
    assert all(m.bytes < 5 * size + 2 * size for m in by_size)
    w = ArchiveWriter(tmp_path / "a", RollPolicy(max_file_age_s=30))
    w.append(records(1)[0])
    pa = w.partition(TOPIC, 0)
    assert not pa.due() and pa.due(now=pa._open.opened_at + 31)  # type: ignore[union-attr]
    assert [m.records for m in w.seal_due(now=pa._open.opened_at + 31)] == [1]  # type: ignore[union-attr]


def test_restart_resumes_after_manifests_and_never_duplicates(tmp_path: Path) -> None:
    recs = records(30)
    write(tmp_path, recs[:20], max_file_records=8)
    w = ArchiveWriter(tmp_path, RollPolicy(max_file_records=8))
    assert w.partition(TOPIC, 0).next_offset == 20
    for r in recs:  # a consumer that rewound to 0: the first 20 are dropped
        w.append(r)
    w.close()
    assert w.partition(TOPIC, 0).skipped == 20
    assert [r.offset for r in ArchiveReader(tmp_path).read_partition(TOPIC, 0)] == list(range(30))


def test_recover_cleans_staging_files_and_rebuilds_missing_manifest(tmp_path: Path) -> None:
    (_, m2) = write(tmp_path, records(16), max_file_records=8)
    d = tmp_path / TOPIC / "p0000"
    (d / "00000000000000000008-00000000000000000015.manifest.json").unlink()  # crash between the two renames
    (d / ".00000000000000000016.avro.part").write_bytes(b"Obj\x01half a file")  # crash mid-file
    pa = PartitionArchive(ArchiveWriter(tmp_path).store, TOPIC, 0, RollPolicy(), AvroSerde().catalog)
    assert pa.recover() == 15
    assert not (d / ".00000000000000000016.avro.part").exists()
    rebuilt = Manifest.from_json((d / "00000000000000000008-00000000000000000015.manifest.json").read_text())
    assert rebuilt.rebuilt and rebuilt.records == 8 and rebuilt.blocks == m2.blocks and rebuilt.sha256 == m2.sha256


def _corrupt(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("with_manifest", [True, False])
def test_corrupt_block_names_file_and_block_and_rest_stays_readable(tmp_path: Path, with_manifest: bool) -> None:
    (m,) = write(tmp_path, records(40), block_records=10)
    path = tmp_path / TOPIC / "p0000" / m.file
    _corrupt(path, m.blocks[1].byte_offset + m.blocks[1].byte_size // 2)
    if not with_manifest:
        (tmp_path / TOPIC / "p0000" / (m.file[:-5] + ".manifest.json")).unlink()

    with pytest.raises(ArchiveCorruptError) as err:
        list(ArchiveReader(tmp_path).read_partition(TOPIC, 0))
    assert f"{TOPIC}/p0000/{m.file}" in str(err.value) and "block 1" in str(err.value)
    assert err.value.block == 1 and err.value.byte_offset == m.blocks[1].byte_offset

    reader = ArchiveReader(tmp_path, skip_corrupt=True)
    offsets = [r.offset for r in reader.read_partition(TOPIC, 0)]
    assert offsets == list(range(10)) + list(range(20, 40))
    (report,) = reader.corrupt
    assert report.block == 1 and report.file.endswith(m.file)
    if with_manifest:
        assert "CRC-32" in report.reason and (report.first_offset, report.last_offset, report.records) == (10, 19, 10)


def test_corrupt_header_is_reported_and_other_files_read(tmp_path: Path) -> None:
    manifests = write(tmp_path, records(20), max_file_records=10)
    _corrupt(tmp_path / TOPIC / "p0000" / manifests[0].file, 0)
    reader = ArchiveReader(tmp_path, skip_corrupt=True)
    assert [r.offset for r in reader.read_partition(TOPIC, 0)] == list(range(10, 20))
    assert reader.corrupt[0].block is None and "header" in str(reader.corrupt[0])


def test_time_range_uses_manifests_and_record_timestamps(tmp_path: Path) -> None:
    write(tmp_path, records(50), max_file_records=10)
    reader = ArchiveReader(tmp_path)
    since, until = 1_700_000_000_000 + 125, 1_700_000_000_000 + 300
    assert [r.offset for r in reader.read_topic(TOPIC, since, until)] == list(range(13, 31))
    assert reader.count(TOPIC, since, until) == 30  # three files overlap: an upper bound


def test_fsspec_memory_store_round_trip() -> None:
    uri = f"memory://af-archive-{uuid.uuid4().hex}"
    recs = records(12)
    manifests = write(uri, recs, max_file_records=5)
    assert [m.records for m in manifests] == [5, 5, 2]
    reader = ArchiveReader(uri)
    assert reader.topics() == [TOPIC] and list(reader.read_partition(TOPIC, 0)) == recs
    assert ArchiveWriter(uri).partition(TOPIC, 0).next_offset == 12
    import fsspec

    fsspec.filesystem("memory").rm(uri.removeprefix("memory://"), recursive=True)


def test_manifest_json_is_plain_json(tmp_path: Path) -> None:
    (m,) = write(tmp_path, records(3))
    d = json.loads(m.to_json())
    assert d["format"] == "astraflow-archive/1" and d["records"] == 3 and isinstance(d["blocks"][0]["crc32"], int)


def test_block_is_all_or_nothing(tmp_path: Path) -> None:
    """A block whose data decodes partially yields none of its records."""
    (m,) = write(tmp_path, records(6), block_records=3)
    path = tmp_path / TOPIC / "p0000" / m.file
    data = path.read_bytes()
    # Cut the file inside the last block: the first block stays whole.
    path.write_bytes(data[: m.blocks[1].byte_offset + 5])
    os.remove(tmp_path / TOPIC / "p0000" / (m.file[:-5] + ".manifest.json"))
    reader = ArchiveReader(tmp_path, skip_corrupt=True)
    assert [r.offset for r in reader.read_partition(TOPIC, 0)] == [0, 1, 2]
    assert reader.corrupt and reader.corrupt[0].block == 1
    assert io.BytesIO(data).read(4) == b"Obj\x01"
