"""Prompt datasets for the curator, read through `astraflow.data` (Hugging Face `datasets`).

Sources: JSONL / Parquet / Arrow / CSV files, `save_to_disk` directories, directories of files
named by split, hub names where a hub is reachable. Columns map onto task fields by hand
(`--columns prompt=question,reference=answer`) or by a preset (`--preset gsm8k|math|mbpp`);
without either, the project's own row format is read as it is (fields `prompt`, `reference` or
`answer`, `id`, `dataset`, `difficulty`, `workflow`, `metadata`; see `astraflow.data.columns`).
Bad rows are skipped, counted and logged; `docs/data.md` says more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.data import DatasetSpec, LoadedPrompts, load_prompts
from astraflow.dataflow.curators import Prompt


@dataclass(frozen=True)
class DatasetRow:
    """One prompt of a dataset, ready to become tasks."""

    prompt: Prompt  # what curators choose among (id, dataset, difficulty)
    text: str  # the prompt text
    reference: str | None  # JSON for the reward
    workflow: str | None = None  # per-row workflow override
    metadata: dict[str, str] = field(default_factory=dict)  # copied into Task.metadata


def as_specs(datasets: Iterable[str | Path | DatasetSpec], split: str | None = None, preset: str | None = None,
             columns: str | None = None) -> list[DatasetSpec]:
    """DatasetSpecs of paths (given the shared split / preset / columns); specs pass as they are."""
    return [d if isinstance(d, DatasetSpec) else DatasetSpec(d, split=split, preset=preset, columns=columns)
            for d in datasets]


def load_dataset_rows(specs: Sequence[DatasetSpec]) -> tuple[list[DatasetRow], LoadedPrompts]:
    """The curator's rows of every dataset, and what was loaded (its bad-row report)."""
    loaded = load_prompts(specs)
    rows = [DatasetRow(Prompt(r.prompt_id, r.dataset, r.difficulty), r.text, r.reference, r.workflow, r.metadata)
            for r in loaded.rows]
    return rows, loaded


def load_datasets(paths: Iterable[str | Path | DatasetSpec]) -> list[DatasetRow]:
    """Rows of every dataset in the project's own row format (or as their specs say)."""
    return load_dataset_rows(as_specs(paths))[0]
