"""Datasets through Hugging Face `datasets` (`astraflow.data`): files, save_to_disk directories,
column mappings and presets in the hubs' own schemas (GSM8K, MATH, MBPP), bad rows counted, and
the errors a wrong path, split or mapping gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.data import ColumnMapping, DatasetSpec, gsm8k_answer, load_prompts, load_source
from astraflow.errors import ConfigError

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A farm has 1,200 hens and buys 34 more. How many hens?", "answer": "1200 + 34 = 1234\n#### 1,234"},
    {"question": "", "answer": "#### 3"},  # bad: empty prompt
    {"question": "What is 2+2?", "answer": "it is four"},  # bad: no '####'
]
MATH = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
     "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify $x(x+2)$.", "solution": "Expanding, $\\boxed{x^2+2x}$.", "level": "Level 2", "type": "Algebra"},
    {"problem": "No box here.", "solution": "The answer is 5.", "level": "Level 1", "type": "Algebra"},  # bad
]
MBPP = [
    {"task_id": 2, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": "",
     "challenge_test_list": []},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hf_dataset_gsm8k_preset_extracts_the_final_answer_and_counts_bad_rows(tmp_path: Path) -> None:
    opened, rows, bad = load_source(DatasetSpec(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), preset="gsm8k"))
    assert opened.columns == ["question", "answer"]
    assert [json.loads(r.reference or "")["answer"] for r in rows] == ["72", "1234"]
    assert json.loads(rows[0].reference or "")["solution"].endswith("#### 72")
    assert [r.prompt_id for r in rows] == ["gsm8k/0", "gsm8k/1"] and rows[0].text.startswith("Natalia")
    assert bad.counts == {"empty prompt": 1, "answer has no '#### <final answer>'": 1}
    assert bad.examples == {"empty prompt": [2], "answer has no '#### <final answer>'": [3]}
    assert "2 bad rows" in bad.summary() and "row 3" in bad.summary()


def test_hf_dataset_save_to_disk_with_splits_and_the_math_preset(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH), "test": datasets.Dataset.from_list(MATH[:1])})
    dd.save_to_disk(str(tmp_path / "math"))
    loaded = load_prompts([DatasetSpec(tmp_path / "math", split="train", preset="math")])
    assert [json.loads(r.reference or "")["answer"] for r in loaded.rows] == ["\\frac{3}{4}", "x^2+2x"]
    assert next(iter(loaded.bad.values())).counts == {"solution has no \\boxed{...} answer": 1}
    assert loaded.report() == [f"{tmp_path / 'math'} [train]: 1 bad row: 1 solution has no \\boxed{{...}} answer (row 2)"]
    test = load_prompts([DatasetSpec(tmp_path / "math", split="test", preset="math")])
    assert len(test.rows) == 1 and not test.bad
    with pytest.raises(ConfigError, match=r"no split 'validation'; its splits are train, test"):
        load_source(DatasetSpec(tmp_path / "math", split="validation", preset="math"))


def test_hf_dataset_parquet_arrow_and_split_directories_with_a_column_mapping(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list(GSM8K[:2])
    ds.to_parquet(str(tmp_path / "g.parquet"))
    spec = DatasetSpec(tmp_path / "g.parquet", columns="prompt=question, reference=answer", name="gsm")
    _, rows, bad = load_source(spec)
    assert [r.prompt_id for r in rows] == ["gsm/0", "gsm/1"] and bad.total == 0
    assert json.loads(rows[1].reference or "") == {"answer": GSM8K[1]["answer"]}  # mapped as it is: no extraction
    ds.save_to_disk(str(tmp_path / "plain"))  # one Dataset, no splits
    assert len(load_source(DatasetSpec(tmp_path / "plain", preset="gsm8k"))[1]) == 2
    with pytest.raises(ConfigError, match="without splits"):
        load_source(DatasetSpec(tmp_path / "plain", split="test", preset="gsm8k"))
    split_dir = tmp_path / "by_split"
    split_dir.mkdir()
    write_jsonl(split_dir / "train.jsonl", GSM8K[:2])
    write_jsonl(split_dir / "test.jsonl", GSM8K[:1])
    assert len(load_source(DatasetSpec(split_dir, split="test", preset="gsm8k"))[1]) == 1
    _, mbpp, _ = load_source(DatasetSpec(write_jsonl(tmp_path / "mbpp.jsonl", MBPP), preset="mbpp"))
    assert json.loads(mbpp[0].reference or "") == {"tests": MBPP[0]["test_list"]}
    assert mbpp[0].text == MBPP[0]["text"]


def test_hf_dataset_wrong_mapping_path_or_preset_fails_naming_what_exists(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K[:2])
    with pytest.raises(ConfigError, match=r"prompt=problem.*its columns are question, answer"):
        load_source(DatasetSpec(path, columns="prompt=problem"))
    with pytest.raises(ConfigError, match=r"no prompt column; its columns are question, answer"):
        load_source(DatasetSpec(path))
    with pytest.raises(ConfigError, match=r"preset math needs column\(s\) problem; the dataset has question, answer"):
        load_source(DatasetSpec(path, preset="math"))
    with pytest.raises(ConfigError, match="unknown dataset preset 'gsm9k'; presets are gsm8k, math, mbpp"):
        load_source(DatasetSpec(path, preset="gsm9k"))
    with pytest.raises(ConfigError, match=r"not found; .* holds: g.jsonl"):
        load_source(DatasetSpec(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="one file, which holds one split"):
        load_source(DatasetSpec(path, split="test", preset="gsm8k"))
    with pytest.raises(ConfigError, match="unknown field 'promt'"):
        ColumnMapping.parse("promt=question")
    with pytest.raises(ConfigError, match="no usable row"):
        load_source(DatasetSpec(write_jsonl(tmp_path / "all_bad.jsonl", GSM8K[2:]), preset="gsm8k"))


def test_hf_dataset_json_lines_of_mixed_shapes_and_broken_lines_are_bad_rows_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "own.jsonl"
    path.write_text('{"prompt": "1+1?", "reference": {"answer": "2"}}\nnot json\n[1, 2]\n{"prompt": "2+2?", "reference": "4"}\n')
    _, rows, bad = load_source(DatasetSpec(path))
    assert [r.reference for r in rows] == ['{"answer": "2"}', '{"answer": "4"}']
    assert bad.counts == {"line is not valid JSON": 1, "line is not a JSON object": 1}


def test_gsm8k_answer_extraction() -> None:
    assert gsm8k_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert gsm8k_answer("#### 1,000,000") == "1000000"
    assert gsm8k_answer("a #### 1 then #### -2.5 ") == "-2.5"
    with pytest.raises(ValueError):
        gsm8k_answer("no marker 7")
