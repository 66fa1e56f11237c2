"""Credentials and broker settings of a secure cluster: SASL/SCRAM-SHA-512 and ACLs.

A secure local cluster (`astraflow kafka up --secure`) authenticates every client with
SCRAM-SHA-512 on its client listener and authorizes every request with Kafka's
StandardAuthorizer: no ACL, no access (`allow.everyone.if.no.acl.found=false`), except for the
`admin` super user. The brokers authenticate to each other as `admin` over the same listener
(SCRAM credentials are written into the metadata log at format time, so they exist before the
first broker starts) and to the controllers with SASL/PLAIN on the controller listener (a
controller must authenticate brokers before it has read any metadata, so SCRAM cannot serve
there). The listeners are plaintext TCP on 127.0.0.1: on a shared network use SASL_SSL.

Where passwords live: `<data_dir>/credentials.json`, mode 0600, one random password per
principal (`admin` and one per role of each experiment, see `astraflow.kafka.acl`). A process gets only its own role's
credentials, through the environment (`astraflow kafka credentials ROLE -e EXP` prints the lines):
`ASTRAFLOW__KAFKA__SECURITY_PROTOCOL`, `ASTRAFLOW__KAFKA__SASL_MECHANISM`,
`ASTRAFLOW__KAFKA__SASL_USERNAME`, `ASTRAFLOW__KAFKA__SASL_PASSWORD`. Passwords never appear in
`astraflow config`, resolved-config files or logs (`astraflow.secrets`).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError
from astraflow.secrets import register_secret

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

ADMIN = "admin"
MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192


class CredentialStore:
    """One random password per principal, in `<root>/credentials.json` (readable by its owner only)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "credentials.json"

    def _load(self) -> dict[str, str]:
        if not self.path.exists():
            return {}
        return dict(json.loads(self.path.read_text()))

    def password(self, user: str, create: bool = True) -> str:
        creds = self._load()
        if user not in creds:
            if not create:
                raise KafkaLayerError(f"no credentials for {user!r} in {self.path}; grant the role first")
            creds[user] = secrets.token_urlsafe(24)  # [A-Za-z0-9_-]: safe inside JAAS quotes
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(creds, f, indent=1, sort_keys=True)
            tmp.replace(self.path)
        register_secret(creds[user])
        return creds[user]

    def admin_password(self) -> str:
        return self.password(ADMIN)

    def users(self) -> list[str]:
        return sorted(self._load())

    def settings(self, bootstrap: str, user: str) -> KafkaSettings:
        """Client settings that authenticate as `user` (whose password must exist)."""
        return KafkaSettings(
            bootstrap_servers=bootstrap,
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=MECHANISM,
            sasl_username=user,
            sasl_password=self.password(user, create=user == ADMIN),
        )

    def env(self, bootstrap: str, user: str) -> dict[str, str]:
        """The environment that gives one process exactly `user`'s credentials."""
        return {
            "ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "ASTRAFLOW__KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "ASTRAFLOW__KAFKA__SASL_MECHANISM": MECHANISM,
            "ASTRAFLOW__KAFKA__SASL_USERNAME": user,
            "ASTRAFLOW__KAFKA__SASL_PASSWORD": self.password(user, create=False),
        }


def secure_server_props(bootstrap: str, controller_port: int, admin_password: str) -> dict[str, str]:
    """server.properties entries that turn on SASL and ACLs for one node."""
    scram = f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" password="{admin_password}";'
    plain = (
        f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{ADMIN}" '
        f'password="{admin_password}" user_{ADMIN}="{admin_password}";'
    )
    return {
        "listeners": f"SASL_PLAINTEXT://{bootstrap},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_PLAINTEXT://{bootstrap}",
        "inter.broker.listener.name": "SASL_PLAINTEXT",
        "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
        "listener.name.sasl_plaintext.sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.sasl_plaintext.{MECHANISM.lower()}.sasl.jaas.config": scram,
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": plain,
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN}",
    }


def format_scram_args(admin_password: str) -> list[str]:
    """`kafka-storage format` arguments that create the admin's SCRAM credentials at format time."""
    return ["--add-scram", f"{MECHANISM}=[name={ADMIN},iterations={SCRAM_ITERATIONS},password={admin_password}]"]


def upsert_users(admin: AdminClient, passwords: dict[str, str], timeout_s: float = 30.0) -> None:
    """Creates (or resets) SCRAM-SHA-512 credentials for each user, through the Admin API."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    ups = [UserScramCredentialUpsertion(user, info, pw.encode()) for user, pw in sorted(passwords.items())]
    if not ups:
        return
    for user, fut in admin.alter_user_scram_credentials(ups).items():
        try:
            fut.result(timeout=timeout_s)
        except KafkaException as exc:
            raise KafkaLayerError(f"cannot set the SCRAM credentials of {user!r}: {exc}") from exc
