"""The per-role ACL table: its shape, and docs/deploy-secure.md showing exactly it."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import TopicSettings
from astraflow.errors import ConfigError
from astraflow.kafka.acl import READER_GROUPS, kafka_acls_commands, principal_of, role_grants, role_topics
from astraflow.kafka.topics import Topics, topic_specs

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy-secure.md"


def test_docs_show_the_table_the_code_applies() -> None:
    text = DOC.read_text()
    start = text.index("| principal | resource |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]  # after the header and its rule
    expected = [
        f"| {g.principal} | {g.resource} | `{g.name}` | {g.pattern.lower()} | {', '.join(g.operations)} | {g.why} |"
        for g in role_grants("exp1", ["solver"])
    ]
    assert rows == expected


def test_only_a_policys_trainer_writes_its_weights() -> None:
    grants = role_grants("e", ["a", "b"])
    writers = {(g.principal, g.name) for g in grants if "WRITE" in g.operations and g.name.endswith(".weights")}
    assert writers == {("e.trainer-a", "af.e.a.weights"), ("e.trainer-b", "af.e.b.weights")}
    # No prefix grant reaches a weights topic except read-only roles' (archive, monitor).
    for g in grants:
        if g.pattern == "PREFIXED" and g.resource == "TOPIC" and "af.e.a.weights".startswith(g.name):
            assert set(g.operations) <= {"READ", "DESCRIBE_CONFIGS", "CREATE", "DESCRIBE"}, g
            assert g.principal in ("e.archive", "e.monitor", "e.operator"), g


def test_only_a_policys_trainer_uses_its_publisher_transactional_id() -> None:
    grants = role_grants("e", ["a", "b"])
    ids = {(g.principal, g.name, g.pattern) for g in grants if g.resource == "TRANSACTIONAL_ID" and "WRITE" in g.operations}
    assert {i for i in ids if i[0].startswith("e.trainer-")} == {
        ("e.trainer-a", Topics("e").publisher_id("a"), "LITERAL"), ("e.trainer-b", Topics("e").publisher_id("b"), "LITERAL")
    }
    # No other principal's grant (literal or prefix) reaches a publisher id.
    for who, name, pattern in ids - {("e.trainer-a", "af.e.a.publisher", "LITERAL"),
                                     ("e.trainer-b", "af.e.b.publisher", "LITERAL")}:
        for tid in ("af.e.a.publisher", "af.e.b.publisher"):
            assert not (tid.startswith(name) if pattern == "PREFIXED" else tid == name), (who, name)


def test_principals_and_commands() -> None:
    assert principal_of("raas", "exp1") == "exp1.raas"
    assert principal_of("trainer", "exp1", "solver") == "exp1.trainer-solver"
    cmd = kafka_acls_commands(role_grants("e", ["p"]))
    assert any("--allow-principal User:e.trainer-p --operation Read --operation Write --topic 'af.e.p.weights'" in c for c in cmd)
    assert any("--transactional-id 'af.e.curate-' --resource-pattern-type prefixed" in c for c in cmd)


def test_the_topics_a_role_checks_at_start_are_its_table_rows() -> None:
    t = Topics("e")
    assert set(role_topics("trainer", "e", ["a"])) == {
        t.control, t.dlq, t.metrics, t.train("a"), t.weights("a"), t.policies, t.lineage, t.snapshot_requests
    }  # not another policy's, not the topics it never touches
    assert set(role_topics("raas", "e", ["a", "b"])) == {
        t.control, t.dlq, t.metrics, t.tasks, t.rollouts, t.policies, t.weights("a"), t.weights("b"),
        t.snapshot_requests,
    }


def test_no_principal_of_one_experiment_is_granted_anything_of_another() -> None:
    """Each experiment's principals are its own, and every row they hold names that experiment's
    topics, groups and transactional ids, or an assign-only reader's throwaway group (DESCRIBE)."""
    a, b = role_grants("a", ["solver"]), role_grants("b", ["solver"])
    assert not {g.principal for g in a} & {g.principal for g in b}
    assert all(g.principal.startswith("a.") for g in a)
    throwaway = set(READER_GROUPS.values())
    for g in a:
        if g.name.startswith("af.a."):
            continue
        assert g.resource == "GROUP" and g.name in throwaway and g.operations == ("DESCRIBE",), g
    # No row of experiment a, literal or prefix, reaches a name of experiment b (nor of "a-b" etc.).
    for name in [*(s.name for s in topic_specs("b", ["solver"], TopicSettings())), "af.b.raas", "af.ab.tasks"]:
        assert not [g for g in a if (name.startswith(g.name) if g.pattern == "PREFIXED" else name == g.name)], name


def test_control_is_written_by_the_operator_only() -> None:
    writers = {g.principal for g in role_grants("e", ["a", "b"]) if g.name == "af.e.control" and "WRITE" in g.operations}
    assert writers == {"e.operator"}


def test_a_policy_named_like_an_apps_prefix_or_a_stream_is_refused() -> None:
    with pytest.raises(ConfigError, match="curate-"):
        role_grants("e", ["curate-x"])
    with pytest.raises(ConfigError, match="stream of every experiment"):
        role_grants("e", ["tasks"])


def test_the_regions_tasks_are_granted_by_their_prefix_and_nothing_else_is_under_it() -> None:
    t = Topics("e")
    region = t.tasks_of("b")
    grants = role_grants("e", ["solver"])
    under = {(g.principal, g.operations) for g in grants if g.resource == "TOPIC" and g.name == t.region_tasks_prefix}
    assert under == {("e.curator", ("WRITE",)), ("e.raas", ("READ",)), ("e.curate", ("READ",))}
    assert region.startswith(t.region_tasks_prefix) and not t.tasks.startswith(t.region_tasks_prefix)
    for spec in topic_specs("e", ["solver"], TopicSettings()):  # no topic of the experiment falls under it
        assert not spec.name.startswith(t.region_tasks_prefix), spec.name
