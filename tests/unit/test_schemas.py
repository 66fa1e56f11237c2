"""Every schema parses, has a Python class, and stays backward compatible with its previous version."""

import itertools
import json

import pytest
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType
from avro.schema import parse

from astraflow.records import RECORD_TYPES
from astraflow.schema_catalog import SchemaCatalog


def test_every_schema_has_a_record_class() -> None:
    cat = SchemaCatalog.load()
    assert set(cat.names()) == set(RECORD_TYPES)


def test_packed_array_fields_document_their_encoding() -> None:
    cat = SchemaCatalog.load()
    text = json.dumps(cat.latest("astraflow.Trajectory").raw)
    assert "little-endian" in text and "int32" in text and "float32" in text


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_backward_compatible_with_previous_version(name: str) -> None:
    """A reader on version N must read data written with N-1 (the avro package's checker)."""
    versions = SchemaCatalog.load().versions(name)
    for old, new in itertools.pairwise(versions):
        result = ReaderWriterCompatibilityChecker().get_compatibility(
            parse(json.dumps(new.raw)), parse(json.dumps(old.raw))
        )
        assert result.compatibility is SchemaCompatibilityType.compatible, (old.path, new.path, result.messages)
