"""The schema compatibility gate: each record type's rule, checked in both directions.

`schemas/compatibility.json` declares one rule per record type (the names Confluent's and
Apicurio's registries use): BACKWARD means a reader on the new version reads records of the
older ones, FORWARD that a reader on an older version reads the new version's records, FULL
both; a `_TRANSITIVE` rule checks against every earlier version, the plain one against the
previous only. Records that cross roles or are replayed from archives are FULL_TRANSITIVE, so a
node built a year ago and a curate built today read each other, and an archive replays today.

`check_catalog` runs the rule over every version kept in `schemas/` (a unit test in `make
check`); `check_candidate` checks a proposed schema before it ships. A refusal names the record,
the versions, the direction, the rule and the fields at fault. The pairwise check is Apache
Avro's own (`avro.compatibility`, the Java checker's port), so the gate agrees with what a
registry enforcing the same rule would accept. Apache Avro (`avro`, a development dependency) is
imported only by the check itself: roles read their rules here (`load_rules`, when they register
with a schema registry) and are installed without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from astraflow.errors import ConfigError
from astraflow.schema_catalog import SchemaCatalog, default_schemas_dir

Rule = Literal["NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE"]
RULES: tuple[str, ...] = Rule.__args__  # type: ignore[attr-defined]
RULES_FILE = "compatibility.json"


@dataclass(frozen=True, slots=True)
class Refusal:
    """One reader/writer pair a rule needs that Avro schema resolution cannot do."""

    record: str  # full name, e.g. astraflow.Task
    rule: str  # the rule that asked for the pair
    direction: Literal["backward", "forward"]  # backward: new reads old; forward: old reads new
    reader: str  # version label of the reader, e.g. "v2"
    writer: str  # version label of the writer
    fields: tuple[str, ...]  # the fields (or types) Avro names as the cause
    problems: tuple[str, ...]  # Avro's incompatibility kinds, e.g. reader_field_missing_default_value

    def __str__(self) -> str:
        fields = ", ".join(repr(f) for f in self.fields) or "(whole schema)"
        return (
            f"{self.record}: {self.rule} refuses it ({self.direction}: a {self.reader} reader cannot read a "
            f"{self.writer} writer): field {fields}: {', '.join(self.problems)}; give a new field a default, "
            f"remove only fields that had one, and never change a field's type"
        )


def load_rules(directory: Path | None = None) -> dict[str, str]:
    """Record full name -> rule, from `<schemas>/compatibility.json`."""
    path = (directory or default_schemas_dir()) / RULES_FILE
    try:
        entries = json.loads(path.read_text())["rules"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the compatibility rules {path}: {exc}; it maps each record to a rule") from exc
    rules = {}
    for name, entry in entries.items():
        rule = entry.get("rule") if isinstance(entry, dict) else None
        if rule not in RULES:
            raise ConfigError(f"{path}: {name} has rule {rule!r}; choose one of {', '.join(RULES)}")
        rules[name] = rule
    return rules


def pair_refusal(
    record: str, rule: str, direction: Literal["backward", "forward"],
    reader: tuple[str, dict[str, Any]], writer: tuple[str, dict[str, Any]],
) -> Refusal | None:
    """Checks that `reader` (label, schema JSON) reads what `writer` wrote; None when it does."""
    from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType
    from avro.schema import parse

    result = ReaderWriterCompatibilityChecker().get_compatibility(parse(json.dumps(reader[1])), parse(json.dumps(writer[1])))
    if result.compatibility is SchemaCompatibilityType.compatible:
        return None
    return Refusal(
        record, rule, direction, reader[0], writer[0], tuple(sorted(result.messages)),
        tuple(sorted(i.value for i in result.incompatibilities)),
    )


def check_history(record: str, rule: str, versions: list[tuple[str, dict[str, Any]]]) -> list[Refusal]:
    """Every refusal of `rule` over an ordered history of (label, schema JSON), oldest first."""
    if rule == "NONE":
        return []
    refusals = []
    for i in range(1, len(versions)):
        new = versions[i]
        olds = versions[:i] if rule.endswith("_TRANSITIVE") else versions[i - 1 : i]
        for old in olds:
            if rule.startswith(("BACKWARD", "FULL")) and (r := pair_refusal(record, rule, "backward", new, old)):
                refusals.append(r)
            if rule.startswith(("FORWARD", "FULL")) and (r := pair_refusal(record, rule, "forward", old, new)):
                refusals.append(r)
    return refusals


def check_catalog(catalog: SchemaCatalog | None = None, rules: dict[str, str] | None = None) -> list[str]:
    """Problems with the shipped schemas: a record without a rule, a rule without a record, refusals."""
    catalog = catalog or SchemaCatalog.load()
    rules = load_rules() if rules is None else rules
    problems = [f"{n}: no compatibility rule in schemas/{RULES_FILE}; declare one" for n in catalog.names() if n not in rules]
    problems += [f"{n}: has a rule in schemas/{RULES_FILE} but no schema" for n in rules if n not in catalog.names()]
    for name in catalog.names():
        if name in rules:
            history = [(f"v{v.version}", v.raw) for v in catalog.versions(name)]
            problems += [str(r) for r in check_history(name, rules[name], history)]
    return problems


def check_candidate(catalog: SchemaCatalog, schema: dict[str, Any], rule: str | None = None) -> list[Refusal]:
    """Refusals of a proposed next version of a record already in `catalog` (its declared rule by default)."""
    name = schema["name"] if "." in schema["name"] else f"{schema.get('namespace', '')}.{schema['name']}".lstrip(".")
    rule = rule or load_rules()[name]
    history = [(f"v{v.version}", v.raw) for v in catalog.versions(name)]
    return [r for r in check_history(name, rule, [*history, ("candidate", schema)]) if "candidate" in (r.reader, r.writer)]
