"""The compatibility gate: each record type's declared rule holds over every version in schemas/,
in both directions, and a change that breaks it is refused naming the field and the rule."""

import copy

import pytest

from astraflow.errors import ConfigError
from astraflow.records import RECORD_TYPES
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir
from astraflow.schema_compat import RULES, check_candidate, check_catalog, check_history, load_rules

pytestmark = pytest.mark.unit


def _record(*fields: dict) -> dict:
    return {"type": "record", "name": "Probe", "namespace": "astraflow.test", "fields": list(fields)}


A = {"name": "a", "type": "string"}
B_DEFAULT = {"name": "b", "type": "int", "default": 3}
B_REQUIRED = {"name": "b", "type": "int"}


def test_shipped_schemas_pass_their_rules() -> None:
    assert check_catalog() == []


def test_every_record_type_declares_a_rule() -> None:
    rules = load_rules()
    assert set(rules) == set(RECORD_TYPES)
    assert set(rules.values()) <= set(RULES)
    crossing = {"astraflow.Task", "astraflow.Trajectory", "astraflow.TrainSample", "astraflow.PolicyVersion"}
    assert {rules[n] for n in crossing} == {"FULL_TRANSITIVE"}


def test_missing_rule_is_a_problem() -> None:
    rules = load_rules()
    del rules["astraflow.Task"]
    problems = check_catalog(SchemaCatalog.load(), rules)
    assert problems == ["astraflow.Task: no compatibility rule in schemas/compatibility.json; declare one"]


def test_added_field_without_default_is_refused_backward() -> None:
    [r] = check_history("astraflow.test.Probe", "FULL_TRANSITIVE", [("v1", _record(A)), ("v2", _record(A, B_REQUIRED))])
    assert (r.direction, r.reader, r.writer, r.fields) == ("backward", "v2", "v1", ("b",))
    assert "FULL_TRANSITIVE" in str(r) and "'b'" in str(r) and "reader_field_missing_default_value" in str(r)


def test_removed_field_without_default_is_refused_forward() -> None:
    [r] = check_history("astraflow.test.Probe", "FULL", [("v1", _record(A, B_REQUIRED)), ("v2", _record(A))])
    assert (r.direction, r.reader, r.writer, r.fields) == ("forward", "v1", "v2", ("b",))
    # BACKWARD alone lets it through: new readers ignore the writer's extra field.
    assert check_history("astraflow.test.Probe", "BACKWARD", [("v1", _record(A, B_REQUIRED)), ("v2", _record(A))]) == []


def test_defaults_make_add_and_remove_fully_compatible() -> None:
    history = [("v1", _record(A)), ("v2", _record(A, B_DEFAULT)), ("v3", _record(B_DEFAULT))]
    refused = check_history("astraflow.test.Probe", "FULL_TRANSITIVE", history)  # `a` had no default
    assert {(r.direction, r.reader, r.writer, r.fields) for r in refused} == {
        ("forward", "v1", "v3", ("a",)), ("forward", "v2", "v3", ("a",))
    }
    history = [("v1", _record({**A, "default": ""})), ("v2", _record({**A, "default": ""}, B_DEFAULT)), ("v3", _record(B_DEFAULT))]
    assert check_history("astraflow.test.Probe", "FULL_TRANSITIVE", history) == []


def test_transitive_rule_checks_every_earlier_version() -> None:
    """v3 reads v2 and back, but a v3 reader cannot read v1's records: only *_TRANSITIVE sees it."""
    history = [("v1", _record(A)), ("v2", _record(A, B_DEFAULT)), ("v3", _record(A, B_REQUIRED))]
    assert check_history("astraflow.test.Probe", "FULL", history) == []
    [r] = check_history("astraflow.test.Probe", "FULL_TRANSITIVE", history)
    assert (r.direction, r.reader, r.writer, r.fields) == ("backward", "v3", "v1", ("b",))


def test_type_change_is_refused_both_ways() -> None:
    history = [("v1", _record(A)), ("v2", _record({"name": "a", "type": "int"}))]
    refusals = check_history("astraflow.test.Probe", "FULL", history)
    assert {r.direction for r in refusals} == {"backward", "forward"}
    assert all("type_mismatch" in r.problems for r in refusals)


def test_candidate_for_a_shipped_record() -> None:
    catalog = SchemaCatalog.load()
    task = copy.deepcopy(catalog.latest("astraflow.Task").raw)
    task["fields"].append({"name": "priority", "type": "int", "default": 0})
    assert check_candidate(catalog, task) == []
    task["fields"] = [f for f in task["fields"] if f["name"] != "prompt"]  # prompt has no default
    [r] = check_candidate(catalog, task)
    assert (r.record, r.rule, r.direction, r.fields) == ("astraflow.Task", "FULL_TRANSITIVE", "forward", ("prompt",))


def test_broken_rules_file(tmp_path) -> None:
    (tmp_path / "compatibility.json").write_text('{"rules": {"astraflow.Task": {"rule": "SIDEWAYS"}}}')
    with pytest.raises(ConfigError, match="SIDEWAYS"):
        load_rules(tmp_path)
    assert (default_schemas_dir() / "compatibility.json").exists()


def test_roles_read_the_rules_without_apache_avro() -> None:
    """Roles register with a registry using `load_rules`; they are installed without `avro` (a
    development dependency), so only the check itself may import it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['avro'] = None; from astraflow.schema_compat import load_rules; "
            "print(load_rules()['astraflow.Task'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "FULL_TRANSITIVE", res.stderr
