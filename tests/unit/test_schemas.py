"""Every schema parses and has a Python class (the compatibility rules: test_schema_compat.py)."""

import json

from astraflow.records import RECORD_TYPES
from astraflow.schema_catalog import SchemaCatalog


def test_every_schema_has_a_record_class() -> None:
    cat = SchemaCatalog.load()
    assert set(cat.names()) == set(RECORD_TYPES)


def test_packed_array_fields_document_their_encoding() -> None:
    cat = SchemaCatalog.load()
    text = json.dumps(cat.latest("astraflow.Trajectory").raw)
    assert "little-endian" in text and "int32" in text and "float32" in text
