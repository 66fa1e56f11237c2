"""The `math_verify` reward on a table of known pairs (equal, not equal, unparsable, tricky ones),
its format component, unverifiable references (reward 0 with the reason noted), and its deadline:
a pathological expression is cut off in the worker process, from a thread and from an event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from astraflow.dataflow.math_answers import final_answer, latex_candidate, reference_answer
from astraflow.dataflow.math_reward import MathVerify
from astraflow.dataflow.registry import get
from astraflow.dataflow.rewards import with_reward
from astraflow.records import NodeInfo, Timings, Trajectory


def traj(answer: str | None, reference: object) -> Trajectory:
    ref = reference if isinstance(reference, str) or reference is None else json.dumps(reference)
    return Trajectory(trajectory_id="t-0", task_id="t", group_id="t", prompt_id="p", dataset="d", workflow="rlvr",
                      sample_index=0, group_size=1, segments=[], timings=Timings(0, 0, 0, 0.0, 0.0),
                      node=NodeInfo("n", "cpu", "local", "torch"), final_answer=answer, reference=ref)


@pytest.fixture(scope="module")
def reward() -> Iterator[MathVerify]:
    r = MathVerify(format_weight=0.0, timeout_s=3.0, workers=1)
    yield r
    r.verifier.close()


# (completion's final answer, reference answer, equal?)
PAIRS = [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("The answer is \\boxed{1,234}.", "1234", True),  # thousands separator in the answer
    ("#### 1234", "1,234", True),  # ...and in the reference
    ("She sold 72 clips in total, so the answer is 72 clips.", "72", True),  # a unit after the number
    ("\\boxed{18 \\text{ km/h}}", "18", True),
    ("\\boxed{5 dollars}", "5", True),
    ("\\boxed{x(x+2)}", "x^2+2x", True),  # symbolic equivalence
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{10\\%}", "0.1", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\boxed{3}", "x=3", True),
    ("\\boxed{2x}", "x^2+2x", False),  # '2x' is an expression, not '2' with a unit
    ("\\boxed{73}", "72", False),
    ("\\boxed{0.51}", "\\frac{1}{2}", False),
    ("12,345", "12345", True),
    ("\\boxed{\\pi}", "3.14159", False),
]


@pytest.mark.parametrize(("answer", "reference", "equal"), PAIRS)
def test_math_verify_known_pairs(reward: MathVerify, answer: str, reference: str, equal: bool) -> None:
    result = reward(traj(answer, {"answer": reference}))
    assert result.components["correct"] == float(equal), (answer, reference, result)
    assert result.reward == float(equal) and result.components["reference_ok"] == 1.0


def test_math_verify_gsm8k_and_math_references_and_several_answers(reward: MathVerify) -> None:
    gsm = {"answer": "72", "solution": "48/2 = 24\n48+24 = 72\n#### 72"}
    assert reward(traj("Natalia sold 48+24 = 72 clips.\n#### 72", gsm)).reward == 1.0
    assert reward(traj("x", {"answer": "48+24 = 72\n#### 72"})).components["correct"] == 0.0  # no answer: 'x'
    assert reward(traj("#### 72", {"answer": "48/2 = 24 clips\n#### 72"})).reward == 1.0  # the raw solution
    assert reward(traj("\\boxed{\\frac{3}{4}}", {"answer": "so $\\boxed{\\frac34}$"})).reward == 1.0
    assert reward(traj("\\boxed{-1}", {"answers": ["1", "-1"]})).reward == 1.0


def test_math_verify_format_component_strict_and_lenient(reward: MathVerify) -> None:
    strict = MathVerify(format_weight=0.25, format="strict", timeout_s=3.0, workers=1)
    lenient = MathVerify(format_weight=0.25, format="lenient", timeout_s=3.0, workers=1)
    object.__setattr__(strict, "verifier", reward.verifier)  # one worker for the module
    object.__setattr__(lenient, "verifier", reward.verifier)
    ref = {"answer": "7"}
    assert strict(traj("\\boxed{7}", ref)).reward == 1.25
    assert strict(traj("The answer is 7", ref)).reward == 1.0  # right, but not boxed
    assert lenient(traj("The answer is 7", ref)).reward == 1.25
    assert strict(traj("\\boxed{8}", ref)).reward == 0.25  # wrong, in the asked format
    assert lenient(traj("no idea", ref)).reward == 0.0
    assert lenient(traj("no idea", ref)).notes == {"reason": "no final answer found in the completion"}


def test_math_verify_unverifiable_reference_scores_zero_with_the_reason_noted(reward: MathVerify) -> None:
    for reference, reason in [(None, "no reference"), ("not json {", "not a JSON object"),
                              ({"solution": "no answer key"}, "has no 'answer'"),
                              ({"answer": "long text\n" * 30}, "no answer found in the reference"),
                              ({"answer": "$ $"}, "math-verify cannot parse")]:
        result = reward(traj("\\boxed{7}", reference))
        assert result.reward == 0.0 and result.components["reference_ok"] == 0.0, reference
        assert result.notes["reason"].startswith("unverifiable reference") and reason in result.notes["reason"], result
        scored = with_reward(traj("\\boxed{7}", reference), result)
        assert scored.metadata["reward.reason"] == result.notes["reason"] and scored.reward == 0.0
    silent = reward(traj("no answer", {"answer": "$ $"}))  # no answer either: the reference is still judged
    assert silent.components["reference_ok"] == 0.0 and silent.notes["reason"].startswith("unverifiable reference")
    unparsable = reward(traj("The answer is $ $", {"answer": "7"}))
    assert unparsable.reward == 0.0 and unparsable.components["reference_ok"] == 1.0
    assert unparsable.notes["reason"].startswith("unparsable_answer")


def test_math_verify_deadline_in_threads_and_on_an_event_loop() -> None:
    reward = get("reward", "math_verify", timeout_s=0.5, workers=1).impl  # registered like the others
    slow = traj("\\boxed{9^{9^{9^{9}}}}", {"answer": "7"})  # sympy cannot settle this in time
    try:
        results: list = []
        worker = threading.Thread(target=lambda: results.append(reward(slow)))  # not the main thread
        worker.start()
        worker.join(timeout=60)
        assert results and results[0].reward == 0.0 and results[0].components["timeout"] == 1.0, results
        assert "timeout" in results[0].notes["reason"]

        async def both() -> list:
            return await asyncio.gather(reward.score_async(slow), reward.score_async(traj("\\boxed{7}", {"answer": "7"})))

        timed_out, fine = asyncio.run(both())
        assert timed_out.components["timeout"] == 1.0 and fine.reward == 1.0  # the pool lives on
        assert reward.verifier.timeouts >= 1
    finally:
        reward.verifier.close()


def test_math_answers_extraction() -> None:
    assert final_answer("so \\boxed{\\frac{1}{2}} and \\boxed{3}").text == "3"  # the last box
    assert final_answer("work\n#### 1,000").form == "hash"
    assert final_answer("The final answer is: 12.").text == "12"
    assert (final_answer("I have 3 apples and 4 pears") or None).text == "4"
    assert final_answer("no digits here") is None and final_answer(None) is None
    assert reference_answer("steps\n#### 18") == "18" and reference_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert latex_candidate("1,234") == "$1234$" and latex_candidate("5 dollars") == "$5$"
    assert latex_candidate("2x") == "$2x$" and latex_candidate("$\\frac12$") == "$\\frac12$"


def test_math_verify_in_the_reward_app_notes_the_reason_through_the_short_path() -> None:
    from stream_fakes import FakeWorker, incoming

    from astraflow.serde import AvroSerde
    from astraflow.testing import make_trajectory
    from stream_apps.reward import RewardApp
    from stream_apps.reward_codec import Unscored

    w = FakeWorker("reward")
    app = RewardApp()
    app.bind(w)
    w.control.set("reward", "reward", "math_verify", format_weight="0.5", timeout_s="3", workers="1")
    try:
        for i, (answer, reference) in enumerate([("\\boxed{4}", '{"answer": "#### 4"}'), ("4", '{"solution": "x"}')]):
            t = make_trajectory(64, task_id="g", sample_index=i, seed=i)
            t.final_answer, t.reference, t.metadata = answer, reference, {"k": "v"}
            inc = incoming(t, i)
            inc.record = app.decode(inc)
            assert isinstance(inc.record, Unscored)  # math_verify reads no token data
            pending = app.handle(inc)
            assert pending is not None  # scored off the event loop
            asyncio.run(pending)
            strategy = app.slot.get()
            full = with_reward(t, strategy(t), strategy.ref("reward", "reward"))
            assert w.encoded[-1] == AvroSerde().dumps(full)  # the short path's bytes are the full path's
        first, second = (AvroSerde().loads(b, Trajectory) for b in w.encoded[-2:])
        assert first.reward == 1.5 and "reward.reason" not in first.metadata and first.metadata["k"] == "v"
        assert second.reward == 0.0 and second.reward_components["reference_ok"] == 0.0
        assert second.metadata["reward.reason"].startswith("unverifiable reference: the reference has no 'answer'")
    finally:
        app.slot.get().impl.verifier.close()
