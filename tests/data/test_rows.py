"""The row reader: every local format read for real from small files written here, rows named
by file and row (a JSONL line by its number), splits of save_to_disk directories, hub ids parsed
and refused offline, the digests a resume compares, and JSONL without the datasets library."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from posttrain.data import rows as rows_module  # noqa: E402
from posttrain.data.rows import (  # noqa: E402
    ArrowRows,
    directory_sha256,
    file_sha256,
    open_rows,
    parse_hub_id,
    resolve_spec,
)

ROOT = Path(__file__).parents[2]


def _read(rows) -> list[tuple[str, dict]]:
    return [(rows.where(i), record) for i, record in rows.records()]


def test_jsonl_rows_are_named_by_line_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": "x", "b": null}\n')
    rows = open_rows(path)
    assert _read(rows) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"a": "x", "b": None})]
    assert len(rows) == 2 and rows[1] == {"a": "x", "b": None} and rows.unit == "line"
    path.write_text('{"a": 1}\n[2]\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: each line must be a JSON object, got list"):
        open_rows(path)


def test_json_is_a_list_of_objects_or_json_lines(tmp_path):
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"q": "a", "n": 4}, {"q": "b", "n": "6"}], indent=1))
    rows = open_rows(listed)
    # Rows of a list are numbered from 1, whatever lines the file spreads them over.
    assert _read(rows) == [(f"{listed}, row 1", {"q": "a", "n": 4}),
                           (f"{listed}, row 2", {"q": "b", "n": "6"})]  # fmt: skip
    lines = tmp_path / "j.json"
    lines.write_text('{"q": "a"}\n{"q": "b"}\n')
    assert [w for w, _ in _read(open_rows(lines))] == [f"{lines}:1", f"{lines}:2"]
    listed.write_text('[{"q": "a"}, "b"]')
    with pytest.raises(
        ValueError, match=r"l\.json, row 2: each row must be a JSON object, got str"
    ):
        open_rows(listed)
    listed.write_text('[{"q": "a"},')
    with pytest.raises(ValueError, match=r"l\.json: invalid JSON"):
        open_rows(listed)


def test_csv_cells_are_text_and_an_empty_cell_is_missing(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\n"a, quoted",007\nb,\nc,NA\n')
    rows = open_rows(path)
    # "007" and "NA" stay as written (pandas alone would give 7 and a missing value).
    assert _read(rows) == [
        (f"{path}, row 1", {"prompt": "a, quoted", "answer": "007"}),
        (f"{path}, row 2", {"prompt": "b"}),
        (f"{path}, row 3", {"prompt": "c", "answer": "NA"}),
    ]
    assert rows.unit == "row" and rows[2] == {"prompt": "c", "answer": "NA"}
    # A spreadsheet's UTF-8 byte order mark is not part of the first column's name.
    path.write_bytes(b"\xef\xbb\xbfprompt,answer\nx,1\n")
    assert open_rows(path)[0] == {"prompt": "x", "answer": "1"}


def test_parquet_and_arrow_files_keep_their_types_and_drop_nulls(tmp_path):
    table = pa.table({"prompt": ["a", "b", None], "answer": [4, None, 6]})
    pq.write_table(table, tmp_path / "d.parquet")
    rows = open_rows(tmp_path / "d.parquet")
    assert isinstance(rows, ArrowRows)
    expected = [{"prompt": "a", "answer": 4}, {"prompt": "b"}, {"answer": 6}]
    assert [r for _, r in _read(rows)] == expected and rows[-1] == {"answer": 6}
    assert rows.where(2) == f"{tmp_path / 'd.parquet'}, row 3"
    # An .arrow file is what datasets writes: take the one save_to_disk made.
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(tmp_path / "saved")
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    assert [r for _, r in _read(open_rows(arrow))] == expected


def test_records_stream_across_batches(tmp_path, monkeypatch):
    pq.write_table(pa.table({"n": list(range(5))}), tmp_path / "d.parquet")
    monkeypatch.setattr(rows_module, "BATCH_ROWS", 2)  # batches of 2, 2 and 1
    assert list(open_rows(tmp_path / "d.parquet").records()) == [(i, {"n": i}) for i in range(5)]


def test_save_to_disk_directories_and_their_splits(tmp_path):
    one = datasets.Dataset.from_dict({"q": ["a", "b"]})
    one.save_to_disk(tmp_path / "one")
    rows = open_rows(tmp_path / "one")
    assert [r for _, r in _read(rows)] == [{"q": "a"}, {"q": "b"}]
    assert rows.where(1) == f"{tmp_path / 'one'}, row 2"
    both = datasets.DatasetDict({"train": one, "test": datasets.Dataset.from_dict({"q": ["z"]})})
    both.save_to_disk(tmp_path / "dd")
    test = open_rows(tmp_path / "dd@test")
    assert [r for _, r in _read(test)] == [{"q": "z"}] and test.where(
        0
    ) == f"{tmp_path}/dd@test, row 1"
    assert open_rows(tmp_path / "dd", split="train")[1] == {"q": "b"}
    assert open_rows(tmp_path / "dd@train", split="train")[0] == {"q": "a"}
    with pytest.raises(ValueError, match=r"dd' has no split 'dev'; it has 'train', 'test'"):
        open_rows(tmp_path / "dd@dev")
    with pytest.raises(ValueError, match=r"has splits 'train', 'test': name one \(.*dd@train\)"):
        open_rows(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"names split 'test', and the split option 'train'"):
        open_rows(tmp_path / "dd@test", split="train")
    with pytest.raises(ValueError, match=r"holds one Dataset, not a DatasetDict: it has no split"):
        open_rows(tmp_path / "one@train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"not one written by datasets\.save_to_disk"):
        open_rows(tmp_path / "plain")
    (tmp_path / "f.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match=r"split 'x' is for a datasets\.save_to_disk directory"):
        open_rows(tmp_path / "f.jsonl", split="x")
    with pytest.raises(FileNotFoundError, match=r"SFT dataset '.*nope\.parquet' does not exist"):
        open_rows(tmp_path / "nope.parquet", what="SFT dataset")


def test_hub_ids_parse_and_resolve_as_they_are():
    assert parse_hub_id("hf:gsm8k") == ("gsm8k", None, None)
    assert parse_hub_id("hf:openai/gsm8k:main@train") == ("openai/gsm8k", "main", "train")
    assert parse_hub_id("hf:openai/gsm8k@test") == ("openai/gsm8k", None, "test")
    for bad in ("hf:", "hf:x:", "hf:x@", "hf:x:a:b", "hf::main"):
        with pytest.raises(ValueError, match="is not a hub dataset id"):
            parse_hub_id(bad)
    assert resolve_spec("hf:gsm8k", Path("conf")) == "hf:gsm8k"
    assert resolve_spec("d/t.csv", Path("conf")) == Path("conf/d/t.csv")


@pytest.mark.slow  # a fresh interpreter importing datasets: about 3 s
def test_a_hub_id_offline_says_how_to_save_it_locally(tmp_path):
    # For real: HF_DATASETS_OFFLINE is read when datasets is imported, so in a fresh process.
    code = (
        "from posttrain.data.rows import open_rows\n"
        "try:\n    open_rows('hf:openai/gsm8k:main@train')\n"
        "except ValueError as exc:\n    print(exc)\n"
    )
    env = dict(
        os.environ, HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path), PYTHONPATH=str(ROOT / "src")
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    message = out.stdout
    assert "'hf:openai/gsm8k:main@train': the Hugging Face hub dataset 'openai/gsm8k'" in message
    assert "cannot be loaded offline (HF_DATASETS_OFFLINE is set)" in message
    assert (
        "datasets.load_dataset('openai/gsm8k', 'main', split='train').save_to_disk(DIR)" in message
    )
    assert "set this option to DIR (DIR@SPLIT for a DatasetDict)" in message


def test_digests_of_files_directories_and_hub_datasets(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": 1}\n')
    assert file_sha256(path) == hashlib.sha256(b'{"q": 1}\n').hexdigest()
    assert open_rows(path).digest() == ("sha256", file_sha256(path))
    datasets.Dataset.from_dict({"q": ["a"]}).save_to_disk(tmp_path / "saved")
    # The documented rule, by hand: each file's relative path, NUL, its sha256, newline.
    files = sorted(p for p in (tmp_path / "saved").rglob("*") if p.is_file())
    lines = "".join(
        f"{p.relative_to(tmp_path / 'saved').as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n"
        for p in files
    )
    assert len(files) == 3  # the Arrow data, dataset_info.json, state.json
    assert directory_sha256(tmp_path / "saved") == hashlib.sha256(lines.encode()).hexdigest()
    assert open_rows(tmp_path / "saved").digest() == (
        "sha256",
        hashlib.sha256(lines.encode()).hexdigest(),
    )
    hub = datasets.Dataset.from_dict({"q": ["a"]})
    assert ArrowRows(hub, "hf:x", None).digest() == ("fingerprint", hub._fingerprint)


def test_jsonl_needs_no_datasets_and_the_rest_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    (tmp_path / "d.jsonl").write_text('{"q": 1}\n')
    (tmp_path / "d.json").write_text('[{"q": 1}]')
    assert open_rows(tmp_path / "d.jsonl")[0] == open_rows(tmp_path / "d.json")[0] == {"q": 1}
    pq.write_table(pa.table({"q": [1]}), tmp_path / "d.parquet")
    with pytest.raises(ImportError, match=r"is a Parquet file; .* pip install 'posttrain\[data\]'"):
        open_rows(tmp_path / "d.parquet")
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[data\]'"):
        open_rows("hf:gsm8k")
