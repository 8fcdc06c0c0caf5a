"""A job's `[data]` in other formats: job.json records a Parquet file's sha256 and a
save_to_disk directory's digest, a resume refuses changed data, and a hub dataset's fingerprint
is compared the same way."""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from posttrain.data.rows import directory_sha256, file_sha256  # noqa: E402
from posttrain.jobs.config import parse_config  # noqa: E402
from posttrain.jobs.job_task import resolve_job_task  # noqa: E402
from posttrain.jobs.run_dir import data_changes, prepare_run_dir  # noqa: E402


def _config(tmp_path):
    return parse_config(
        {
            "run": {"name": "job", "project": "t", "output_dir": str(tmp_path / "runs")},
            "data": {"train": "t.parquet", "held_out": "dd@test", "prompt_field": "q"},
        },
        source=tmp_path / "job.toml",
    )


def test_job_json_records_digests_and_a_resume_refuses_changed_data(tmp_path):
    pq.write_table(pa.table({"q": ["a", "b", "c"], "answer": [1, 2, 3]}), tmp_path / "t.parquet")
    test = datasets.Dataset.from_dict({"q": ["b", "z"], "answer": ["2", "9"]})
    datasets.DatasetDict({"test": test}).save_to_disk(tmp_path / "dd")
    resolved = resolve_job_task(_config(tmp_path))
    details = resolved.details
    assert (details["train_problems"], details["held_out_problems"]) == (2, 2)
    assert details["dropped_from_train"] == 1  # "b" is held out
    assert details["sha256"] == {
        "train": file_sha256(tmp_path / "t.parquet"),
        "held_out": directory_sha256(tmp_path / "dd"),
    }
    assert "fingerprint" not in details
    run_dir = tmp_path / "runs" / "t" / "models" / "job"
    prepare_run_dir(run_dir, _config(tmp_path), resume=False, task=resolved.record())
    again = resolve_job_task(_config(tmp_path)).record()
    assert prepare_run_dir(run_dir, _config(tmp_path), resume=True, task=again) == run_dir
    changed = datasets.Dataset.from_dict({"q": ["b", "y"], "answer": ["2", "9"]})
    datasets.DatasetDict({"test": changed}).save_to_disk(tmp_path / "dd2")
    (tmp_path / "dd").rename(tmp_path / "old")
    (tmp_path / "dd2").rename(tmp_path / "dd")
    now = resolve_job_task(_config(tmp_path)).record()
    with pytest.raises(ValueError, match=r"\[data\] held_out: the file changed since the run"):
        prepare_run_dir(run_dir, _config(tmp_path), resume=True, task=now)


def test_a_hub_fingerprint_is_compared_like_a_sha256():
    saved = {"sha256": {"held_out": "ab" * 32}, "fingerprint": {"train": "f00d"}}
    assert (
        data_changes(saved, {"sha256": {"held_out": "ab" * 32}, "fingerprint": {"train": "f00d"}})
        == []
    )
    (message,) = data_changes(
        saved, {"sha256": {"held_out": "ab" * 32}, "fingerprint": {"train": "beef"}}
    )
    assert message.startswith("[data] train: the hub dataset changed since the run started")
    assert "(fingerprint f00d... then, beef... now)" in message
