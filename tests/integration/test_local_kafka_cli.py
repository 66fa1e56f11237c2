"""`astraflow kafka` and `astraflow topics` as a user runs them, against the session's broker."""

from __future__ import annotations

import json
import subprocess
import sys

from astraflow.config import KafkaSettings


def _cli(*args: str, env_bootstrap: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_bootstrap:
        env["ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS"] = env_bootstrap
    return subprocess.run([sys.executable, "-m", "astraflow_cli.main", *args], capture_output=True, text=True, env=env, timeout=120)


def test_up_on_running_broker_is_a_noop(kafka: KafkaSettings) -> None:
    if kafka.bootstrap_servers != "127.0.0.1:19092":
        return  # external broker: the local manager is not in charge
    res = _cli("kafka", "up")
    assert res.returncode == 0, res.stderr
    assert "already running" in res.stdout
    res = _cli("kafka", "status", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["answering"] is True


def test_topics_create_list_describe(kafka: KafkaSettings, unique) -> None:
    exp = unique("cli")
    b = kafka.bootstrap_servers
    res = _cli("topics", "create", "--experiment", exp, "--policy", "solver", env_bootstrap=b)
    assert res.returncode == 0, res.stderr
    res = _cli("topics", "list", "--experiment", exp, "--json", env_bootstrap=b)
    listed = json.loads(res.stdout)
    assert f"af.{exp}.solver.train" in listed and f"af.{exp}.control" in listed
    res = _cli("topics", "describe", "--experiment", exp, "--policy", "solver", env_bootstrap=b)
    assert "cleanup.policy=compact" in res.stdout
    from astraflow.kafka.topics import TopicAdmin

    TopicAdmin(kafka).delete(list(listed))


def test_unreachable_cluster_gives_a_clear_error() -> None:
    res = _cli("topics", "list", env_bootstrap="127.0.0.1:1")
    assert res.returncode == 1
    assert "TopicError" not in res.stderr and "is Kafka reachable" in res.stderr
