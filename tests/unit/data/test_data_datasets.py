"""Prompt datasets: jsonl and parquet rows, errors that name the line / field, GSM8K final answers."""
import json
import re

import pytest

from megarl.data.datasets import DatasetError, PromptDataset, read_rows, write_jsonl
from megarl.data.gsm8k import gsm8k_final_answer, is_gsm8k_file, load_gsm8k

ROWS = [{"question": "1+1?", "answer": "2", "level": 1}, {"question": "2*3?", "answer": "6", "level": 2}]


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert read_rows(tmp_path / "d.jsonl") == ROWS
    assert read_rows(tmp_path / "d.parquet") == ROWS
    ds = PromptDataset.from_file(tmp_path / "d.parquet", max_rows=1)
    assert len(ds) == 1 and ds.prompt(0) == "1+1?" and ds[0]["level"] == 1


def test_bad_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:3"):
        read_rows(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: expected a JSON object"):
        read_rows(path)


def test_missing_field_names_the_config_key(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"row 0 has no field 'prompt' \(data.prompt_key\)"):
        PromptDataset.from_file(tmp_path / "d.jsonl", prompt_key="prompt")
    with pytest.raises(DatasetError, match="not found"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        (tmp_path / "d.csv").write_text("a,b\n")
        read_rows(tmp_path / "d.csv")


def test_gsm8k_final_answers_match_the_hash_line(tmp_path):
    raw = [{"question": "q1", "answer": "work <<2*3=6>>6\n#### 1,234"},
           {"question": "q2", "answer": "x\n#### -7"}]
    write_jsonl(tmp_path / "gsm.jsonl", raw)
    assert is_gsm8k_file(tmp_path / "gsm.jsonl")
    ds = load_gsm8k(tmp_path / "gsm.jsonl")
    assert [r["answer"] for r in ds] == ["1234", "-7"]
    assert ds[0]["solution"] == raw[0]["answer"]
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no final answer")


def test_real_gsm8k_test_split_parses():
    import os
    from pathlib import Path

    root = Path(os.environ.get("MEGARL_GSM8K_DIR", Path(__file__).resolve().parents[3] / "data/gsm8k"))
    ds = load_gsm8k(root / "test.jsonl", max_rows=200)
    raw = read_rows(root / "test.jsonl")[:200]
    for row, raw_row in zip(ds, raw):
        expected = re.search(r"####\s*(.+)\s*$", raw_row["answer"]).group(1).replace(",", "").strip()
        assert row["answer"] == expected
        assert re.fullmatch(r"-?\d+(\.\d+)?", row["answer"])
