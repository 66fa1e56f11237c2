"""Evaluates a local model on calculator tool use, running the whole multi-turn protocol.

For each prompt: generate until ``</calc>`` or ``<eos>``; if the turn ends with a calculator
call, run it (`arith.calculate`, errors become the tool's text), append
``<result>VALUE</result>`` and generate again; finally parse ``Answer: N`` and compare it with
the reference. Token ids are kept as generated and tool output is appended as its own ids,
exactly as a RaaS rollout does. Prompts are decoded in left-padded batches with the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from astraflow.errors import CalculatorError, ModelError
from astraflow.models.arith import answers_match, calculate, extract_calc_call, parse_answer
from astraflow.models.protocol import CALC_CLOSE, tool_result
from astraflow.models.tiny import load_tiny


@dataclass(slots=True)
class EvalItem:
    """The outcome of one prompt."""

    prompt: str  # the formatted prompt
    reference: str  # the expected answer
    completion: str = ""  # everything after the prompt: model turns and tool results
    calls: list[str] = field(default_factory=list)  # calculator expressions, in order
    predicted: str | None = None  # the parsed final answer
    correct: bool = False  # predicted matches reference


@dataclass(slots=True)
class EvalReport:
    """Rates over all prompts, plus every item for inspection."""

    n: int  # prompts evaluated
    success_rate: float  # fraction answered correctly
    call_rate: float  # fraction that called the calculator at least once
    correct_call_rate: float  # fraction whose last call evaluates to the reference
    answer_rate: float  # fraction that produced a parsable ``Answer: N``
    items: list[EvalItem]


def generate_batch(
    model: PreTrainedModel,
    rows: list[list[int]],
    stop_ids: list[int],
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
) -> list[list[int]]:
    """Continues each row (left-padded batch); returns the new ids up to and including a stop id."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention[i, width - len(row) :] = 1
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            **sampling,
        )
    new: list[list[int]] = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
        new.append(row[:cut])
    return new


def _run_tool(expression: str | None) -> str:
    """The calculator's reply to one call, errors included, as the tool-result text."""
    if expression is None:
        return tool_result("error: malformed call")
    try:
        return tool_result(calculate(expression))
    except CalculatorError as exc:
        return tool_result(f"error: {exc}")


def run_tool_use(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    temperature: float = 0.0,
    max_turn_tokens: int = 32,
    max_calls: int = 2,
) -> list[tuple[str, list[str]]]:
    """Runs the protocol for a batch of prompts; returns (completion text, calc calls) per prompt."""
    calc_close = tokenizer.convert_tokens_to_ids(CALC_CLOSE)
    stop_ids = [tokenizer.eos_token_id, calc_close]
    rows = [list(tokenizer(p)["input_ids"]) for p in prompts]
    starts = [len(r) for r in rows]
    calls: list[list[str]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _turn in range(max_calls + 1):
        if not active:
            break
        new = generate_batch(
            model, [rows[i] for i in active], stop_ids, tokenizer.pad_token_id, max_turn_tokens, temperature
        )
        still: list[int] = []
        for i, ids in zip(active, new, strict=True):
            rows[i] += ids
            if ids and ids[-1] == calc_close and len(calls[i]) < max_calls:
                expression = extract_calc_call(tokenizer.decode(ids))
                calls[i].append(expression or "")
                rows[i] += tokenizer(_run_tool(expression), add_special_tokens=False)["input_ids"]
                still.append(i)
        active = still
    return [
        (tokenizer.decode(rows[i][starts[i] :], skip_special_tokens=True), calls[i])
        for i in range(len(prompts))
    ]


def evaluate_tool_use(
    model_dir: str | Path,
    prompts: Sequence[tuple[str, str]],
    *,
    temperature: float = 0.0,
    batch_size: int = 64,
    max_turn_tokens: int = 32,
    max_calls: int = 2,
    seed: int = 0,
) -> EvalReport:
    """Scores (prompt, reference answer) pairs; greedy when `temperature` is 0, else sampled."""
    if not prompts:
        raise ModelError("evaluate_tool_use got no prompts")
    model, tokenizer = load_tiny(model_dir)
    items: list[EvalItem] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lo in range(0, len(prompts), batch_size):
            chunk = prompts[lo : lo + batch_size]
            outputs = run_tool_use(
                model,
                tokenizer,
                [p for p, _ in chunk],
                temperature=temperature,
                max_turn_tokens=max_turn_tokens,
                max_calls=max_calls,
            )
            for (prompt, reference), (completion, calls) in zip(chunk, outputs, strict=True):
                predicted = parse_answer(completion)
                items.append(
                    EvalItem(
                        prompt, reference, completion, calls, predicted, answers_match(predicted, reference)
                    )
                )
    return _report(items)


def _correct_call(item: EvalItem) -> bool:
    """Whether the item's last calculator call evaluates to its reference."""
    if not item.calls:
        return False
    try:
        return answers_match(calculate(item.calls[-1]), item.reference)
    except CalculatorError:
        return False


def _report(items: list[EvalItem]) -> EvalReport:
    """Aggregates items into rates."""
    n = len(items)
    return EvalReport(
        n=n,
        success_rate=sum(i.correct for i in items) / n,
        call_rate=sum(bool(i.calls) for i in items) / n,
        correct_call_rate=sum(_correct_call(i) for i in items) / n,
        answer_rate=sum(i.predicted is not None for i in items) / n,
        items=items,
    )
