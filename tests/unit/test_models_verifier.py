"""The verifier's protocol, demonstrations and balanced held-out set (pure, no model)."""

from __future__ import annotations

import random

import pytest

from astraflow.models.arith import calculate
from astraflow.models.protocol import parse_verdict, verification_prompt
from astraflow.models.tasks import arithmetic_dataset
from astraflow.models.verifier import heldout_items, judgement, verifier_examples, wrong_answer


def test_wrong_answers_are_wrong_numbers() -> None:
    rng = random.Random(0)
    for answer in ["0", "7", "-31", "6600", "123456"]:
        for _ in range(200):
            w = wrong_answer(answer, rng)
            assert w != answer and int(w) != int(answer)


def test_the_calculator_check_is_zero_exactly_for_the_right_proposal() -> None:
    p = arithmetic_dataset(1, seed=3, difficulty=2)[0]
    prompt, right = judgement(p, p.answer, use_tool=True)
    assert prompt == verification_prompt(p.prompt, p.answer) and prompt.endswith(f"\nProposed: {p.answer}\nA:")
    assert right == f"<calc>{p.expression}-({p.answer})</calc><result>0</result>Answer: yes"
    wrong = wrong_answer(p.answer, random.Random(1))
    _, said = judgement(p, wrong, use_tool=True)
    assert said.endswith("Answer: no") and calculate(f"{p.expression}-({wrong})") != "0"
    assert judgement(p, wrong, use_tool=False)[1] == "Answer: no"


def test_heldout_judgements_are_fixed_and_balanced() -> None:
    problems = arithmetic_dataset(40, seed=1, difficulty=1)
    items = heldout_items(problems)
    assert items == heldout_items(problems)
    assert [v for _, v in items].count("yes") == [v for _, v in items].count("no") == 20
    demos = verifier_examples(problems, tool_fraction=0.5, seed=0)
    assert len(demos) == 40 and {c.rsplit(" ", 1)[-1] for _, c in demos} == {"yes", "no"}


@pytest.mark.parametrize(("text", "verdict"), [("Answer: yes", "yes"), ("<calc>1</calc>Answer: No.", "no"),
                                               ("Answer: yes\nAnswer: maybe", "unclear"), ("yes", "unclear"),
                                               ("", "unclear"), (None, "unclear"), ("Answer:", "unclear")])
def test_parse_verdict(text: str | None, verdict: str) -> None:
    assert parse_verdict(text) == verdict


def test_the_verification_prompt_keeps_one_short_line_of_proposal() -> None:
    assert verification_prompt("Q: What is 2+2?\nA:", "4") == "Q: What is 2+2?\nProposed: 4\nA:"
    long = verification_prompt("Q: x\nA:", "1\n2 " * 500)
    assert long.count("\n") == 2 and len(long.split("Proposed: ")[1]) <= 203


def test_the_pair_monitor_keeps_each_policys_figures() -> None:
    from astraflow.config import KafkaSettings
    from astraflow.demo.pair_report import PairMonitor
    from astraflow.kafka.signing import MetricSigner
    from astraflow.records import Metric
    from astraflow.serde import AvroSerde
    from astraflow.testing import make_trajectory

    serde, m = AvroSerde(), PairMonitor(KafkaSettings(), "x", "solver")
    t = make_trajectory(8)
    t.reward, t.reward_components = 1.0, {"policy.solver": 1.0, "policy.verifier": 0.0}
    m._handle("scored", serde.dumps(t))
    for name, value, labels in (("eval_success_greedy", 0.5, {"policy": "verifier", "version": "3"}),
                                ("eval_success", 0.75, {"policy": "verifier", "version": "3"}),
                                ("trainer.policy_version", 3, {"policy": "verifier"})):
        metric = Metric(name, float(value), "eval" if "eval" in name else "trainer", "i", labels)
        value = serde.dumps(metric)
        signed = MetricSigner().headers(m.topics.metrics, b"i", value, metric.component)  # as the roles sign them
        m._handle(m.topics.metrics, value, b"i", list(signed.items()))
    forged = serde.dumps(Metric("trainer.policy_version", 99.0, "trainer", "i", {"policy": "verifier"}))
    m._handle(m.topics.metrics, forged, b"i", [])  # unsigned: not believed
    assert len(m.rows) == 1 and [r for _, r in m.rewards_by["verifier"]] == [0.0]
    assert m.evals_by["verifier"][0]["success"] == 0.75 and m.evals_by["verifier"][0]["greedy"] == 0.5
    assert m.version_by == {"verifier": 3} and "verifier: v3" in m.line()
