"""The environments without a broker: the SQL guard, the sandboxed shell, and their rewards
checked against known right and wrong answers."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from astraflow.dataflow.registry import REGISTRY
from astraflow.envs.database import DbSpecError, GuardedDb, SqlError, answer_values, parse_spec
from astraflow.envs.datasets import env_dataset
from astraflow.envs.shell import ShellState, run_check, run_command
from astraflow.errors import RewardError
from astraflow.records import NodeInfo, Timings, Trajectory, TrajectoryStatus

DB = {"tables": [{"name": "employees", "columns": [["id", "INTEGER"], ["name", "TEXT"], ["dept", "TEXT"], ["salary", "INTEGER"]],
                  "rows": [[1, "alice", "sales", 50000], [2, "bob", "sales", 70000], [3, "carol", "research", 90000]]}]}


def _traj(reference: dict, answer: str | None, workflow: str = "db_agent", metadata: dict | None = None,
          status: TrajectoryStatus = TrajectoryStatus.OK) -> Trajectory:
    return Trajectory("t/0", "t", "g", "p", "d", workflow, 0, 1, [], Timings(0, 0, 0), NodeInfo("n", "cpu", "l", "b"),
                      final_answer=answer, reference=json.dumps(reference), status=status, metadata=metadata or {})


def test_sql_guard_refuses_writing_outside_the_database(tmp_path: Path) -> None:
    db = GuardedDb(parse_spec(DB), timeout_s=1.0)
    target = tmp_path / "escape.db"
    for sql in [f"ATTACH DATABASE '{target}' AS x", f"VACUUM INTO '{target}'", "PRAGMA journal_mode=WAL",
                "SELECT load_extension('/tmp/x')", "DETACH DATABASE main"]:
        with pytest.raises(SqlError, match="not authorized|cannot|no such"):
            db.query(sql)
    assert not target.exists() and not os.path.exists(f"{target}-journal")
    with pytest.raises(SqlError, match="one statement"):
        db.query("SELECT 1; SELECT 2")
    with pytest.raises(SqlError, match="limit and was stopped"):
        db.query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c")
    with pytest.raises(SqlError, match="too big|string or blob"):
        db.query("SELECT length(zeroblob(100000000))")
    with pytest.raises(SqlError, match="no such table"):
        db.query("SELECT * FROM missing_table")
    # its own database stays usable, writes included
    db.query("INSERT INTO employees VALUES (4, 'dave', 'support', 40000)")
    assert db.query("SELECT COUNT(*) FROM employees") == [(4,)]
    assert db.run_text("PRAGMA table_info(employees)").startswith("0 | id | INTEGER")
    db.close()


def test_db_spec_is_checked() -> None:
    for bad in [{}, {"tables": []}, {"tables": [{"name": "x; DROP", "columns": [["a", "TEXT"]]}]},
                {"tables": [{"name": "t", "columns": [["a", "BLOB"]]}]},
                {"tables": [{"name": "t", "columns": [["a", "TEXT"]], "rows": [[1, 2]]}]},
                {"tables": [{"name": "t", "columns": [["a", "TEXT"]], "rows": [["x" * 1000]]}]}]:
        with pytest.raises(DbSpecError):
            parse_spec(bad)


def test_sql_result_reward_on_known_right_and_wrong_answers() -> None:
    reward = REGISTRY.get("reward", "sql_result")
    count = {"db": DB, "query": "SELECT COUNT(*) FROM employees WHERE dept = 'sales'"}
    names = {"db": DB, "query": "SELECT name FROM employees WHERE salary > 60000"}
    assert reward(_traj(count, "2")).reward == 1.0
    assert reward(_traj(count, "2.0")).reward == 1.0
    assert reward(_traj(count, "3")).reward == 0.0
    assert reward(_traj(count, None)).reward == 0.0
    assert reward(_traj(names, "Carol, bob")).reward == 1.0
    assert reward(_traj(names, "bob")).reward == 0.0
    assert answer_values("[3, 'x']") == ["3", "x"]
    with pytest.raises(RewardError, match="ground-truth query failed"):
        reward(_traj({"db": DB, "query": "ATTACH DATABASE '/tmp/x' AS y"}, "1"))
    with pytest.raises(RewardError, match="needs 'query'"):
        reward(_traj({"db": DB}, "1"))
    for row in env_dataset("db", 20, seed=3):  # every generated question has an answer
        ref = json.loads(row["reference"])
        db = GuardedDb(parse_spec(ref["db"]))
        (value,) = db.query(ref["query"])[0]
        assert reward(_traj(ref, str(value))).reward == 1.0
        db.close()


def test_shell_keeps_files_between_commands_and_has_no_network() -> None:
    async def run() -> tuple[str, str, ShellState, tuple[bool, str], tuple[bool, str]]:
        state = ShellState.from_reference({"files": {"logs/app.log": "ERROR a\nINFO b\nERROR c\n"}})
        out1, state = await run_command(state, "grep -c ERROR logs/app.log; echo hi > out.txt; mkdir -p d/e")
        net = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"; "
               "cat /etc/passwd; ls /root /work")
        out2, state = await run_command(state, net)
        right = await run_check(state, 'test "$ANSWER" = "$(grep -c ERROR logs/app.log)" && test -d d/e', "2")
        wrong = await run_check(state, 'test "$ANSWER" = "$(grep -c ERROR logs/app.log)"', "3")
        return out1, out2, state, right, wrong

    out1, out2, state, right, wrong = asyncio.run(run())
    assert out1.startswith("2\n") and "[exit code 0]" in out1
    assert state.files["out.txt"] == b"hi\n" and "d/e" in state.dirs
    assert "Address family not supported" in out2 or "Operation not permitted" in out2
    assert "root:x:0" not in out2 and "cannot access '/work'" in out2 and "[exit code" in out2
    assert right[0] is True and wrong[0] is False


def test_os_check_reward_reads_the_workflows_verdict_only() -> None:
    reward = REGISTRY.get("reward", "os_check")
    assert reward(_traj({}, "2", "os_agent", {"os_check": "pass"})).reward == 1.0
    assert reward(_traj({}, "3", "os_agent", {"os_check": "fail"})).reward == 0.0
    assert reward(_traj({}, "2", "os_agent", {"os_check": "pass"}, TrajectoryStatus.ERROR)).reward == 0.0
    with pytest.raises(RewardError, match="scores os_agent"):
        reward(_traj({}, "2", "rlvr", {"os_check": "pass"}))


def test_every_os_task_kind_is_solved_by_its_solution_and_failed_by_a_wrong_answer() -> None:
    kinds: dict[str, dict] = {}
    for row in env_dataset("os", 40, seed=0):
        kinds.setdefault(row["prompt"][:20], json.loads(row["reference"]))
    assert len(kinds) == 4

    async def verdicts(ref: dict) -> tuple[bool, bool, str]:
        start = ShellState.from_reference(ref)
        out, state = await run_command(start, ref["solution"]["command"])
        right = await run_check(state, ref["check"], ref["solution"]["answer"])
        wrong = await run_check(start, ref["check"], "-1")  # wrong answer, and nothing done
        return right[0], wrong[0], out

    async def run_all() -> list[tuple[bool, bool, str]]:
        return await asyncio.gather(*(verdicts(r) for r in kinds.values()))

    for (right, wrong, out), ref in zip(asyncio.run(run_all()), kinds.values(), strict=True):
        assert right and not wrong
        assert out == f"{ref['solution']['output']}\n[exit code 0]".strip()


def test_env_workflows_refuse_a_bad_reference_with_an_error_trajectory() -> None:
    from astraflow.raas.guard import run_workflow
    from astraflow.raas.tools import ToolBox
    from astraflow.raas.workflows import RolloutContext, resolve_workflow
    from astraflow.testing import make_task

    async def run(workflow: str, reference: str) -> Trajectory:
        task = make_task(1, n_samples=1)
        task.workflow, task.reference = workflow, reference
        ctx = RolloutContext(task, 0, {}, ToolBox({}), NodeInfo("n", "cpu", "l", "b"))
        return await run_workflow(resolve_workflow(workflow), ctx, 10.0)

    db = asyncio.run(run("db_agent", json.dumps({"db": {"tables": [{"name": "x;", "columns": []}]}})))
    assert db.status is TrajectoryStatus.ERROR and "DbSpecError" in (db.error or "")
    os_ = asyncio.run(run("os_agent", json.dumps({"files": {"../etc/x": "y"}, "check": "true"})))
    assert os_.status is TrajectoryStatus.ERROR and "inside home" in (os_.error or "")
    nocheck = asyncio.run(run("os_agent", "{}"))
    assert nocheck.status is TrajectoryStatus.ERROR and "needs 'check'" in (nocheck.error or "")


def test_scenario_demonstrations_are_in_the_endpoints_chat_format() -> None:
    from astraflow.demo.scenarios import demonstrations
    from astraflow.raas.agent_api.protocol import Message
    from astraflow.raas.agent_api.render import message_text, split_tool_call
    from astraflow.raas.workflows.envs import SYSTEM

    for scenario, tool in (("db", "sql"), ("os", "bash")):
        for (prompt, completion), row in zip(demonstrations(scenario, 6, 0.0, 0), env_dataset(scenario, 6, seed=1000),
                                             strict=True):
            assert prompt.startswith(message_text(Message("system", SYSTEM)))
            assert prompt.endswith(message_text(Message("user", prompt.split("\nQ: ", 1)[1][: -len("\nA:")])))
            call = completion[: completion.index("<result>")]
            assert split_tool_call(call, {tool: "x"})[1][0][0] == tool
            ref = json.loads(row["reference"])
            if scenario == "db":
                db = GuardedDb(parse_spec(ref["db"]))
                assert completion.endswith(f"Answer: {db.run_text(ref['query']).splitlines()[0]}")
                db.close()
            else:
                assert completion.endswith(f"Answer: {ref['solution']['answer']}")


def test_scenario_demonstrations_without_the_tool_answer_at_once_with_the_right_value() -> None:
    from astraflow.demo.scenarios import demonstrations

    for scenario, tag in (("db", "<sql>"), ("os", "<bash>")):
        assert all(c.startswith(tag) for _, c in demonstrations(scenario, 40, 0.0, 0, tool_fraction=1.0))
        direct = demonstrations(scenario, 40, 1.0, 0, tool_fraction=0.0)  # wrong_fraction applies to tool use only
        rows = env_dataset(scenario, 40, seed=1000)
        for (_, completion), row in zip(direct, rows, strict=True):
            ref = json.loads(row["reference"])
            if scenario == "db":
                db = GuardedDb(parse_spec(ref["db"]))
                right = db.run_text(ref["query"]).splitlines()[0]
                db.close()
            else:
                right = ref["solution"]["answer"]
            assert completion == f"Answer: {right}"
        mixed = demonstrations(scenario, 400, 0.0, 0, tool_fraction=0.5)
        assert 150 < sum(c.startswith(tag) for _, c in mixed) < 250


def test_mean_and_standard_error_of_heldout_rewards() -> None:
    from astraflow.demo.env_eval import mean_se

    assert mean_se([]) == (0.0, 0.0) and mean_se([1.0]) == (1.0, 0.0)
    mean, se = mean_se([0.0, 1.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx((1 / 3) ** 0.5 / 2)  # sample variance 1/3, n = 4


def test_policy_sequences_split_at_prompts_and_keep_policies_apart() -> None:
    from astraflow.dataflow.sequences import policy_sequences, sequence_sample_id
    from astraflow.records import Segment

    def seg(policy: str, role: str) -> Segment:
        return Segment.context(policy, role, [1, 2], role) if role != "assistant" else Segment(
            policy, role, [3], [-0.1], [1], [0], role)

    t = _traj({}, "x")
    t.segments = [seg("a", "prompt"), seg("a", "assistant"), seg("b", "prompt"), seg("b", "assistant"),
                  seg("a", "tool"), seg("a", "assistant"), seg("a", "prompt"), seg("a", "assistant")]
    a, b = policy_sequences(t, "a"), policy_sequences(t, "b")
    assert [[s.role for s in q] for q in a] == [["prompt", "assistant", "tool", "assistant"], ["prompt", "assistant"]]
    assert [[s.role for s in q] for q in b] == [["prompt", "assistant"]]
    ids = {sequence_sample_id(t.trajectory_id, p, i) for p, qs in (("a", a), ("b", b)) for i in range(len(qs))}
    assert ids == {"t/0#a", "t/0#a#1", "t/0#b"}


def test_scenario_heldout_rows_are_neither_training_nor_demonstration_rows() -> None:
    from astraflow.demo.env_eval import heldout_tasks

    for scenario, expected in (("db", 48), ("os", 48), ("code", 0)):  # code: 25 tasks in all, every one trained on
        held = heldout_tasks(scenario, 48, 0, 0.0, 96, 3, n_train=2000)
        seen = {r["reference"] for seed, n in ((0, 2000), (1000, 1000)) for r in env_dataset(scenario, n, seed=seed)}
        assert len(held) == expected and len({t.reference for t in held}) == expected
        assert all(t.workflow == f"{scenario}_agent" and t.sampling.temperature == 0.0 for t in held)
        assert not {t.reference for t in held} & seen
