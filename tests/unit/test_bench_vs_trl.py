"""bench/vs_trl.py's TRL rollout runs AstraFlow's `tool_use` protocol: turns, tool replies, loss mask."""

from __future__ import annotations

# At collection, not inside a test: importing `_rl` imports lightning, which sets an environment
# variable, and the leak guard would blame the test.
import _rl
import pytest
from vs_trl import ToolRollout, repeat_summary, steady_per_s

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from astraflow.models.tiny import init_tiny, load_tiny

    return load_tiny(init_tiny(tmp_path_factory.mktemp("tiny"), vocab_size=512, hidden=32, layers=1, heads=2,
                               kv_heads=1, intermediate=64))[1]


def test_tool_rollout_runs_the_protocol_and_masks_tool_replies(tokenizer) -> None:
    from astraflow.raas.tools import ToolBox, calculator

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    script = [  # per turn, the continuation of each active row
        [enc("<calc>2+3</calc>"), enc("Answer: 7") + eos, enc("<calc>1+"), enc("<calc>4*4</calc>")],
        [enc("Answer: 5") + eos, enc("<calc>16+1</calc>")],
    ]
    seen: list[list[list[int]]] = []

    def generate(rows: list[list[int]]) -> list[list[int]]:
        seen.append(rows)
        return script[len(seen) - 1]

    rollout = ToolRollout(ToolBox({"calc": calculator}), max_tokens=24, max_turns=2, temperature=1.0)
    out = rollout.run(["Q: What is 2+3?\nA:"] * 4, tokenizer, generate)

    text = [tokenizer.decode(c, skip_special_tokens=True) for c in out["completion_ids"]]
    assert text == ["<calc>2+3</calc><result>5</result>Answer: 5", "Answer: 7", "<calc>1+",
                    "<calc>4*4</calc><result>16</result><calc>16+1</calc><result>17</result>"]
    assert len(seen) == 2 and len(seen[1]) == 2  # only the rows that called go on, and no third turn
    assert seen[1][0] == out["prompt_ids"][0] + enc("<calc>2+3</calc><result>5</result>")
    assert out["prompt_ids"][0][0] == tokenizer.bos_token_id
    reply = enc("<result>5</result>")
    assert out["env_mask"][0] == [1] * len(enc("<calc>2+3</calc>")) + [0] * len(reply) + [1] * (len(enc("Answer: 5")) + 1)
    assert all(m == [1] * len(c) for m, c in zip(out["env_mask"][1:3], out["completion_ids"][1:3], strict=True))
    assert [_rl.reward_of("b", t, '{"answer": "5"}') for t in text] == [1.0, 0.0, 0.0, 0.0]


def test_steady_samples_per_s_leave_out_the_time_to_the_first_snapshot() -> None:
    run = _rl.Run("pipeline", "a", 0.0)
    run.success = [(0, 0.0, 0.1), (2, 3.0, 0.1), (4, 4.0, 0.2), (6, 5.0, 0.2)]  # 4 steps in the last 2 s
    assert steady_per_s(run) == 4 * _rl.SLOTS / 2.0
    run.success = [(0, 0.0, 0.1), (2, 3.0, 0.1)]
    assert steady_per_s(run) is None


def test_repeats_are_summarised_per_workload_and_side_in_order() -> None:
    ratios = {f"{case} #{k} {side}": {"samples_per_s_astraflow_over_trl": x}
              for case, side, xs in (("a", "pipeline", [0.9, 1.5, 1.2, 1.0]), ("b (sigma 1.0)", "astraflow", [2.0, 3.0]))
              for k, x in enumerate(xs, 1)}
    got = repeat_summary(ratios)
    # mean 1.15, s.d. 0.2646 over 4 pairs: 95% t-interval (t = 3.182 at 3 d.f.) 1.15 ± 0.421
    assert got["a pipeline"] == {"every": [0.9, 1.5, 1.2, 1.0], "mean": pytest.approx(1.15), "median": pytest.approx(1.1),
                                 "ci95": [pytest.approx(0.7291, abs=1e-4), pytest.approx(1.5709, abs=1e-4)]}
    assert got["b (sigma 1.0) astraflow"]["every"] == [2.0, 3.0] and got["b (sigma 1.0) astraflow"]["median"] == 2.5
    assert repeat_summary({"a pipeline": {"samples_per_s_astraflow_over_trl": 1.3}})["a pipeline"]["every"] == [1.3]
