from pathlib import Path

import pytest
from pydantic import ValidationError

from astraflow.config import AstraflowConfig, load_config, write_resolved
from astraflow.errors import ConfigError


def test_defaults_are_frozen() -> None:
    cfg = load_config(env={})
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:19092"
    with pytest.raises(ValidationError):
        cfg.experiment = "x"  # type: ignore[misc]


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("experiment: fromfile\nkafka:\n  bootstrap_servers: file:1\ntopics:\n  partitions: 2\n")
    cfg = load_config(f, env={})
    assert (cfg.experiment, cfg.kafka.bootstrap_servers, cfg.topics.partitions) == ("fromfile", "file:1", 2)
    cfg = load_config(f, env={"ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": "env:2"})
    assert cfg.kafka.bootstrap_servers == "env:2"
    cfg = load_config(f, ["kafka.bootstrap_servers=cli:3", "topics.partitions=8"], env={"ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS": "env:2"})
    assert (cfg.kafka.bootstrap_servers, cfg.topics.partitions) == ("cli:3", 8)


def test_toml(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('experiment = "t"\n[kafka]\nbootstrap_servers = "h:9"\n')
    assert load_config(f, env={}).kafka.bootstrap_servers == "h:9"


def test_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="topics.partitions"):
        load_config(overrides=["topics.partitions=many"], env={})
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(overrides=["nonsense"], env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        load_config(overrides=["kafka.security_protocol=SASL_SSL"], env={})
    with pytest.raises(ConfigError, match="Extra inputs"):
        load_config(overrides=["kafka.bootstrap=x"], env={})


def test_sasl_client_config_and_masked_resolution(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            "kafka.security_protocol=SASL_SSL",
            "kafka.sasl_mechanism=SCRAM-SHA-512",
            "kafka.sasl_username=u",
            "kafka.sasl_password=s3cret",
            "kafka.ssl_ca_location=/ca.pem",
        ],
        env={},
    )
    conf = cfg.kafka.client_config()
    assert conf["sasl.password"] == "s3cret" and conf["security.protocol"] == "SASL_SSL"
    assert conf["ssl.ca.location"] == "/ca.pem"
    out = write_resolved(cfg, tmp_path / "run")
    assert "s3cret" not in out.read_text() and '"sasl_username": "u"' in out.read_text()
    assert AstraflowConfig.model_validate_json(out.read_text().replace('"**********"', '"x"')).kafka.sasl_username == "u"
