"""Small generated datasets for the three environments (no downloads), as curator JSONL rows.

Each row is `{"id", "prompt", "reference", "dataset", "workflow"}`: the curator turns rows into
Tasks for the named workflow, and the reward reads the reference. Same seed, same rows. A
reference also holds a known solution (`query`, `solution`), which the workflows never show the
agent: the demo's warm start learns from it (`astraflow.demo.scenarios`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
         "peggy", "rupert", "sybil", "trent", "victor", "walter"]
DEPTS = ["sales", "research", "support", "finance"]
SUM_LINES = "s=0; while read n; do s=$((s + n)); done < nums.txt; echo $s"  # POSIX sh only (no awk in the sandbox)


def _row(i: int, prompt: str, reference: dict[str, Any], env: str, workflow: str) -> dict[str, Any]:
    return {"id": f"{env}-{i}", "prompt": prompt, "reference": json.dumps(reference), "dataset": env,
            "workflow": workflow}


# ---- database ---------------------------------------------------------------------------------------


def db_task(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(question, reference) over a fresh `employees` table."""
    n = rng.randint(5, 12)
    names = rng.sample(NAMES, n)
    ages = rng.sample(range(22, 65), n)  # distinct, so "the oldest" is one person
    rows = [[i + 1, names[i], rng.choice(DEPTS), rng.randrange(30, 120) * 1000, ages[i]] for i in range(n)]
    db = {"tables": [{"name": "employees", "columns": [["id", "INTEGER"], ["name", "TEXT"], ["dept", "TEXT"],
                                                        ["salary", "INTEGER"], ["age", "INTEGER"]], "rows": rows}]}
    dept = rng.choice(sorted({r[2] for r in rows}))
    age = rng.choice(ages)
    question, query = rng.choice([
        (f"How many employees work in the {dept} department?", f"SELECT COUNT(*) FROM employees WHERE dept = '{dept}'"),
        (f"What is the highest salary in the {dept} department?", f"SELECT MAX(salary) FROM employees WHERE dept = '{dept}'"),
        ("What is the name of the oldest employee?", "SELECT name FROM employees ORDER BY age DESC LIMIT 1"),
        (f"How many employees are older than {age}?", f"SELECT COUNT(*) FROM employees WHERE age > {age}"),
        (f"What is the total salary of the {dept} department?", f"SELECT SUM(salary) FROM employees WHERE dept = '{dept}'"),
    ])
    return question, {"db": db, "query": query}  # the query is also the demonstration's solution


# ---- operating system ---------------------------------------------------------------------------------


def os_task(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(instruction, reference with starting files and a check script)."""
    kind = rng.randrange(4)
    if kind == 0:
        lines = [rng.choice(["INFO ok", "ERROR disk", "WARN slow", "ERROR net"]) for _ in range(rng.randint(4, 12))]
        n = str(sum("ERROR" in line for line in lines))
        return ("How many lines of logs/app.log contain ERROR? Answer with the number.",
                {"files": {"logs/app.log": "\n".join(lines) + "\n"},
                 "check": 'test "$(echo $ANSWER)" = "$(grep -c ERROR logs/app.log)"',
                 "solution": {"command": "grep -c ERROR logs/app.log", "output": n, "answer": n}})
    if kind == 1:
        word = rng.choice(["hello", "kafka", "agent", "reward"])
        return (f"Create a file named out.txt that contains exactly the word {word}.",
                {"files": {}, "check": f'test "$(cat out.txt)" = "{word}"',
                 "solution": {"command": f"echo {word} > out.txt", "output": "", "answer": "done"}})
    if kind == 2:
        k = rng.randint(1, 6)
        files = {f"docs/note{i}.txt": f"note {i}\n" for i in range(k)}
        return ("How many files are in the directory docs? Answer with the number.",
                {"files": files, "check": 'test "$(echo $ANSWER)" = "$(ls docs | wc -l)"',
                 "solution": {"command": "ls docs | wc -l", "output": str(k), "answer": str(k)}})
    nums = [rng.randint(1, 50) for _ in range(rng.randint(3, 8))]
    return ("What is the sum of the numbers in nums.txt (one per line)? Answer with the number.",
            {"files": {"nums.txt": "\n".join(map(str, nums)) + "\n"},
             "check": f'test "$(echo $ANSWER)" = "$({SUM_LINES})"',
             "solution": {"command": SUM_LINES, "output": str(sum(nums)),
                          "answer": str(sum(nums))}})


# ---- programming ----------------------------------------------------------------------------------------


def code_task(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(specification, reference with hidden tests for the `code_tests` reward)."""
    k = rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        return (f"Write a Python function scale(xs) that returns the list xs with every number multiplied by {k}.",
                {"tests": [f"assert scale([1, 2, 3]) == [{k}, {2 * k}, {3 * k}]", "assert scale([]) == []",
                           f"assert scale([-1]) == [{-k}]"],
                 "solution": f"def scale(xs):\n    return [x * {k} for x in xs]\n"})
    if kind == 1:
        return (f"Write a Python function count_above(xs) that returns how many numbers in xs are greater than {k}.",
                {"tests": [f"assert count_above([{k}, {k + 1}, {k + 2}]) == 2", "assert count_above([]) == 0",
                           f"assert count_above([{k - 1}]) == 0"],
                 "solution": f"def count_above(xs):\n    return sum(1 for x in xs if x > {k})\n"})
    if kind == 2:
        return ("Write a Python function is_palindrome(s) that returns True when the string s reads the same "
                "backwards, else False.",
                {"tests": ["assert is_palindrome('abba') is True", "assert is_palindrome('abc') is False",
                           "assert is_palindrome('') is True"],
                 "solution": "def is_palindrome(s):\n    return s == s[::-1]\n"})
    return (f"Write a Python function add_k(n) that returns n + {k}.",
            {"tests": [f"assert add_k(0) == {k}", f"assert add_k(-{k}) == 0", f"assert add_k(10) == {10 + k}"],
             "solution": f"def add_k(n):\n    return n + {k}\n"})


ENVS: dict[str, tuple[Callable[[random.Random], tuple[str, dict[str, Any]]], str]] = {
    "db": (db_task, "db_agent"),
    "os": (os_task, "os_agent"),
    "code": (code_task, "code_agent"),
}


def env_dataset(env: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows of environment `env` (db | os | code)."""
    make, workflow = ENVS[env]
    rng = random.Random(f"{env}-{seed}")
    return [_row(i, *make(rng), env=env, workflow=workflow) for i in range(n)]


def write_dataset(env: str, n: int, path: str | Path, seed: int = 0) -> Path:
    """Writes `env_dataset(env, n, seed)` as JSONL; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in env_dataset(env, n, seed)))
    return path


__all__ = ["ENVS", "code_task", "db_task", "env_dataset", "os_task", "write_dataset"]
