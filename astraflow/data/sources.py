"""Opening a dataset through Hugging Face `datasets`: files, `save_to_disk` directories, hub names.

| source | how it is read |
|---|---|
| `FILE.jsonl` / `.json` / `.ndjson` | `load_dataset("json")`; when Arrow cannot type the rows (rows of different shapes, a line that is not JSON) it is read line by line and each undecodable line is a bad row |
| `FILE.parquet` / `.arrow` / `.csv` | `load_dataset("parquet" | "arrow" | "csv")` |
| a `save_to_disk` directory | `load_from_disk`; a `DatasetDict` needs a split (default `train`) |
| another directory | `load_dataset(DIR)`: files named by split (`train.jsonl`, `data/test-00000-of-00001.parquet`, ...) |
| `NAME` or `NAME:CONFIG` that is no local path | `load_dataset(NAME, CONFIG, split=...)` from the hub, when one is reachable |

A path that does not exist, a split that does not exist, or a hub that cannot be reached fails with
a `ConfigError` saying what exists and what to pass instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.errors import ConfigError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".arrow": "arrow",
                 ".csv": "csv"}
DEFAULT_SPLIT = "train"


class BadLine(str):
    """A line of a JSON-lines file that is not a JSON object: a bad row whose reason is its text."""


@dataclass(frozen=True, slots=True)
class OpenedDataset:
    """The rows of one split of one source."""

    where: str  # the source as the user wrote it, with the split
    name: str  # the default dataset name of its rows (file stem, directory or hub name)
    columns: list[str]  # column names
    rows: Iterable[Mapping[str, Any] | BadLine]  # the rows, in order


def open_dataset(path: str | Path, split: str | None = None) -> OpenedDataset:
    """One split of a dataset (see the module doc)."""
    import datasets

    datasets.disable_progress_bars()  # a curator's log is no place for "Generating train split" bars
    text = str(path)
    p = Path(text).expanduser()
    if p.is_file():
        return _open_file(p, split)
    if p.is_dir():
        return _open_dir(p, split)
    if _hub_like(text):
        return _open_hub(text, split)
    parent = p.parent if p.parent.is_dir() else None
    near = sorted(x.name for x in parent.iterdir())[:20] if parent is not None else []
    raise ConfigError(f"dataset {text} not found" + (f"; {parent} holds: {', '.join(near) or 'nothing'}" if parent else
                                                     "; pass a .jsonl / .parquet / .arrow / .csv file, a directory "
                                                     "written by save_to_disk, or a hub name"))


def _hub_like(text: str) -> bool:
    name = text.split(":", 1)[0]
    return (not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and Path(name).suffix not in FILE_BUILDERS
            and all(part and (part.replace("-", "").replace("_", "").replace(".", "").isalnum()) for part in name.split("/")))


def _open_file(p: Path, split: str | None) -> OpenedDataset:
    builder = FILE_BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise ConfigError(f"dataset {p}: unknown file type {p.suffix!r}; use one of {', '.join(FILE_BUILDERS)}, "
                          "or a directory written by save_to_disk")
    if split not in (None, DEFAULT_SPLIT):
        raise ConfigError(f"dataset {p} is one file, which holds one split ({DEFAULT_SPLIT}); to read split "
                          f"{split!r} pass that split's file, or a directory holding one file per split")
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files={DEFAULT_SPLIT: str(p)}, split=DEFAULT_SPLIT, keep_in_memory=True)
    except Exception as exc:  # Arrow could not type the rows (any library error): JSON lines are read line by line
        if builder != "json":
            raise ConfigError(f"dataset {p}: cannot be read as {builder}: {type(exc).__name__}: {str(exc)[:300]}") from exc
        return _json_lines(p)
    return OpenedDataset(str(p), p.stem, list(ds.column_names), ds)


def _json_lines(p: Path) -> OpenedDataset:
    rows: list[Mapping[str, Any] | BadLine] = []
    columns: dict[str, None] = {}
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            rows.append(BadLine("line is not valid JSON"))
            continue
        if not isinstance(row, dict):
            rows.append(BadLine("line is not a JSON object"))
            continue
        columns.update(dict.fromkeys(row))
        rows.append(row)
    return OpenedDataset(str(p), p.stem, list(columns), rows)


def _open_dir(p: Path, split: str | None) -> OpenedDataset:
    import datasets

    try:
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            loaded = datasets.load_from_disk(str(p), keep_in_memory=True)
        else:
            loaded = datasets.load_dataset(str(p), keep_in_memory=True)
    except Exception as exc:  # the library's errors are many: name the directory and what it holds
        held = ", ".join(sorted(x.name for x in p.iterdir())[:20]) or "nothing"
        raise ConfigError(f"dataset directory {p} cannot be read ({type(exc).__name__}: {str(exc)[:300]}); it holds: "
                          f"{held}; pass a directory written by save_to_disk or one with files named by split "
                          f"(train.jsonl, test.parquet, ...)") from exc
    return _pick_split(loaded, str(p), p.name, split)


def _pick_split(loaded: Any, where: str, name: str, split: str | None) -> OpenedDataset:
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if split not in (None, DEFAULT_SPLIT):
            raise ConfigError(f"dataset {where} holds one dataset without splits; drop --split {split} "
                              f"(or save a DatasetDict with a {split!r} split)")
        return OpenedDataset(where, name, list(loaded.column_names), loaded)
    splits = list(loaded)
    chosen = split or (DEFAULT_SPLIT if DEFAULT_SPLIT in splits or len(splits) != 1 else splits[0])
    if chosen not in splits:
        raise ConfigError(f"dataset {where} has no split {chosen!r}; its splits are {', '.join(splits) or 'none'} "
                          f"(choose one with --split)")
    ds = loaded[chosen]
    return OpenedDataset(f"{where} [{chosen}]", name, list(ds.column_names), ds)


def _open_hub(text: str, split: str | None) -> OpenedDataset:
    import datasets

    name, _, config = text.partition(":")
    try:
        loaded = datasets.load_dataset(name, config or None)
    except Exception as exc:  # offline, unknown name, gated: all end here, with the library's reason
        raise ConfigError(f"dataset {text} is no local path, and loading it from the hub failed "
                          f"({type(exc).__name__}: {str(exc)[:300]}); download it where a hub is reachable "
                          f"(datasets.load_dataset({name!r}).save_to_disk(DIR)) and pass DIR") from exc
    return _pick_split(loaded, text, name.rsplit("/", 1)[-1], split)
