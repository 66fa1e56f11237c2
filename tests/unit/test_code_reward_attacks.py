"""A solution cannot pass the code reward's tests by attacking the process that runs them.

Each attack below beats a harness that runs the tests in the solution's own interpreter (the
reward's design until the split); each must score 0 here, while honest solutions that use
classes, exceptions and generators across the process boundary still score 1. Every case runs
in the bwrap mode (where available) and in the operator-allowed weak mode: the split into two
processes holds in both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from astraflow.dataflow.code_reward import CodeTests
from astraflow.errors import SandboxUnavailableError
from astraflow.records import Trajectory
from astraflow.sandbox import SandboxSettings, current_settings, resolve_mode, unavailable_reason
from astraflow.sandbox.settings import configure
from astraflow.testing import make_trajectory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

BWRAP_MISSING = unavailable_reason(SandboxSettings())
WEAK_ENV = {  # the weak mode as root needs an interpreter that its own uid can read
    "ASTRAFLOW__SANDBOX__ALLOW_WEAK_ISOLATION": "true",
    "ASTRAFLOW__SANDBOX__BWRAP": "/nonexistent/bwrap",
    "ASTRAFLOW__SANDBOX__PYTHON": "/usr/bin/python3",
}


def _weak_missing() -> str | None:
    try:
        resolve_mode(current_settings(WEAK_ENV))
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


WEAK_MISSING = _weak_missing()
MODES = [
    pytest.param("bwrap", id="bwrap", marks=pytest.mark.skipif(BWRAP_MISSING is not None, reason=str(BWRAP_MISSING))),
    pytest.param("process", id="process", marks=pytest.mark.skipif(WEAK_MISSING is not None, reason=str(WEAK_MISSING))),
]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]

ATTACKS = {
    "eq_always_true": "class Yes:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Yes()\n",
    "int_subclass_eq": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n\n"
        "def add(a, b):\n    return Int(7)\n"
    ),
    "patch_builtins_module": (
        "import sys\nb = sys.modules['builtins']\nb.AssertionError = type('Quiet', (Exception,), {})\n"
        "b.len = lambda x: 3\nb.isinstance = lambda *a: True\n\ndef add(a, b):\n    return None\n"
    ),
    "patch_unittest": (
        "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "unittest.TestCase.assertTrue = lambda *a, **k: None\n\ndef add(a, b):\n    return None\n"
    ),
    "atexit_exit_zero": "import atexit, os\natexit.register(lambda: os._exit(0))\n\ndef add(a, b):\n    return a - b\n",
    "fake_report_on_stdout": (
        "import json, os, sys\nline = json.dumps({'passed': 3, 'total': 3, 'failures': []})\n"
        "print(line)\nos.write(1, (line + '\\n').encode())\nos.write(2, (line + '\\n').encode())\n"
        "sys.stdout.flush()\n\ndef add(a, b):\n    return None\n"
    ),
    "hard_exit_zero": "import os\nos._exit(0)\n",
    "exit_zero_inside_call": "import os\n\ndef add(a, b):\n    os._exit(0)\n",
    "system_exit_inside_call": "import sys\n\ndef add(a, b):\n    sys.exit(0)\n",
    "read_expected_from_frames_and_files": (
        "import gc, os, re, sys\n\n"
        "def add(a, b):\n"
        "    texts = [o for o in gc.get_objects() if isinstance(o, str) and 'assert add' in o]\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        texts += [str(v) for v in frame.f_locals.values() if 'assert add' in str(v)]\n"
        "        frame = frame.f_back\n"
        "    for root, _dirs, files in os.walk('/tmp'):\n"
        "        for name in files:\n"
        "            texts.append(open(os.path.join(root, name), errors='replace').read())\n"
        "    for text in texts:\n"
        "        m = re.search(r'assert add\\(%d, %d\\) == (-?\\d+)' % (a, b), text)\n"
        "        if m:\n"
        "            return int(m.group(1))\n"
        "    return None\n"
    ),
    "shadow_a_builtin_the_tests_use": "def sorted(x):\n    return list(x)\n\ndef sort_list(x):\n    return list(x)\n",
    # Kills every process it can see, but only where it sees a pid namespace of its own (at
    # most a few processes): outside one (the weak mode, as root) it would kill the machine's.
    "kill_every_process_in_its_namespace": (
        "import os, signal\npids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
        "if len(pids) <= 4:\n    for pid in pids:\n        if pid != os.getpid():\n"
        "            os.kill(pid, signal.SIGKILL)\n\ndef add(a, b):\n    return None\n"
    ),
    "forge_protocol_reply_at_load": (
        "import os, sys\nos.write(int(sys.argv[2]), b'{\"names\": {}}\\n')  # the server's reply pipe\n\n"
        "def add(a, b):\n    return None\n"
    ),
    # The solution's own copy of the name filter is no barrier: a key whose `startswith` lies
    # takes `__builtins__` across, and the tests' `sorted` would resolve through the solution.
    "dunder_builtins_through_a_lying_key": (
        "class S(str):\n    def startswith(self, *a):\n        return False\n    __hash__ = str.__hash__\n\n"
        "def sort_list(x):\n    return list(x)\n\ndef fake_sorted(x, **k):\n    return list(x)\n\n"
        "del globals()['__builtins__']\nglobals()[S('__builtins__')] = {'sorted': fake_sorted, 'len': len}\n"
    ),
    # `expected in result`: membership asked of the solution would show it the expected value.
    "contains_says_yes_to_anything": (
        "class Yes:\n    def __contains__(self, x):\n        return True\n\ndef add(a, b):\n    return Yes()\n"
    ),
}
SORT_TESTS = ["assert sort_list([3, 1, 2]) == sorted([3, 1, 2])"]
CONTAINS_TESTS = ["assert 3 in add(1, 2)", "assert 0 in add(-1, 1)", "assert 4 in add(2, 2)"]
TESTS_OF = {"shadow_a_builtin_the_tests_use": SORT_TESTS, "dunder_builtins_through_a_lying_key": SORT_TESTS,
            "contains_says_yes_to_anything": CONTAINS_TESTS}

HONEST = {
    "in_place_changes_to_arguments": (
        "def rotate(nums, k):\n    nums[:] = nums[-k:] + nums[:-k]\n\n"
        "def fill(d=None, seen=None):\n    d['x'] = 1\n    seen.add(2)\n",
        ["a = [1, 2, 3, 4]\nrotate(a, 1)\nassert a == [4, 1, 2, 3]",
         "d, s = {}, set()\nfill(d=d, seen=s)\nassert d == {'x': 1} and s == {2}"],
    ),
    "class_methods_len_iter": (
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n"
        "    def __iter__(self):\n        return iter(self.items)\n",
        ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert len(s) == 1 and list(s) == [1]",
         "s = Stack()\ns.push((1, 'a'))\nassert s.items == [(1, 'a')]"],
    ),
    "exceptions_generators_containers": (
        "import collections\n\nclass Bad(ValueError):\n    pass\n\ndef check(x):\n    if x < 0:\n        raise Bad('negative')\n    return x\n\n"
        "def gen(n):\n    yield from range(n)\n\ndef count(s):\n    return collections.Counter(s)\n\ndef echo(x):\n    return x\n",
        ["try:\n    check(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
         "assert list(gen(3)) == [0, 1, 2]",
         "assert count('aab') == {'a': 2, 'b': 1}",
         "assert check(float('inf')) == float('inf') and check(2 ** 80) == 2 ** 80 and check(7 ** 9000) == 7 ** 9000",
         "assert echo(b'x') == b'x' and echo({1: (2, {3})}) == {1: (2, {3})} and echo(1j) == 1j"],
    ),
    "membership_in_a_solution_container": (
        "class Bag:\n    def __init__(self, *xs):\n        self.xs = list(xs)\n    def __iter__(self):\n        return iter(self.xs)\n\n"
        "def add(a, b):\n    return Bag(a + b, a, b)\n",
        ["assert 3 in add(1, 2) and 7 not in add(1, 2)"],
    ),
}


def trajectory(code: str, tests: list[str]) -> Trajectory:
    return dataclasses.replace(make_trajectory(), final_answer=code, reference=json.dumps({"tests": tests}))


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    configure(None)  # settings from the environment below, whatever an earlier CLI test configured
    if request.param == "process":
        for key, value in WEAK_ENV.items():
            monkeypatch.setenv(key, value)
    return request.param


def score(code: str, tests: list[str]) -> dict[str, float]:
    reward = CodeTests(timeout_s=5, cpu_s=2, memory_mb=256, partial_credit=True)
    out = asyncio.run(reward.score_async(trajectory(code, tests)))
    return {"reward": out.reward, **out.components}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attacks_on_the_test_process_earn_nothing(attack: str, mode: str) -> None:
    tests = TESTS_OF.get(attack, ADD_TESTS)
    out = score(ATTACKS[attack], tests)
    assert out["reward"] == 0.0 and out["tests_passed"] == 0.0, out
    assert out["reported"] == 1.0  # the test process itself always reports


@pytest.mark.parametrize("case", list(HONEST))
def test_honest_solutions_work_across_the_process_boundary(case: str, mode: str) -> None:
    code, tests = HONEST[case]
    out = score(code, tests)
    assert out["reward"] == 1.0, out


def test_many_runs_at_once_without_blocking_the_loop(mode: str) -> None:
    async def scenario() -> tuple[list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        reward = CodeTests(timeout_s=10, cpu_s=2, memory_mb=256)
        honest = "def add(a, b):\n    return a + b\n"
        outs = await asyncio.gather(*(reward.score_async(trajectory(honest, ADD_TESTS)) for _ in range(6)))
        tick.cancel()
        return [o.reward for o in outs], ticks

    rewards, ticks = asyncio.run(scenario())
    assert rewards == [1.0] * 6
    assert ticks > 0  # the event loop kept running while the sandboxes worked


def test_wire_carries_plain_data_only() -> None:
    from astraflow.sandbox._remote import decode, encode

    held: list[object] = []

    def handle(obj: object) -> int:
        held.append(obj)
        return len(held) - 1

    class Yes(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    value = [Yes(5), (1.5, float("nan")), {"k": {b"b"}}, frozenset({2}), 3 ** 5000, object]
    back = decode(json.loads(json.dumps(encode(value, handle))), lambda n: ("handle", n))
    assert type(back[0]) is int and back[0] == 5 and back[0] != 6  # the subclass's __eq__ is gone
    assert back[1][0] == 1.5 and back[1][1] != back[1][1] and back[2] == {"k": {b"b"}}
    assert back[3] == frozenset({2}) and back[4] == 3**5000 and back[5] == ("handle", 0) and held == [object]
    for bad in ({"$q": 1}, {"$t": 1}, {"$f": "1e999"}, {"$h": "0"}, {"a": 1, "b": 2}):
        with pytest.raises(ValueError):
            decode(bad, lambda n: n)


def test_only_the_entry_points_the_tests_name_cross() -> None:
    from astraflow.dataflow.code_reward import entry_points_of
    from astraflow.sandbox._remote import entry_name

    assert entry_points_of(["import math\nx = helper(2)", "assert add(x, 1) == sorted([3])[0]", "def ("]) == \
        ["add", "helper", "x"]
    assert entry_name("add", {"add"}) and not entry_name("other", {"add"})
    for bad in ("__builtins__", "__class__", "sorted", "len", "None", "for", "a b", 3):
        assert not entry_name(bad), bad
