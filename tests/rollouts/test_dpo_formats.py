"""`load_preference_pairs` reads the shared row formats: Parquet gives the JSONL file's pairs,
and a bad row is named by file and row."""

from __future__ import annotations

import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from posttrain.models.tiny import build_tokenizer  # noqa: E402
from posttrain.rollouts.dpo_data import load_preference_pairs  # noqa: E402

ROWS = [
    {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    {"prompt": "capital of France?", "chosen": "Paris", "rejected": "Rome"},
]


def test_pairs_from_parquet_match_jsonl_and_bad_rows_are_named(tmp_path):
    tokenizer = build_tokenizer()
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    columns = {key: [r[key] for r in ROWS] for key in ROWS[0]}
    pq.write_table(pa.table(columns), tmp_path / "p.parquet")
    from_jsonl = load_preference_pairs(tmp_path / "p.jsonl", tokenizer)
    assert load_preference_pairs(tmp_path / "p.parquet", tokenizer) == from_jsonl
    assert len(from_jsonl) == 2
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["x", None], "rejected": ["y", "z"]}),
                   tmp_path / "bad.parquet")  # fmt: skip
    with pytest.raises(ValueError, match=r"bad\.parquet, row 2: field 'chosen' must be a string"):
        load_preference_pairs(tmp_path / "bad.parquet", tokenizer)
