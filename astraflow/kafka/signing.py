"""Signed authority records: who wrote a weights, policy-version or control record.

Topics are written by many machines, and on the default local cluster (no ACLs) by anyone who
reaches the broker. Records that carry authority (a policy's weights and its version on
`policies`: its trainer's; commands on `control`: the operator's; the tasks on `tasks` and
`tasks.<region>`, which say what each GRPO group is: the curator's) are therefore signed by the
role that owns them, with an Ed25519 key of that role *and* experiment, and every reader
verifies the signature before the record changes anything. ACLs are a second wall.

**Where the signature lives.** In a Kafka header, `af-sig`, so no schema changes and old
readers ignore it: `v1:<key id>:<signed at, ms>:<signature hex>`. The signature covers
`astraflow-sig-v1`, the logical stream (`control`, `policies`, `<policy>.weights`: not the
topic name, which MirrorMaker 2 may rename), the record's key, the signing time and the sha256
of the value (a tombstone signs the empty value). A record moved to another stream or key, or
altered in one bit, fails; one copied into another experiment meets that experiment's keys,
which never signed it.

**Keys** (`KeyStore`, made by `astraflow keys create|list|rotate|revoke`): under
`$ASTRAFLOW_KEYS_DIR` (default `~/.astraflow/keys`), one folder per experiment holding
`trust.json` (the public keys with role, creation, retirement and revocation times: public,
ship it to every host, region B included) and `private/<key id>.pem` (mode 0600: only on the
hosts of the role that writes). A machine whose experiment has no keys yet makes them on first
use (`ensure`), so one laptop needs no setup; several hosts share `trust.json` (and each writer
its private key) by copying the folder or mounting it.

**Rules** (`Verifier.check`): the header is present and well formed; the key id is in the
trust file, for the role that owns the stream; the key is not revoked (revocation refuses
everything it ever signed: it is for a key that leaked); a retired key (rotated out) is
accepted only for records it signed before it was retired; the signature matches. Replay of an
old, validly signed record is the reader's to refuse (a version that does not go back, a
control slot whose signing time does not go back): see `astraflow.control` and
`astraflow.weights.follow`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from astraflow.errors import AstraflowError, ConfigError
from astraflow.kafka.topics import check_name

HEADER = "af-sig"
# Roles that sign: weights and `policies` (trainer), `control` (operator), the tasks on `tasks`
# and `tasks.<region>` (curator), and each its own `metrics` records (trainer, raas: the RaaS
# nodes, apps: the stream apps and processors).
ROLES = ("trainer", "operator", "raas", "apps", "curator")
METRICS = "metrics"  # the logical stream metric signatures cover
_DOMAIN = b"astraflow-sig-v1"
log = logging.getLogger("astraflow.signing")
_MAX_HEADER = 512


class SignatureError(AstraflowError):
    """Raised when an authority record is unsigned, signed by a key the reader does not trust
    for that role, or its signature does not match; the reader dead-letters it and changes nothing."""


class KeysError(ConfigError):
    """Raised when the keys of an experiment cannot be read, made or found for a role."""


def keys_dir() -> Path:
    """Where experiments' keys live: $ASTRAFLOW_KEYS_DIR, else ~/.astraflow/keys."""
    return Path(os.environ.get("ASTRAFLOW_KEYS_DIR") or Path.home() / ".astraflow" / "keys")


def stream_role(stream: str) -> str:
    """The role that owns an authority stream (`control`, `policies`, `<policy>.weights`, `tasks`)."""
    if stream == "control":
        return "operator"
    if stream == "tasks":  # every tasks topic, region A's and each region's own (one logical stream)
        return "curator"
    if stream == "policies" or stream.endswith(".weights"):
        return "trainer"
    raise ValueError(f"{stream!r} is not an authority stream")


def metric_role(component: str) -> str | None:
    """The role whose key signs a `Metric` of `component` (None: a component that signs nothing,
    whose metrics are always shown unverified)."""
    if component in ("raas", "trainer"):
        return component
    if component in ("reward", "curate", "curator") or component.startswith("proc."):
        return "apps"
    if component == "eval":  # the held-out evaluator, run by the operator (`astraflow eval`, the demo)
        return "operator"
    return None


def _message(stream: str, key: bytes | str | None, ts_ms: int, value: bytes | None) -> bytes:
    # The experiment is not in the message: its keys are (a trust file per experiment), so a
    # record copied into another experiment meets keys that never signed it.
    k = key.encode() if isinstance(key, str) else (key or b"")
    parts = [_DOMAIN, stream.encode(), hashlib.sha256(k).digest(), str(ts_ms).encode(),
             hashlib.sha256(value or b"").digest()]
    return b"\0".join(parts)


def _key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class TrustedKey:
    """One public key of the trust file."""

    key_id: str
    role: str
    public: Ed25519PublicKey
    created_ms: int
    retired_ms: int | None = None  # rotated out: records it signed after this are refused
    revoked_ms: int | None = None  # leaked: everything it signed is refused


class KeyStore:
    """The keys of one experiment on this machine (see the module doc)."""

    def __init__(self, experiment: str, root: Path | None = None) -> None:
        self.experiment = check_name("experiment", experiment)
        self.dir = (root or keys_dir()) / experiment
        self._trust: dict[str, TrustedKey] = {}
        self._mtime: float | None = None

    @property
    def trust_file(self) -> Path:
        return self.dir / "trust.json"

    def exists(self) -> bool:
        return self.trust_file.is_file()

    def ensure(self) -> KeyStore:
        """Makes a key per signing role when the experiment has none here (atomically: of two
        processes that race, one set wins and both use it)."""
        if self.exists():
            return self
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.experiment}.", dir=self.dir.parent))
        try:
            staged = KeyStore(self.experiment, tmp.parent)
            staged.dir = tmp
            data: dict[str, Any] = {"experiment": self.experiment, "keys": {}}
            for role in ROLES:
                staged._new_key(role, data)
            os.rename(tmp, self.dir)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not self.exists():
                raise KeysError(f"cannot make the keys of experiment {self.experiment} in {self.dir.parent}; "
                                "set ASTRAFLOW_KEYS_DIR to a writable folder") from None
        return self

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.trust_file.read_text())
        except FileNotFoundError:
            return {"experiment": self.experiment, "keys": {}}
        except (OSError, ValueError) as exc:
            raise KeysError(f"cannot read {self.trust_file}: {exc}; restore it from another host") from exc

    def _write(self, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.trust_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self.trust_file)
        self._mtime = None

    def _new_key(self, role: str, data: dict[str, Any]) -> str:
        if role not in ROLES:
            raise KeysError(f"role {role!r} signs nothing; roles that sign: {', '.join(ROLES)}")
        private = Ed25519PrivateKey.generate()
        kid = _key_id(private.public_key())
        (self.dir / "private").mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.dir / "private" / f"{kid}.pem"
        pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        data = data or {"experiment": self.experiment, "keys": {}}
        data["keys"][kid] = {"role": role, "public": base64.b64encode(raw).decode(), "created_ms": _now_ms(),
                             "retired_ms": None, "revoked_ms": None}
        self._write(data)
        return kid

    def create(self, role: str) -> str:
        """A new key for `role` (the others stay valid); returns its id."""
        return self._new_key(role, self._read())

    def rotate(self, role: str) -> str:
        """A new key for `role`; the role's other keys are retired (what they signed before now
        stays valid, nothing they sign from now on is). Returns the new key's id."""
        data = self._read()
        now = _now_ms()
        for entry in data["keys"].values():
            if entry["role"] == role and entry.get("retired_ms") is None and entry.get("revoked_ms") is None:
                entry["retired_ms"] = now
        return self._new_key(role, data)

    def revoke(self, key_id: str) -> None:
        """Refuses everything `key_id` ever signed (a leaked key); make a new one with `create`."""
        data = self._read()
        if key_id not in data["keys"]:
            raise KeysError(f"no key {key_id} in {self.trust_file}; `astraflow keys list -e {self.experiment}` shows them")
        data["keys"][key_id]["revoked_ms"] = _now_ms()
        self._write(data)
        (self.dir / "private" / f"{key_id}.pem").unlink(missing_ok=True)

    def trusted(self) -> dict[str, TrustedKey]:
        """The trust file's keys (read again when the file changed)."""
        try:
            mtime = self.trust_file.stat().st_mtime_ns
        except FileNotFoundError:
            return {}
        if mtime != self._mtime:
            out = {}
            for kid, e in self._read().get("keys", {}).items():
                try:
                    public = Ed25519PublicKey.from_public_bytes(base64.b64decode(e["public"]))
                except (KeyError, ValueError) as exc:
                    raise KeysError(f"{self.trust_file}: key {kid} is malformed ({exc})") from exc
                out[kid] = TrustedKey(kid, e["role"], public, int(e["created_ms"]), e.get("retired_ms"), e.get("revoked_ms"))
            self._trust, self._mtime = out, mtime
        return self._trust

    def signing_key(self, role: str) -> tuple[str, Ed25519PrivateKey]:
        """The newest usable private key of `role` on this machine."""
        usable = sorted((k for k in self.trusted().values()
                         if k.role == role and k.retired_ms is None and k.revoked_ms is None),
                        key=lambda k: k.created_ms, reverse=True)
        for k in usable:
            path = self.dir / "private" / f"{k.key_id}.pem"
            if path.is_file():
                key = serialization.load_pem_private_key(path.read_bytes(), None)
                assert isinstance(key, Ed25519PrivateKey)
                return k.key_id, key
        raise KeysError(f"no private {role} key of experiment {self.experiment} in {self.dir / 'private'}: this host "
                        f"cannot sign as {role}; copy the role's key here, or `astraflow keys create -e "
                        f"{self.experiment} --role {role}`")


def _now_ms() -> int:
    return int(time.time() * 1000)


class Signer:
    """Signs the records one role writes to one experiment's authority streams."""

    def __init__(self, experiment: str, role: str, store: KeyStore | None = None) -> None:
        self.experiment, self.role = experiment, role
        self.store = (store or KeyStore(experiment)).ensure()
        if not any(k.role == role for k in self.store.trusted().values()):
            # A role the experiment's keys predate (made before that role signed): its first key is
            # made here, as `ensure` does for a new experiment; other hosts need the new trust.json.
            self.store.create(role)
        self.key_id, self._key = self.store.signing_key(role)

    def headers(self, stream: str, key: bytes | str | None, value: bytes | None) -> dict[str, str]:
        """The `af-sig` header of one record (send it with exactly this key and value)."""
        ts = _now_ms()
        sig = self._key.sign(_message(stream, key, ts, value))
        return {HEADER: f"v1:{self.key_id}:{ts}:{sig.hex()}"}


@dataclass(frozen=True)
class Signed:
    """What a valid signature says about a record."""

    key_id: str
    ts_ms: int  # when its writer signed it (by the writer's clock)


class Verifier:
    """Checks `af-sig` headers against one experiment's trust file (see the module doc)."""

    def __init__(self, experiment: str, store: KeyStore | None = None) -> None:
        self.experiment = experiment
        self.store = (store or KeyStore(experiment)).ensure()

    def check(self, stream: str, key: bytes | str | None, value: bytes | None,
              headers: list[tuple[str, Any]] | dict[str, Any] | None, role: str | None = None) -> Signed:
        """The signature of one record read from `stream`, by a key of `role` (default: the
        stream's owner); raises SignatureError saying why not."""
        role = role or stream_role(stream)
        items = headers.items() if isinstance(headers, dict) else (headers or [])
        found = [v for k, v in items if k == HEADER]
        if not found:
            raise SignatureError(f"unsigned record on {stream}: only the {role} of experiment "
                                 f"{self.experiment} may write it (header {HEADER} missing)")
        if len(found) > 1:
            raise SignatureError(f"record on {stream} carries {len(found)} {HEADER} headers")
        raw = found[0]
        text = raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else str(raw)
        parts = text.split(":")
        if len(text) > _MAX_HEADER or len(parts) != 4 or parts[0] != "v1" or not parts[2].isdigit():
            raise SignatureError(f"malformed {HEADER} header on {stream}")
        _, kid, ts_text, sig_hex = parts
        ts = int(ts_text)
        trusted = self.store.trusted().get(kid)
        if trusted is None:
            raise SignatureError(f"record on {stream} signed by key {kid}, not in {self.store.trust_file}: "
                                 "an unknown writer, or this host's trust file is out of date (copy it from the operator)")
        if trusted.role != role:
            raise SignatureError(f"record on {stream} signed by a {trusted.role} key ({kid}); only the {role} writes it")
        if trusted.revoked_ms is not None:
            raise SignatureError(f"record on {stream} signed by revoked key {kid}")
        try:
            trusted.public.verify(bytes.fromhex(sig_hex), _message(stream, key, ts, value))
        except (InvalidSignature, ValueError):
            raise SignatureError(f"bad signature on {stream} (key {kid}): the record was altered, or moved "
                                 "from another key, stream or experiment") from None
        if trusted.retired_ms is not None and ts > trusted.retired_ms:
            raise SignatureError(f"record on {stream} signed at {ts} by key {kid}, retired at {trusted.retired_ms}")
        return Signed(kid, ts)


class MetricSigner:
    """Signs `Metric` records with the key of the role their component names (`metric_role`),
    where this host holds it; a host without that key sends them unsigned (readers then show
    them as unverified) and says so once in its log."""

    def __init__(self) -> None:
        self._signers: dict[tuple[str, str], Signer | None] = {}

    def headers(self, topic: str, key: bytes | str | None, value: bytes, component: str) -> dict[str, str] | None:
        from astraflow.kafka.topics import experiment_of

        experiment, role = experiment_of(topic), metric_role(component)
        if experiment is None or role is None:
            return None
        if (experiment, role) not in self._signers:
            try:
                self._signers[(experiment, role)] = Signer(experiment, role)
            except KeysError as exc:
                log.warning("metrics of %s go unsigned (status shows them as unverified): %s", component, exc)
                self._signers[(experiment, role)] = None
        signer = self._signers[(experiment, role)]
        return None if signer is None else signer.headers(METRICS, key, value)


__all__ = [
    "HEADER",
    "METRICS",
    "ROLES",
    "KeyStore",
    "KeysError",
    "MetricSigner",
    "SignatureError",
    "Signed",
    "Signer",
    "Verifier",
    "keys_dir",
    "metric_role",
    "stream_role",
]
