"""Prompt datasets in the formats users have: what the curator and the demo's evaluator read.

    spec = DatasetSpec("data/gsm8k", split="test", preset="gsm8k")
    loaded = load_prompts([spec])            # LoadedPrompts: rows, and the bad rows of each source
    loaded.rows[0].reference                 # '{"answer": "72", "solution": "..."}'

Sources are opened through Hugging Face `datasets` (`sources.py`: files, `save_to_disk`
directories, hub names); columns are mapped onto task fields, by hand or by a preset
(`columns.py`). Bad rows are skipped, counted by reason and reported (`LoadedPrompts.report`);
a source whose rows are all bad, a wrong mapping, a missing path or split fail at start.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.data.columns import (
    PRESETS,
    BadRows,
    ColumnMapping,
    PromptRow,
    check_columns,
    convert_rows,
    gsm8k_answer,
    last_boxed,
    preset,
    reference_json,
)
from astraflow.data.sources import OpenedDataset, open_dataset
from astraflow.errors import ConfigError

log = logging.getLogger("astraflow.data")


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """One dataset to read: where, which split, how its columns map onto task fields."""

    path: str | Path  # file, directory or hub name (see `sources`)
    split: str | None = None  # default: train (or the only split)
    preset: str | None = None  # gsm8k | math | mbpp
    columns: str | None = None  # FIELD=COLUMN,... (overrides the preset's)
    name: str | None = None  # dataset name of its rows (default: the file stem / directory / hub name)


@dataclass
class LoadedPrompts:
    """The prompts of several sources, and the bad rows of each."""

    rows: list[PromptRow] = field(default_factory=list)
    bad: dict[str, BadRows] = field(default_factory=dict)  # source -> its bad rows (only sources that have some)

    def report(self) -> list[str]:
        """One line per source with bad rows: `SOURCE: 3 bad rows: 2 empty prompt (rows 4, 9); ...`."""
        return [f"{where}: {b.summary()}" for where, b in self.bad.items() if b.total]


def load_source(spec: DatasetSpec) -> tuple[OpenedDataset, list[PromptRow], BadRows]:
    """The prompt rows of one source; ConfigError when none of its rows is usable."""
    chosen = preset(spec.preset) if spec.preset else None
    opened = open_dataset(spec.path, spec.split)
    mapping = ColumnMapping.parse(spec.columns)
    fields = check_columns(opened.where, opened.columns, mapping, chosen)
    rows, bad = convert_rows(opened.rows, fields, spec.name or opened.name, chosen)
    if not rows:
        raise ConfigError(f"dataset {opened.where}: no usable row ({bad.summary() or 'it is empty'}); "
                          f"its columns are {', '.join(opened.columns) or 'none'}")
    return opened, rows, bad


def load_prompts(specs: Sequence[DatasetSpec]) -> LoadedPrompts:
    """Rows of every source; prompt ids must be unique across them. Bad rows are logged."""
    out = LoadedPrompts()
    seen: dict[str, str] = {}
    for spec in specs:
        opened, rows, bad = load_source(spec)
        for row in rows:
            if row.prompt_id in seen:
                raise ConfigError(f"prompt id {row.prompt_id!r} appears twice ({seen[row.prompt_id]} and "
                                  f"{opened.where}); ids must be unique (map an id column, or give each dataset a name)")
            seen[row.prompt_id] = opened.where
        out.rows.extend(rows)
        if bad.total:
            out.bad[opened.where] = bad
    for line in out.report():
        log.warning("skipped %s", line)
    if not out.rows:
        raise ConfigError("the datasets hold no prompts; pass --dataset FILE.jsonl, FILE.parquet or a directory")
    return out


__all__ = ["PRESETS", "BadRows", "ColumnMapping", "DatasetSpec", "LoadedPrompts", "PromptRow", "gsm8k_answer",
           "last_boxed", "load_prompts", "load_source", "open_dataset", "reference_json"]
