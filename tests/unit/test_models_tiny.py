"""Tiny model: offline tokenizer and model, SFT on demonstrations, the tool-use evaluator."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from astraflow.errors import ModelError
from astraflow.models import (
    arithmetic_dataset,
    as_eval_items,
    encode_example,
    evaluate_tool_use,
    format_prompt,
    init_tiny,
    load_tiny,
    run_tool_use,
    split_heldout,
    warm_start,
)
from astraflow.models.arith import parse_answer
from astraflow.models.corpus import synthetic_corpus
from astraflow.models.sft import sft

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("tiny") / "model", corpus=synthetic_corpus(1500))


def test_tokenizer_round_trip_and_special_ids(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    for text in [
        "Q: What is 37*12+5?\nA:",
        "<calc>3+4</calc><result>7</result>Answer: 7",
        "Hello, world!  x\n\n",
    ]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    ids = tok("hi")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    for tag in ["<calc>", "</calc>", "<result>", "</result>", "<eos>"]:
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1


def test_digits_are_one_per_token(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    text = "12345 + 67890 = 80235, Answer: 449"
    tokens = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    digits = [t for t in tokens if any(c.isdigit() for c in t)]
    assert all(len(t) == 1 for t in digits)
    assert "".join(digits) == "".join(c for c in text if c.isdigit())


def test_auto_classes_load_offline_and_match_trained_tokenizer(tiny_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    plain = PreTrainedTokenizerFast.from_pretrained(tiny_dir, local_files_only=True)
    assert len(auto) == len(plain)
    for line in synthetic_corpus(100, seed=7):
        assert auto(line)["input_ids"] == plain(line)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(auto)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_model_generates_with_kv_cache(tiny_dir: Path) -> None:
    model, tok = load_tiny(tiny_dir)
    prompt = torch.tensor([tok(format_prompt("What is 2+3?"))["input_ids"]])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out.shape == (1, prompt.shape[1] + 16)
    assert time.perf_counter() - start < 20  # generous: CPUs are shared; the point is it runs


def test_load_tiny_missing_dir_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="init_tiny"):
        load_tiny(tmp_path / "nothing")


def test_encode_example_masks_prompt_and_tool_output(tiny_dir: Path) -> None:
    _, tok = load_tiny(tiny_dir)
    prompt = format_prompt("What is 2+3?")
    ids, mask = encode_example(tok, prompt, "<calc>2+3</calc><result>5</result>Answer: 5")
    prompt_ids = tok(prompt)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    tokens = tok.convert_ids_to_tokens(ids)
    trained = [t for t, m in zip(tokens, mask, strict=True) if m]
    assert trained[0] == "<calc>" and trained[-1] == "<eos>"
    assert "<result>" not in trained and "</result>" not in trained and "</calc>" in trained
    assert tok.decode(ids, skip_special_tokens=True) == prompt + "<calc>2+3</calc><result>5</result>Answer: 5"


def test_sft_lowers_loss_and_changes_weights(tiny_dir: Path, tmp_path: Path) -> None:
    examples = [p.example() for p in arithmetic_dataset(8, seed=5, difficulty=1)]
    before = {k: v.clone() for k, v in load_tiny(tiny_dir)[0].state_dict().items()}
    seen: list[int] = []
    metrics = sft(
        tiny_dir,
        examples,
        steps=8,
        lr=3e-3,
        batch_size=4,
        out_dir=tmp_path / "sft",
        seed=0,
        warmup=2,
        on_step=lambda step, loss: seen.append(step),
    )
    assert seen == list(range(8)) and metrics.steps == 8 and metrics.examples == 8
    assert metrics.final_loss < 0.8 * metrics.first_loss
    after = load_tiny(tmp_path / "sft")[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sft_rejects_bad_arguments(tiny_dir: Path) -> None:
    with pytest.raises(ModelError):
        sft(tiny_dir, [], steps=1, out_dir=tiny_dir.parent / "x")
    with pytest.raises(ModelError):
        sft(tiny_dir, [("a", "b")], steps=0)


class ScriptedPolicy:
    """Stands in for a model's `generate`: calls the calculator, then copies the tool's result."""

    def __init__(self, tok: PreTrainedTokenizerFast, expression: str) -> None:
        self.tok, self.expression = tok, expression

    def generate(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        rows = []
        for row in input_ids.tolist():
            text = self.tok.decode(row, skip_special_tokens=True)
            if text.endswith("</result>"):
                value = text.rsplit("<result>", 1)[1].removesuffix("</result>")
                reply = f"Answer: {value}<eos>"
            else:
                reply = f"<calc>{self.expression}</calc>"
            rows.append(row + self.tok(reply, add_special_tokens=False)["input_ids"] + [0, 0])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def test_protocol_runs_the_calculator_and_feeds_its_result(tiny_dir: Path) -> None:
    _, tok = load_tiny(tiny_dir)
    prompts = [format_prompt("What is 37*12+5?"), format_prompt("Compute 2+2.")]
    (completion, calls), _ = run_tool_use(ScriptedPolicy(tok, "37*12+5"), tok, prompts)  # type: ignore[arg-type]
    assert calls == ["37*12+5"]
    assert completion == "<calc>37*12+5</calc><result>449</result>Answer: 449"
    (bad, _), _ = run_tool_use(ScriptedPolicy(tok, "2**8"), tok, prompts)  # type: ignore[arg-type]
    assert bad.startswith("<calc>2**8</calc><result>error: ") and parse_answer(bad) is None


def test_evaluate_tool_use_on_untrained_model(tiny_dir: Path) -> None:
    _, heldout = split_heldout(arithmetic_dataset(40, seed=0, difficulty=1))
    items = as_eval_items(heldout[:4])
    report = evaluate_tool_use(tiny_dir, items, temperature=1.0, max_turn_tokens=8, max_calls=1)
    assert report.n == 4 and len(report.items) == 4
    assert 0.0 <= report.success_rate <= report.answer_rate <= 1.0
    with pytest.raises(ModelError):
        evaluate_tool_use(tiny_dir, [])


@pytest.mark.slow
def test_warm_start_makes_the_model_sometimes_succeed(tmp_path: Path) -> None:
    model_dir = init_tiny(tmp_path / "model")
    metrics = warm_start(model_dir)
    assert metrics.final_loss < 0.5
    _, heldout = split_heldout(arithmetic_dataset(600, seed=1234, difficulty=2))
    report = evaluate_tool_use(model_dir, as_eval_items(heldout[:100]))
    assert report.call_rate > 0.9
    assert report.success_rate > 0.03
