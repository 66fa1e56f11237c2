"""Every step of an experiment's life has its command: `experiments list | delete`, `topics create
--stream`, `replay --create-target`, and a one-line error for what does not exist."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.config import KafkaSettings, TopicSettings
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import TopicAdmin, Topics, topic_specs
from astraflow.testing import make_trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _cli(kafka: KafkaSettings, *args: str, stdin: str | None = None) -> tuple[int, str]:
    from astraflow_cli.main import app

    res = CliRunner().invoke(app, ["--set", f"kafka.bootstrap_servers={kafka.bootstrap_servers}", *args], input=stdin,
                             env={"COLUMNS": "250"})
    return res.exit_code, res.output


def _listed(admin: TopicAdmin, prefix: str, want: int = 1) -> dict[str, int]:
    """The topics under `prefix`, once `want` of them reached the metadata (a moment after creation)."""
    deadline = time.monotonic() + 10
    while len(found := admin.list(prefix)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def test_an_experiment_from_creation_to_deletion(kafka: KafkaSettings, tmp_path: Path) -> None:
    exp, new = f"life-{uuid.uuid4().hex[:8]}", f"life-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(kafka)
    try:
        code, out = _cli(kafka, "topics", "create", "-e", exp, "-p", "solver")
        assert code == 0, out
        code, out = _cli(kafka, "topics", "create", "-e", exp, "--stream", "judged", "--partitions", "3")
        assert code == 0 and "created" in out, out
        assert _listed(admin, f"af.{exp}.judged") == {f"af.{exp}.judged": 3}
        code, out = _cli(kafka, "topics", "create", "-e", exp, "--stream", "bad/name")
        assert code == 1 and "stream name 'bad/name'" in out

        n_topics = len(topic_specs(exp, ["solver"], TopicSettings())) + 1  # the experiment's own, and judged
        _listed(admin, f"af.{exp}.", n_topics)
        code, out = _cli(kafka, "experiments", "list", "--json")
        assert code == 0, out
        rows = {r["experiment"]: r for r in map(json.loads, out.splitlines())}
        assert rows[exp]["policies"] == ["solver"] and rows[exp]["streams"] == ["judged"]
        assert rows[exp]["topics"] == n_topics

        t = Topics(exp)
        producer = RecordProducer(kafka)
        for i in range(5):
            tr = make_trajectory(64, task_id=f"task-{i}", seed=i)
            producer.send(t.rollouts, tr, key=tr.group_id)
        producer.flush()
        # Replay into another experiment that does not exist yet: refused with how to fix it, then made.
        code, out = _cli(kafka, "replay", "--from", t.rollouts, "--to", Topics(new).rollouts)
        assert code == 1 and "--create-target" in out, out
        code, out = _cli(kafka, "replay", "--from", t.rollouts, "--to", Topics(new).rollouts, "--create-target")
        assert code == 0 and "published 5" in out, out
        assert _listed(admin, Topics(new).rollouts) == {Topics(new).rollouts: 4}  # a built-in stream, as topics create makes it

        code, out = _cli(kafka, "logs", "show", "-e", f"nosuch-{exp}")
        assert code == 1 and f"no experiment 'nosuch-{exp}'" in out and "astraflow experiments list" in out
        assert "Error" not in out and len(out.strip().splitlines()) == 1
        code, out = _cli(kafka, "logs", "show", "-e", exp, "-t", "nosuch")
        assert code == 1 and "has no stream 'nosuch'" in out and "rollouts" in out and "Error" not in out

        # A demo starts a fresh experiment: an existing name is refused before anything runs.
        code, out = _cli(kafka, "demo", "--experiment", exp, "--bootstrap", kafka.bootstrap_servers)
        assert code == 1 and f"experiment '{exp}' already exists" in out and "experiments delete" in out, out

        code, out = _cli(kafka, "experiments", "delete", exp, stdin="n\n")
        assert code == 1 and "nothing deleted" in out
        assert admin.list(f"af.{exp}.")
        code, out = _cli(kafka, "experiments", "delete", exp, "--yes")
        assert code == 0 and f"deleted {n_topics} topics" in out, out
        assert not admin.list(f"af.{exp}.")
        code, out = _cli(kafka, "experiments", "delete", exp, "--yes")
        assert code == 1 and f"no experiment '{exp}'" in out and "Error" not in out
    finally:
        left = list(admin.list(f"af.{exp}.")) + list(admin.list(f"af.{new}."))
        if left:
            admin.delete(left)
