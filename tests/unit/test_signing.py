"""Signed authority records (astraflow.kafka.signing): what a signature binds, and each key state."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.kafka.signing import HEADER, KeyStore, SignatureError, Signer, Verifier, stream_role


def test_a_signature_binds_stream_key_and_value_to_the_owner_role(tmp_path: Path) -> None:
    store = KeyStore("exp", tmp_path).ensure()
    trainer, operator, verifier = Signer("exp", "trainer", store), Signer("exp", "operator", store), Verifier("exp", store)
    h = trainer.headers("p.weights", "p", b"bytes")
    assert verifier.check("p.weights", b"p", b"bytes", list(h.items())).key_id == trainer.key_id
    for stream, key, value, why in [("p.weights", "p", b"bytez", "bad signature"),  # altered value
                                    ("q.weights", "p", b"bytes", "bad signature"),  # moved to another policy
                                    ("p.weights", "q", b"bytes", "bad signature"),  # another key
                                    ("policies", "p", b"bytes", "bad signature")]:
        with pytest.raises(SignatureError, match=why):
            verifier.check(stream, key, value, h)
    with pytest.raises(SignatureError, match="only the trainer writes it"):  # the operator cannot speak for the trainer
        verifier.check("policies", "p", b"v", operator.headers("policies", "p", b"v"))
    with pytest.raises(SignatureError, match="only the operator writes it"):
        verifier.check("control", "a/s", None, trainer.headers("control", "a/s", None))
    assert verifier.check("control", "a/s", None, operator.headers("control", "a/s", None))  # a signed tombstone
    with pytest.raises(SignatureError, match="unsigned"):
        verifier.check("control", "a/s", b"v", [])
    for bad in ("v2:x:1:00", "v1:abc:notanumber:00", "v1:" + "x" * 600, "nonsense"):
        with pytest.raises(SignatureError, match="malformed"):
            verifier.check("control", "a/s", b"v", {HEADER: bad})
    with pytest.raises(SignatureError, match="not in"):  # a key of another experiment
        other = Signer("other", "operator", KeyStore("other", tmp_path))
        verifier.check("control", "a/s", b"v", other.headers("control", "a/s", b"v"))
    assert stream_role("control") == "operator" and stream_role("policies") == stream_role("x.weights") == "trainer"


def test_rotation_keeps_old_records_and_revocation_refuses_everything(tmp_path: Path) -> None:
    store = KeyStore("exp", tmp_path).ensure()
    verifier = Verifier("exp", KeyStore("exp", tmp_path))  # another reader of the same trust file
    old = Signer("exp", "operator", store)
    before = old.headers("control", "k", b"v")
    store.rotate("operator")
    new = Signer("exp", "operator", store)
    assert new.key_id != old.key_id
    assert verifier.check("control", "k", b"v", before).key_id == old.key_id  # signed before it retired
    with pytest.raises(SignatureError, match="retired"):
        verifier.check("control", "k", b"v", old.headers("control", "k", b"v"))  # a stolen old key signing now
    store.revoke(new.key_id)
    with pytest.raises(SignatureError, match="revoked"):
        verifier.check("control", "k", b"v", new.headers("control", "k", b"v"))
    assert not (store.dir / "private" / f"{new.key_id}.pem").exists()
    assert (store.dir / "private").stat().st_mode & 0o077 == 0
