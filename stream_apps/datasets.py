"""Prompt datasets for the curator: JSONL or Parquet files, one prompt per row.

Row fields:
- `prompt` (required): the text the workflow starts from;
- `reference`: what the reward needs, a JSON object or a string holding one (anything else,
  e.g. "42", is taken as the answer: {"answer": "42"}); or `answer`: shorthand for
  {"answer": answer};
- `id` (optional): unique prompt id; default `<dataset>/<row index>`;
- `dataset` (optional): the dataset name, for mixing; default the file name without extension;
- `difficulty` (optional): a number, larger = harder (curriculum curators);
- `workflow` (optional): overrides the curator's `--workflow` for this row;
- `metadata` (optional): a flat object of strings, copied into the task.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.dataflow.curators import Prompt
from astraflow.errors import ConfigError


@dataclass(frozen=True)
class DatasetRow:
    """One prompt of a dataset, ready to become tasks."""

    prompt: Prompt  # what curators choose among (id, dataset, difficulty)
    text: str  # the prompt text
    reference: str | None  # JSON for the reward
    workflow: str | None = None  # per-row workflow override
    metadata: dict[str, str] = field(default_factory=dict)  # copied into Task.metadata


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Raw rows of a .jsonl / .json-lines or .parquet file."""
    if not path.is_file():
        raise ConfigError(f"dataset {path} not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".ndjson", ".json"):
        raise ConfigError(f"dataset {path} must be .jsonl (one JSON object per line) or .parquet")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{n}: each line must be a JSON object")
        rows.append(row)
    return rows


def reference_json(row: dict[str, Any]) -> str | None:
    """The row's reference as a JSON string (see the module doc)."""
    ref = row.get("reference")
    if ref is None and row.get("answer") is not None:
        return json.dumps({"answer": row["answer"]})
    if ref is None:
        return None
    if isinstance(ref, str):
        try:
            decoded = json.loads(ref)
        except json.JSONDecodeError:
            decoded = None
        return ref if isinstance(decoded, dict) else json.dumps({"answer": ref})
    return json.dumps(ref) if isinstance(ref, dict) else json.dumps({"answer": ref})


def load_dataset(path: str | Path) -> list[DatasetRow]:
    """Rows of one file as DatasetRows."""
    path = Path(path)
    out = []
    for i, row in enumerate(read_rows(path)):
        text = row.get("prompt")
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{path}: row {i} has no 'prompt' text")
        dataset = str(row.get("dataset") or path.stem)
        difficulty = row.get("difficulty")
        try:
            diff = None if difficulty is None else float(difficulty)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: row {i}: difficulty {difficulty!r} is not a number") from None
        meta = row.get("metadata") or {}
        out.append(
            DatasetRow(
                prompt=Prompt(str(row["id"]) if row.get("id") is not None else f"{dataset}/{i}", dataset, diff),
                text=text,
                reference=reference_json(row),
                workflow=row.get("workflow"),
                metadata={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {},
            )
        )
    return out


def load_datasets(paths: Iterable[str | Path]) -> list[DatasetRow]:
    """Rows of every file; prompt ids must be unique across them."""
    rows: list[DatasetRow] = []
    seen: dict[str, str] = {}
    for p in paths:
        for row in load_dataset(p):
            pid = row.prompt.prompt_id
            if pid in seen:
                raise ConfigError(f"prompt id {pid!r} appears twice ({seen[pid]} and {p}); ids must be unique")
            seen[pid] = str(p)
            rows.append(row)
    if not rows:
        raise ConfigError("the datasets hold no prompts; pass --dataset FILE.jsonl or FILE.parquet")
    return rows
