"""Dataset tasks from every local format: the same problems and split as from JSONL, problems
built only when drawn, and bad rows named by file, row and field."""

from __future__ import annotations

import json
import random

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from posttrain.data.rows import ArrowRows  # noqa: E402
from posttrain.tasks import DatasetTask  # noqa: E402
from posttrain.tasks.dataset import ProblemRows, held_out_by_hash  # noqa: E402

RECORDS = [{"prompt": f"q{i}", "answer": i} for i in range(40)]


def _write_all(tmp_path) -> dict[str, str]:
    """The same 40 rows as JSONL, JSON, CSV, Parquet and a save_to_disk directory."""
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "d.json").write_text(json.dumps(RECORDS))
    (tmp_path / "d.csv").write_text(
        "prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in RECORDS)
    )
    columns = {"prompt": [r["prompt"] for r in RECORDS], "answer": [r["answer"] for r in RECORDS]}
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    datasets.Dataset.from_dict(columns).save_to_disk(tmp_path / "saved")
    names = ("d.jsonl", "d.json", "d.csv", "d.parquet", "saved")
    return {name: str(tmp_path / name) for name in names}


def test_every_format_gives_the_jsonl_problems_and_split(tmp_path):
    sources = _write_all(tmp_path)
    # The split rule by hand: q_i is held out when its prompt's hash is in the first 30%.
    held = [f"q{i}" for i in range(40) if held_out_by_hash(f"q{i}", 0.3)]
    assert 0 < len(held) < 40
    for name, source in sources.items():
        task = DatasetTask.from_file(source, held_out_fraction=0.3, reward="number")
        assert [p.prompt for p in task.held_out_problems] == held, name
        assert [p.prompt for p in task.train] == [f"q{i}" for i in range(40) if f"q{i}" not in held]
        # The answer is text whatever the column's type: 7 (int) and "7" (CSV) give "7".
        first = task.train[0]
        text = name == "d.csv"  # a CSV cell is text; the other formats keep the int
        assert first.answer == first.prompt[1:]
        assert first.info["answer"] == (first.answer if text else int(first.prompt[1:]))
    assert DatasetTask.from_file(sources["d.parquet"]).name == "d"
    rows = DatasetTask.from_file(sources["d.parquet"], held_out_fraction=0.3).train
    first = next(i for i in range(40) if f"q{i}" not in held)  # the first training row
    assert rows[0].source == f"{sources['d.parquet']}, row {first + 1}"
    assert rows[0].chat() == [{"role": "user", "content": f"q{first}"}]


def test_a_split_of_a_dataset_dict_and_a_held_out_split(tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"q": ["a", "b", "c"], "a": ["1", "2", "3"]}),
        "test": datasets.Dataset.from_dict({"q": ["b", "z"], "a": ["2", "9"]}),
    })  # fmt: skip
    dd.save_to_disk(tmp_path / "dd")
    task = DatasetTask.from_file(
        f"{tmp_path}/dd@train", f"{tmp_path}/dd@test", prompt_field="q", answer_field="a"
    )
    assert [p.prompt for p in task.train] == ["a", "c"] and task.dropped_from_train == 1
    assert [p.prompt for p in task.held_out_problems] == ["b", "z"]
    assert task.held_out_problems[1].source == f"{tmp_path}/dd@test, row 2"
    assert set(task.sources) == {"train", "held_out"}


def test_problems_are_built_when_drawn_not_kept(tmp_path, monkeypatch):
    sources = _write_all(tmp_path)
    reads = []
    get = ArrowRows.__getitem__
    monkeypatch.setattr(ArrowRows, "__getitem__", lambda self, i: reads.append(i) or get(self, i))
    task = DatasetTask.from_file(sources["d.parquet"], held_out_fraction=0.3)
    # Building the task streams through the rows once and keeps only row numbers.
    assert reads == [] and isinstance(task.train, ProblemRows)
    assert task.train.indices.itemsize == 8
    drawn = task.make_prompts(random.Random(0), 3)
    assert len(reads) == 3 and [p.prompt for p in drawn] == [f"q{i}" for i in reads]
    # The same draws as a task over the JSONL file, whose problems come from the same rows.
    same = DatasetTask.from_file(sources["d.jsonl"], held_out_fraction=0.3)
    assert [p.prompt for p in same.make_prompts(random.Random(0), 3)] == [p.prompt for p in drawn]
    assert [p.prompt for p in task.held_out(4, 2)] == [p.prompt for p in same.held_out(4, 2)]
    assert len(reads) == 5  # two more rows read: the two held-out problems asked for


@pytest.mark.parametrize(
    ("columns", "kwargs", "message"),
    [
        ({"q": ["a"], "answer": ["1"]}, {}, r"d\.parquet, row 1: no field 'prompt' \(prompt_field\); the row has 'q', 'answer'"),
        ({"prompt": ["a", "b"], "answer": ["1", None]}, {}, r"d\.parquet, row 2: no field 'answer' \(answer_field\), which the reward"),
        ({"prompt": ["a", "b"], "answer": [[1], [2]]}, {}, r"d\.parquet, row 1: field 'answer' \(answer_field\) must be a string or a number"),
        ({"prompt": ["a", "b"], "answer": ["1", "two"]}, {"reward": "number"}, r"d\.parquet, row 2: field 'answer': answer 'two' is not a number"),
        ({"prompt": ["a"]}, {"reward": "exact"}, r"d\.parquet, row 1: no field 'answer'"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_row_and_field(tmp_path, columns, kwargs, message):
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=message):
        DatasetTask.from_file(tmp_path / "d.parquet", held_out_fraction=0.5, **kwargs)


def test_an_empty_csv_has_no_rows(tmp_path):
    (tmp_path / "e.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"e\.csv' has no rows"):
        DatasetTask.from_file(tmp_path / "e.csv")
