"""Rows of any dataset schema -> prompt rows: column mappings, presets, and bad rows counted.

A dataset's columns are mapped onto the fields a task needs:

| field | what it holds |
|---|---|
| `prompt` (required) | the text the workflow starts from |
| `reference` | what the reward needs: a JSON object, a string holding one, or any other value, taken as the answer (`{"answer": value}`) |
| `answer` | shorthand for `{"answer": value}` when `reference` is not mapped |
| `id` | unique prompt id (default `<dataset>/<row index>`) |
| `dataset` | dataset name, for mixing (default: the source's name) |
| `difficulty` | a number, larger = harder (curriculum curators) |
| `workflow` | overrides the curator's workflow for this row |
| `metadata` | a flat object of strings, copied into the task |

`ColumnMapping.parse("prompt=question,reference=answer")` maps fields to source columns; fields
not mapped are read from a column of their own name when one exists (so the project's own rows,
`prompt` / `reference` / `id` ..., need no mapping). A preset (`gsm8k`, `math`, `mbpp`) is a
mapping plus a converter that turns the hub schema's answer into a reference every reward reads:
GSM8K's `... #### 72` becomes `{"answer": "72", "solution": "..."}`, MATH's `\\boxed{}` is taken
out of the solution, MBPP's `test_list` becomes the code reward's `{"tests": [...]}`.

A row that cannot become a prompt (an empty prompt, a null in a mapped column, a GSM8K answer
without `####`) is a bad row: `convert_rows` skips it and counts it by reason, with the first row
indices, so the caller reports it. A mapping that names a column the dataset lacks fails at start
(`check_columns`), listing the columns that exist.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import ConfigError

FIELDS = ("prompt", "reference", "answer", "id", "dataset", "difficulty", "workflow", "metadata")
BAD_EXAMPLES = 5  # row indices kept per reason


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One dataset row as the curator needs it."""

    prompt_id: str  # unique across the datasets loaded together
    dataset: str  # dataset name (mixing)
    text: str  # the prompt text
    reference: str | None  # JSON object for the reward
    difficulty: float | None = None  # larger = harder
    workflow: str | None = None  # per-row workflow override
    metadata: dict[str, str] = field(default_factory=dict)  # copied into Task.metadata


@dataclass
class BadRows:
    """Rows that could not become prompts, by reason."""

    counts: dict[str, int] = field(default_factory=dict)  # reason -> rows
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row indices

    def add(self, index: int, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        seen = self.examples.setdefault(reason, [])
        if len(seen) < BAD_EXAMPLES:
            seen.append(index)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """`3 rows: 2 empty prompt (rows 4, 9), 1 ...`, or '' when there are none."""
        parts = [f"{n} {reason} (row{'s' if len(self.examples[reason]) > 1 else ''} "
                 f"{', '.join(map(str, self.examples[reason]))}{', ...' if n > len(self.examples[reason]) else ''})"
                 for reason, n in sorted(self.counts.items(), key=lambda kv: -kv[1])]
        return f"{self.total} bad row{'s' if self.total != 1 else ''}: " + "; ".join(parts) if parts else ""


@dataclass(frozen=True, slots=True)
class ColumnMapping:
    """Field -> source column (see the module doc)."""

    columns: Mapping[str, str] = field(default_factory=dict)  # field -> column of the dataset

    @classmethod
    def parse(cls, text: str | None) -> ColumnMapping:
        """`prompt=question,reference=answer` (spaces allowed); '' or None: no mapping."""
        out: dict[str, str] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, sep, column = (s.strip() for s in part.partition("="))
            if not sep or not name or not column:
                raise ConfigError(f"column mapping {part.strip()!r}: write FIELD=COLUMN, e.g. prompt=question,reference=answer")
            if name not in FIELDS:
                raise ConfigError(f"column mapping: unknown field {name!r}; fields are {', '.join(FIELDS)}")
            out[name] = column
        return cls(out)

    def resolve(self, available: Iterable[str]) -> dict[str, str]:
        """Field -> column for this dataset: the mapped ones, plus same-named columns."""
        cols = list(available)
        return {**{f: f for f in FIELDS if f in cols}, **self.columns}


@dataclass(frozen=True, slots=True)
class Preset:
    """A hub schema: its column mapping, and the converter of its answer column into a reference."""

    name: str  # gsm8k | math | mbpp
    mapping: Mapping[str, str]  # field -> column
    reference: Callable[[Mapping[str, Any]], dict[str, Any]]  # row -> reference object; ValueError: a bad row
    doc: str  # one line for --help and the docs


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (the text after its last `####`), thousands separators
    dropped; ValueError when there is none."""
    cut = solution.rfind("####")
    m = _GSM8K_FINAL.match(solution[cut:]) if cut >= 0 else None
    if m is None or not m.group(1).strip():
        raise ValueError("answer has no '#### <final answer>'")
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", m.group(1).strip().splitlines()[0].strip())


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip() or None
    return None


def _gsm8k(row: Mapping[str, Any]) -> dict[str, Any]:
    solution = _text(row, "answer")
    return {"answer": gsm8k_answer(solution), "solution": solution}


def _math(row: Mapping[str, Any]) -> dict[str, Any]:
    solution = row.get("solution")
    given = row.get("answer")  # MATH-500 and others carry the answer as a column of its own
    if isinstance(given, str) and given.strip():
        return {"answer": given.strip(), **({"solution": solution} if isinstance(solution, str) else {})}
    boxed = last_boxed(_text(row, "solution"))
    if boxed is None:
        raise ValueError("solution has no \\boxed{...} answer")
    return {"answer": boxed, "solution": solution}


def _mbpp(row: Mapping[str, Any]) -> dict[str, Any]:
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("test_list is not a non-empty list of strings")
    imports = row.get("test_imports")
    parts = [row.get("test_setup_code"), *(imports if isinstance(imports, list) else [imports])]
    setup = "\n".join(p for p in parts if isinstance(p, str) and p.strip())
    return {"tests": tests, **({"setup": setup} if setup else {})}


def _text(row: Mapping[str, Any], column: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{column} is empty or not text")
    return value


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset("gsm8k", {"prompt": "question"}, _gsm8k,
                    "GSM8K (question, answer with '#### n'): reference {answer: n, solution}"),
    "math": Preset("math", {"prompt": "problem"}, _math,
                   "MATH / MATH-500 (problem, solution with \\boxed{}, optional answer): reference {answer, solution}"),
    "mbpp": Preset("mbpp", {"prompt": "text"}, _mbpp,
                   "MBPP (text or prompt, test_list, test_setup_code / test_imports): reference {tests, setup}"),
}
PRESET_COLUMNS = {"gsm8k": ("answer",), "math": ("solution",), "mbpp": ("test_list",)}  # what the converters read


def preset(name: str) -> Preset:
    """The named preset; ConfigError naming the known ones."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dataset preset {name!r}; presets are {', '.join(PRESETS)} "
                          f"(or map columns yourself: --columns prompt=COLUMN,reference=COLUMN)") from None


def check_columns(source: str, available: list[str], mapping: ColumnMapping, chosen: Preset | None) -> dict[str, str]:
    """Field -> column for `source`; ConfigError naming the columns that exist when a mapped or
    needed column is missing."""
    fields = mapping.resolve(available)
    if chosen is not None:
        base = dict(chosen.mapping)
        if chosen.name == "mbpp" and "text" not in available and "prompt" in available:
            base["prompt"] = "prompt"  # the sanitized MBPP names its prompt column `prompt`
        fields = {**base, **{f: c for f, c in fields.items() if f in mapping.columns or f not in base}}
        needed = [c for c in (fields["prompt"], *PRESET_COLUMNS[chosen.name]) if c not in available]
        if chosen.name == "math" and "solution" in needed and "answer" in available:
            needed.remove("solution")
        if needed:
            raise ConfigError(f"{source}: preset {chosen.name} needs column(s) {', '.join(needed)}; the dataset has "
                              f"{', '.join(available) or 'no columns'} (map them with --columns, or drop --preset)")
    missing = {f: c for f, c in fields.items() if c not in available}
    if missing:
        wrong = ", ".join(f"{f}={c}" for f, c in missing.items())
        raise ConfigError(f"{source}: column(s) not in the dataset ({wrong}); its columns are "
                          f"{', '.join(available) or 'none'}; fix --columns (FIELD=COLUMN)")
    if "prompt" not in fields:
        raise ConfigError(f"{source}: no prompt column; its columns are {', '.join(available) or 'none'}; "
                          f"map one with --columns prompt=COLUMN (or use --preset {'|'.join(PRESETS)})")
    return fields


def reference_json(value: Any) -> str | None:
    """A reference value as a JSON object string (see the module doc); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = None
        return value if isinstance(decoded, dict) else json.dumps({"answer": value})
    return json.dumps(value) if isinstance(value, dict) else json.dumps({"answer": value})


def convert_rows(rows: Iterable[Mapping[str, Any] | str], fields: Mapping[str, str], dataset: str,
                 chosen: Preset | None = None, bad: BadRows | None = None) -> tuple[list[PromptRow], BadRows]:
    """PromptRows of the good rows, and the bad ones counted by reason (see the module doc)."""
    bad = bad if bad is not None else BadRows()
    out: list[PromptRow] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):  # a line of a JSON-lines file that did not decode (its reason)
            bad.add(i, str(row))
            continue
        try:
            out.append(_convert(i, row, fields, dataset, chosen))
        except ValueError as exc:
            bad.add(i, str(exc))
    return out, bad


def _convert(i: int, row: Mapping[str, Any], fields: Mapping[str, str], dataset: str, chosen: Preset | None) -> PromptRow:
    def get(name: str) -> Any:
        column = fields.get(name)
        return None if column is None else row.get(column)

    text = get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty prompt" if isinstance(text, str) or text is None else "prompt is not text")
    if chosen is not None and "reference" not in fields:
        reference = json.dumps(chosen.reference(row))
    elif get("reference") is not None:
        reference = reference_json(get("reference"))
    elif get("answer") is not None:
        reference = json.dumps({"answer": get("answer")})
    elif "reference" in fields or "answer" in fields:
        raise ValueError("no reference (null in the mapped column)")
    else:
        reference = None
    name = str(get("dataset") or dataset)
    difficulty = get("difficulty")
    try:
        diff = None if difficulty is None else float(difficulty)
    except (TypeError, ValueError):
        raise ValueError("difficulty is not a number") from None
    workflow = get("workflow")
    meta = get("metadata")
    pid = get("id")
    return PromptRow(
        prompt_id=str(pid) if pid is not None else f"{name}/{i}",
        dataset=name,
        text=text,
        reference=reference,
        difficulty=diff,
        workflow=str(workflow) if workflow else None,
        metadata={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {},
    )
