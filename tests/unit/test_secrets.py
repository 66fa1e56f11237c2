"""No secret in `astraflow config`, resolved-config files or logs; metrics listen on loopback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config import KafkaSettings, load_config, write_resolved
from astraflow.metrics_export import start_from_env, start_metrics_server
from astraflow.secrets import MASK, install_log_redaction, redact_text, redact_url

SASL_PW = "sasl-Pa55word-7c1e"
S3_PW = "s3SecretKey/with+chars"
KEY_PW = "tls-key-pass-91"
REG_PW = "registry-pw-42"
BASIC_PW = "basic-auth-pw-58"


def test_urls_lose_their_password_and_keep_the_rest() -> None:
    assert redact_url("s3://AKIA:abc123@bucket/runs/v1.bin") == f"s3://AKIA:{MASK}@bucket/runs/v1.bin"
    assert redact_url("https://bucket.example/x?a=1") == "https://bucket.example/x?a=1"
    text = redact_text("snapshot at s3://me:hunter22@b/x and sasl.password=hunter33 ok")
    assert "hunter22" not in text and "hunter33" not in text and "s3://me:" in text and "ok" in text


def _secret_env() -> dict[str, str]:
    return {
        "ASTRAFLOW__KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "ASTRAFLOW__KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "ASTRAFLOW__KAFKA__SASL_USERNAME": "raas",
        "ASTRAFLOW__KAFKA__SASL_PASSWORD": SASL_PW,
        "ASTRAFLOW__KAFKA__SCHEMA_REGISTRY_URL": f"https://reg:{REG_PW}@registry.example:8081",
        "ASTRAFLOW__KAFKA__CLIENT_EXTRA": json.dumps({"ssl.key.password": KEY_PW, "socket.timeout.ms": "30000"}),
        "ASTRAFLOW__KAFKA__SCHEMA_REGISTRY_CONFIG": json.dumps({"basic.auth.user.info": f"reg:{BASIC_PW}"}),
    }


def test_astraflow_config_masks_every_secret() -> None:
    env = {**os.environ, **_secret_env()}
    res = subprocess.run([sys.executable, "-m", "astraflow_cli.main", "config"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    for secret in (SASL_PW, REG_PW, KEY_PW, BASIC_PW):
        assert secret not in res.stdout + res.stderr
    shown = json.loads(res.stdout)
    assert shown["kafka"]["sasl_username"] == "raas"  # what is not secret stays readable
    assert shown["kafka"]["client_extra"]["socket.timeout.ms"] == "30000"
    assert shown["kafka"]["schema_registry_url"].startswith("https://reg:")


def test_resolved_config_files_mask_every_secret(tmp_path: Path) -> None:
    cfg = load_config(env=_secret_env())
    out = write_resolved(cfg, tmp_path).read_text()
    for secret in (SASL_PW, REG_PW, KEY_PW, BASIC_PW):
        assert secret not in out
    assert cfg.kafka.client_config()["sasl.password"] == SASL_PW  # the clients still get the real one


def test_logs_mask_registered_secrets_url_passwords_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    install_log_redaction()
    KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u",
                  sasl_password=SASL_PW).client_config()  # registers the password
    log = logging.getLogger("astraflow.test")
    with caplog.at_level(logging.INFO, logger="astraflow.test"):
        log.info("connecting with %s", SASL_PW)
        log.warning("weights at s3://key:%s@bucket/v3", S3_PW)
        try:
            raise RuntimeError(f"cannot open s3://key:{S3_PW}@bucket/v3")
        except RuntimeError:
            log.exception("store failed")
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert SASL_PW not in text and S3_PW.split("/")[0] not in text
    assert text.count(MASK) >= 3


def test_metrics_endpoint_listens_on_loopback_unless_told_otherwise() -> None:
    server = start_metrics_server(0)
    try:
        assert server.addr == "127.0.0.1"
        assert server._httpd.socket.getsockname()[0] == "127.0.0.1"  # type: ignore[attr-defined]
    finally:
        server.close()
    env_server = start_from_env({"ASTRAFLOW_METRICS_PORT": "0"})
    assert env_server is not None
    try:
        assert env_server._httpd.socket.getsockname()[0] == "127.0.0.1"  # type: ignore[attr-defined]
    finally:
        env_server.close()
    assert start_from_env({}) is None


def test_secret_fields_are_named_like_secrets_and_nothing_else_is() -> None:
    from astraflow.secrets import is_secret_key

    for key in ("sasl_password", "ssl.key.password", "aws_secret_access_key", "api-key", "access_token", "sasl.jaas.config",
                "basic.auth.user.info"):
        assert is_secret_key(key), key
    for key in ("max_tokens", "max_new_tokens", "passes", "compass", "tokenizer", "sasl_username", "key"):
        assert not is_secret_key(key), key
    assert redact_text("max_tokens=512 sasl.password=abc123 token: xyz") == f"max_tokens=512 sasl.password={MASK} token: {MASK}"
