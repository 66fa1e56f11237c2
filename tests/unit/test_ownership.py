"""One owner per concept, checked on the source so that it cannot drift back (docs/architecture.md).

- The library `astraflow/` imports none of the packages built on it (`stream_apps`, `trainers`,
  `astraflow_cli`), at module level, inside a function or under `TYPE_CHECKING`.
- Topic names, consumer-group ids and their prefixes are made by `astraflow/kafka/topics.py`
  only: no f-string that starts with `af.{` anywhere else.
- librdkafka consumers are made by the Kafka layer (`astraflow/kafka/`: `reader`, `group_member`,
  `RecordConsumer` in `clients.py`): no `Consumer(` call anywhere else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CODE = ("astraflow", "astraflow_cli", "stream_apps", "trainers", "bench")
BUILT_ON_THE_LIBRARY = {"stream_apps", "trainers", "astraflow_cli"}
HAND_BUILT_NAME = re.compile(r"""f["']af\.\{""")
CONSUMER_CALL = re.compile(r"\bConsumer\(")


def _files(*packages: str) -> list[Path]:
    return sorted(f for pkg in packages for f in (ROOT / pkg).rglob("*.py"))


def _rel(f: Path) -> str:
    return f.relative_to(ROOT).as_posix()


def _imported_packages(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.add(arg.value.split(".")[0])
    return out


def test_the_library_imports_none_of_the_packages_built_on_it() -> None:
    wrong = {}
    for f in _files("astraflow"):
        found = _imported_packages(ast.parse(f.read_text(), str(f))) & BUILT_ON_THE_LIBRARY
        if found:
            wrong[_rel(f)] = sorted(found)
    assert not wrong, f"astraflow/ must not import {sorted(BUILT_ON_THE_LIBRARY)} (astraflow_cli/ wires them): {wrong}"


def test_topic_and_group_names_are_built_in_topics_py_only() -> None:
    owner = "astraflow/kafka/topics.py"
    wrong = [f"{_rel(f)}:{n}: {line.strip()}" for f in _files(*CODE) if _rel(f) != owner
             for n, line in enumerate(f.read_text().splitlines(), 1) if HAND_BUILT_NAME.search(line)]
    assert not wrong, "build names with astraflow.kafka.topics (Topics, reader_group):\n" + "\n".join(wrong)


def test_consumers_are_made_by_the_kafka_layer_only() -> None:
    wrong = [f"{_rel(f)}:{n}: {line.strip()}" for f in _files(*CODE) if not _rel(f).startswith("astraflow/kafka/")
             for n, line in enumerate(f.read_text().splitlines(), 1) if CONSUMER_CALL.search(line)]
    assert not wrong, "make consumers with astraflow.kafka.clients (reader, group_member, RecordConsumer):\n" + "\n".join(wrong)


def test_the_checks_above_see_what_they_look_for() -> None:
    """The patterns match the code they forbid (a check that matches nothing proves nothing)."""
    assert HAND_BUILT_NAME.search('prefix = f"af.{experiment}."') and HAND_BUILT_NAME.search("f'af.{e}.raas'")
    assert CONSUMER_CALL.search("c = Consumer({...})") and not CONSUMER_CALL.search("RecordConsumer(kafka)")
    tree = ast.parse("def f():\n    from stream_apps.engine import X\nif TYPE_CHECKING:\n    import trainers.data\n"
                     "importlib.import_module('astraflow_cli.main')\nfrom tokenizers import trainers\n")
    assert _imported_packages(tree) & BUILT_ON_THE_LIBRARY == BUILT_ON_THE_LIBRARY


def test_the_names_the_acls_grant_are_the_names_the_roles_use() -> None:
    from astraflow.kafka import acl
    from astraflow.kafka.topics import READER_GROUPS, Topics, reader_group

    assert {k: READER_GROUPS[k] for k in acl.READER_GROUPS} == acl.READER_GROUPS
    t = Topics("e")
    granted = {(g.resource, g.name) for g in acl.role_grants("e", ["p"])}
    for group in (t.raas_group, t.group("reward"), t.group("curate"), t.group("curator"), t.trainer_group("p"),
                  t.archive_group("")):
        assert ("GROUP", group) in granted, group
    assert t.changelog("curate", "groups") == "af.e.curate-groups-changelog"
    assert t.of_experiment(t.train("p")) and not t.of_experiment("af.e2.tasks")
    a, b = reader_group("control"), reader_group("control")
    assert a != b and a.startswith("af-reader-") and reader_group("curator_lag", "run1") == "af-curator-run1"
    assert reader_group("weights") == "astraflow-weights-reader"


def test_the_faust_layer_uses_the_engine_through_its_api_only() -> None:
    from stream_apps.engine import StreamEngine
    from stream_apps.engine_api import EngineApi

    faust_layer = [ROOT / "stream_apps" / f for f in ("faust_app.py", "transactions.py", "faust_worker.py")]
    wrong = [f"{_rel(f)}:{n}: {line.strip()}" for f in faust_layer
             for n, line in enumerate(f.read_text().splitlines(), 1) if re.search(r"\bengine\._[a-z]", line)]
    assert not wrong, "use stream_apps.engine_api.EngineApi, not the engine's own members:\n" + "\n".join(wrong)
    members = {m for m in vars(EngineApi) if not m.startswith("_")} | set(EngineApi.__annotations__)
    engine = StreamEngine.__new__(StreamEngine)  # methods on the class; attributes by their assignment
    source = (ROOT / "stream_apps" / "engine.py").read_text() + (ROOT / "stream_apps" / "lifecycle.py").read_text()
    missing = [m for m in sorted(members) if not hasattr(engine, m) and f"self.{m} =" not in source
               and f"self.{m}:" not in source]
    assert not missing, f"StreamEngine lacks {missing} of EngineApi"
