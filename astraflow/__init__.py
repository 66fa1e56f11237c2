"""AstraFlow: reinforcement learning for LLM agents as a dataflow on Apache Kafka.

Importing the package is cheap: `astraflow.processor` (the decorator for custom stream
processors, see `astraflow/processor.py`) and `astraflow.Emit` load on first use, and nothing
here imports a Kafka client or a stream framework.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Emit", "processor"]


def __getattr__(name: str) -> Any:
    if name == "processor":
        # The submodule itself: it is callable, so `@astraflow.processor(...)` decorates whether
        # or not someone imported `astraflow.processor` (which rebinds this attribute) first.
        return importlib.import_module("astraflow.processor")
    if name == "Emit":
        return importlib.import_module("astraflow.processor").Emit
    raise AttributeError(f"module 'astraflow' has no attribute {name!r}")
