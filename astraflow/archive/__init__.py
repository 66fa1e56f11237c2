"""Historical logs: archive any topic into Avro container files, read them back, replay them.

- `writer`: Kafka records -> container files rolled by size and age, durable before commit.
- `reader`: files -> records, block by block, with skip-and-report for corrupted blocks.
- `manifest`: what each file holds (offsets, times, schema fingerprints, blocks).
- `replay`: archive or topic -> topic, in per-partition order, filtered and paced.
- `render`: records for people and for machines (`astraflow logs show`).
See docs/archive.md.
"""

from astraflow.archive.errors import ArchiveCorruptError, ArchiveError, FilterError, ReplayError
from astraflow.archive.format import ArchivedRecord
from astraflow.archive.manifest import Manifest
from astraflow.archive.reader import ArchiveReader, CorruptBlock
from astraflow.archive.writer import ArchiveWriter, RollPolicy

__all__ = [
    "ArchiveCorruptError",
    "ArchiveError",
    "ArchiveReader",
    "ArchiveWriter",
    "ArchivedRecord",
    "CorruptBlock",
    "FilterError",
    "Manifest",
    "ReplayError",
    "RollPolicy",
]
