"""`load_sft_dataset` from Parquet, CSV and a DatasetDict's split: the same conversations as
from JSONL, and bad rows named by file and row."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from posttrain.models.tiny import build_tokenizer  # noqa: E402
from posttrain.rollouts.sft_data import SFTFields, load_sft_dataset  # noqa: E402

CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y"}],
]  # fmt: skip


def test_chats_from_parquet_and_a_dataset_dict_split_match_jsonl(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "c.parquet")
    assert (
        load_sft_dataset(tmp_path / "c.parquet") == load_sft_dataset(tmp_path / "c.jsonl") == CHATS
    )
    one = datasets.Dataset.from_dict({"messages": CHATS})
    datasets.DatasetDict({"train": one, "test": one.select([1])}).save_to_disk(tmp_path / "dd")
    assert load_sft_dataset(tmp_path / "dd", split="test") == CHATS[1:]
    tokenizer = build_tokenizer()
    from_arrow = load_sft_dataset(f"{tmp_path}/dd@train", tokenizer)
    assert from_arrow == load_sft_dataset(tmp_path / "c.jsonl", tokenizer)


def test_prompt_answer_rows_from_csv_and_bad_rows(tmp_path):
    (tmp_path / "p.csv").write_text("q,a\nwhat,007\n")
    fields = SFTFields(prompt="q", answer="a", system_prompt="be brief")
    assert load_sft_dataset(tmp_path / "p.csv", fields=fields) == [[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what"},
        {"role": "assistant", "content": "007"},  # a CSV cell is text: not 7
    ]]  # fmt: skip
    (tmp_path / "p.csv").write_text("q,a\nwhat,1\nwhy,\n")
    with pytest.raises(
        ValueError,
        match=r"p\.csv, row 2: no field 'messages' \(a chat\), nor both 'q' and 'a' .*the row has 'q'",
    ):
        load_sft_dataset(tmp_path / "p.csv", fields=fields)
    pq.write_table(pa.table({"messages": [CHATS[0], CHATS[0][:1]]}), tmp_path / "c.parquet")
    with pytest.raises(
        ValueError, match=r"c\.parquet, row 2: field 'messages': messages has no assistant turn"
    ):
        load_sft_dataset(tmp_path / "c.parquet")
