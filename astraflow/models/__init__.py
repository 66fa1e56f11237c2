"""Tiny local models for tests, demos and CPU rollouts: build, warm-start with SFT, evaluate.

Nothing here downloads anything: `init_tiny` trains a tokenizer and initialises a Qwen2 model
locally, `warm_start` fine-tunes it on synthetic calculator demonstrations, and
`evaluate_tool_use` runs the multi-turn calculator protocol of `protocol.py`. The calculator
and answer checking (`arith.py`) are pure and shared with the RaaS workflows.
"""

from astraflow.models.arith import answers_match, calculate, extract_calc_call, parse_answer, score_answer
from astraflow.models.evaluate import EvalItem, EvalReport, evaluate_tool_use, run_tool_use
from astraflow.models.protocol import format_prompt
from astraflow.models.sft import SftMetrics, encode_example, sft, warm_start
from astraflow.models.tasks import ArithProblem, arithmetic_dataset, as_eval_items, split_heldout
from astraflow.models.tiny import TinySpec, init_tiny, load_tiny, train_tokenizer

__all__ = [
    "ArithProblem",
    "EvalItem",
    "EvalReport",
    "SftMetrics",
    "TinySpec",
    "answers_match",
    "arithmetic_dataset",
    "as_eval_items",
    "calculate",
    "encode_example",
    "evaluate_tool_use",
    "extract_calc_call",
    "format_prompt",
    "init_tiny",
    "load_tiny",
    "parse_answer",
    "run_tool_use",
    "score_answer",
    "sft",
    "split_heldout",
    "train_tokenizer",
    "warm_start",
]
