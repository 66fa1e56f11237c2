"""Tiny local models for tests, demos and CPU rollouts: build, warm-start with SFT, evaluate.

Nothing here downloads anything: `init_tiny` trains a tokenizer and initialises a Qwen2 model
locally, `warm_start` fine-tunes it on synthetic calculator demonstrations, and
`evaluate_tool_use` runs the multi-turn calculator protocol of `protocol.py`. The calculator
and answer checking (`arith.py`) are pure and shared with the RaaS workflows.

Exports load lazily (PEP 562): the calculator in `arith` is used by RaaS tools and must not
import torch and transformers. The `sft` function is not exported here: once its submodule is
imported, `astraflow.models.sft` names the module; import it from `astraflow.models.sft`.
"""

import importlib
from typing import Any

_WHERE = {
    "answers_match": "arith", "calculate": "arith", "extract_calc_call": "arith", "parse_answer": "arith",
    "score_answer": "arith",
    "EvalItem": "evaluate", "EvalReport": "evaluate", "evaluate_tool_use": "evaluate", "run_tool_use": "evaluate",
    "format_prompt": "protocol",
    "SftMetrics": "sft", "encode_example": "sft", "warm_start": "sft",
    "ArithProblem": "tasks", "arithmetic_dataset": "tasks", "as_eval_items": "tasks", "split_heldout": "tasks",
    "TinySpec": "tiny", "init_tiny": "tiny", "load_tiny": "tiny", "train_tokenizer": "tiny",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'astraflow.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"astraflow.models.{_WHERE[name]}"), name)
