"""The train job end to end on a tiny model: phases, files, exact resume, and its errors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from kill_resume import kill_and_resume
from safetensors.torch import load_file

from posttrain.cli.main import main
from posttrain.cli.train_cmd import example_config
from posttrain.jobs.config import JobConfig, load_config, parse_config
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.run_dir import prepare_run_dir
from posttrain.jobs.train_job import run_job


def _config(output: Path, **rl: object) -> JobConfig:
    return parse_config(
        {
            "run": {
                "task": "reverse",
                "name": "job",
                "project": "test",
                "output_dir": str(output),
                "seed": 3,
            },
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "sft": {"examples": 8, "batch_size": 4, "epochs": 2, "learning_rate": 1e-3},
            "rl": {
                "steps": 2,
                "prompts_per_step": 2,
                "group_size": 4,
                "max_tokens": 6,
                "learning_rate": 1e-3,
                **rl,
            },
            "eval": {"held_out": 4, "every": 1},
        }
    )


class Killed(Exception):
    """Stands in for the process dying between two RL steps."""


def _kill_after(step: int):
    def on_step(done: int) -> None:
        if done == step:
            raise Killed

    return on_step


def _weights(run_dir: Path) -> dict:
    steps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    latest = max(steps, key=lambda p: int(p.name))
    return load_file(latest / "model.safetensors")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


async def test_job_runs_and_a_killed_run_resumes_exactly(tmp_path):
    lines: list[str] = []
    whole = await run_job(_config(tmp_path / "a"), echo=lines.append)
    run_dir = whole.run_dir
    assert run_dir == tmp_path / "a" / "test" / "models" / "job"
    for name in ("curve.png", "metrics.jsonl", "history.jsonl", "job.json", "model.json"):
        assert (run_dir / name).is_file(), name
    assert whole.plot_path == run_dir / "curve.png" and whole.plot_path.stat().st_size > 0
    text = "\n".join(lines)
    assert "held-out accuracy before RL" in text and "held-out accuracy after RL" in text
    assert f"plot: {whole.plot_path}" in text
    assert sum(line.startswith("rl step") for line in lines) == 2
    phases = [(r["phase"], r["step"]) for r in _rows(run_dir)]
    assert phases == [("sft", 1), ("eval", 0), ("rl", 1), ("eval", 1), ("rl", 2), ("eval", 2)]
    # SFT is model step 1; RL steps 1 and 2 are model steps 2 and 3.
    assert json.loads((run_dir / "checkpoints" / "3" / "trainer_state.json").read_text())[
        "run_state"
    ] == {
        "sft_done": True,
        "dpo_done": False,
        "accuracy_before": whole.accuracy_before,
        "rl_steps_done": 2,
    }

    with pytest.raises(Killed):
        await run_job(_config(tmp_path / "b"), on_step=_kill_after(1), echo=lambda _: None)
    resumed_dir = tmp_path / "b" / "test" / "models" / "job"
    lines.clear()
    resumed = await run_job(_config(tmp_path / "b"), resume=resumed_dir, echo=lines.append)
    assert lines[1] == "resuming after RL step 1/2 (model step 2)"
    assert not any("sft warm-up" in line for line in lines)  # done before the kill
    assert sum(line.startswith("rl step") for line in lines) == 1

    # Same seed, same everything: weights bit for bit, and every non-timing metric.
    a, b = _weights(run_dir), _weights(resumed_dir)
    base = load_file(run_dir / "base_model" / "model.safetensors")
    assert any(not a[key].equal(base[key]) for key in a)  # training did move the weights
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key
    assert _rows(resumed_dir) == _rows(run_dir)
    assert (resumed.accuracy_before, resumed.accuracy_after) == (
        whole.accuracy_before,
        whole.accuracy_after,
    )


async def test_rl_steps_follow_the_learning_rate_schedule(tmp_path):
    config = _config(tmp_path, steps=4, lr_warmup_steps=1, lr_schedule="cosine", min_lr_ratio=0.2)
    run_dir = (await run_job(config, echo=lambda _: None)).run_dir
    rates = [r["learning_rate"] for r in _rows(run_dir) if r["phase"] == "rl"]
    # Step k = 0 warms up to (0 + 1) / 1 = 1; then p = (k - 1) / (4 - 1) and the multiplier is
    # 0.2 + 0.8 (1 + cos(pi p)) / 2: k = 1, 2, 3 -> p = 0, 1/3, 2/3 -> 1, 0.8, 0.4.
    assert rates == pytest.approx([1e-3, 1e-3, 0.8e-3, 0.4e-3], rel=1e-12)


async def test_run_directory_errors(tmp_path):
    config = _config(tmp_path, steps=1)
    first = await run_job(config, echo=lambda _: None)
    with pytest.raises(ValueError, match=r"already holds a run .* --resume"):
        await run_job(config, echo=lambda _: None)
    changed = _config(tmp_path, steps=1, learning_rate=5e-4)
    with pytest.raises(ValueError, match=r"\[rl\] learning_rate: 0\.001 in the run, 0\.0005 now"):
        await run_job(changed, resume=first.run_dir, echo=lambda _: None)
    with pytest.raises(ValueError, match="is not a run directory"):
        await run_job(config, resume=tmp_path, echo=lambda _: None)
    # More steps is a change a resume allows: it continues where the run stopped.
    lines: list[str] = []
    await run_job(_config(tmp_path, steps=2), resume=first.run_dir, echo=lines.append)
    assert [line.split()[2] for line in lines if line.startswith("rl step")] == ["2/2"]


def test_cli_train_and_its_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.toml"
    config.write_text(
        '[run]\ntask = "addition"\n[model]\nbase_model = "tiny:llama:tiny"\nlora_rank = 0\n'
        "[rl]\nsteps = 1\nprompts_per_step = 2\ngroup_size = 2\nmax_tokens = 4\n[eval]\nheld_out = 2\n"
    )
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    assert (
        "held-out accuracy before RL" in out and "plot: runs/posttrain/models/run/curve.png" in out
    )
    assert main(["train", str(config)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", str(config), "--resume", "runs/posttrain/models/run"]) == 0
    typo = tmp_path / "typo.toml"
    typo.write_text("[rl]\nstep = 3\n")
    assert main(["train", str(typo)]) == 2
    assert "[rl] unknown key 'step'; did you mean 'steps'?" in capsys.readouterr().err


async def test_a_copied_run_directory_resumes_where_it_stopped(tmp_path, monkeypatch):
    """`cp -r` of a run stopped after RL step 1, the original deleted: the copy resumes at
    step 2 on its own tiny base model, and nothing in it names where the run was."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Killed):
        await run_job(_config(Path("first")), on_step=_kill_after(1), echo=lambda _: None)
    shutil.copytree(tmp_path / "first", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "first")
    run_dir = tmp_path / "elsewhere" / "copy" / "test" / "models" / "job"
    written = [run_dir / "model.json", run_dir / "job.json"]
    written += list((run_dir / "checkpoints").glob("*/trainer_state.json"))
    for path in written:
        assert str(tmp_path) not in path.read_text(), path
    assert json.loads((run_dir / "model.json").read_text())["base_model"] == "./base_model"
    monkeypatch.chdir(tmp_path / "elsewhere")  # and from another working directory
    lines: list[str] = []
    await run_job(_config(Path("first")), resume=run_dir, echo=lines.append)
    assert lines[1] == "resuming after RL step 1/2 (model step 2)"
    assert [line.split()[2] for line in lines if line.startswith("rl step")] == ["2/2"]
    assert [(r["phase"], r["step"]) for r in _rows(run_dir)][-2:] == [("rl", 2), ("eval", 2)]
    assert not (tmp_path / "first").exists()  # nothing was written where the run came from


def test_cli_refuses_a_damaged_latest_checkpoint_and_resumes_an_earlier_step(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.toml"
    config.write_text(
        '[run]\ntask = "addition"\n[model]\nbase_model = "tiny:llama:tiny"\nlora_rank = 0\n'
        "[rl]\nsteps = 2\nprompts_per_step = 2\ngroup_size = 2\nmax_tokens = 4\n[eval]\nheld_out = 2\n"
    )
    assert main(["train", str(config)]) == 0
    run_dir = "runs/posttrain/models/run"
    weights = tmp_path / run_dir / "checkpoints" / "2" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1)
    capsys.readouterr()
    assert main(["train", str(config), "--resume", run_dir]) == 2
    err = capsys.readouterr().err
    assert f"latest checkpoint {run_dir}/checkpoints/2 is damaged" in err
    assert "size differs from checkpoint.json for model.safetensors" in err
    assert "--resume-step 1" in err
    assert main(["train", str(config), "--resume-step", "1"]) == 2
    assert "--resume-step needs --resume DIR" in capsys.readouterr().err
    assert main(["train", str(config), "--resume", run_dir, "--resume-step", "1"]) == 0
    out = capsys.readouterr().out
    assert "resuming after RL step 1/2 (model step 1)" in out
    assert sum(line.startswith("rl step") for line in out.splitlines()) == 1


def test_cli_demo_prints_its_config(capsys):
    assert main(["demo", "--print-config"]) == 0
    assert 'task = "reverse"' in capsys.readouterr().out


def test_cli_demo_prints_the_config_its_set_makes(capsys, tmp_path):
    # A key the file has (replaced in its table), one its table lacks (added there), a table
    # the file lacks (added at the end), and a string given bare: the printed TOML is the job
    # the run would use.
    sets = ["rl.steps=3", "rl.kl_penalty_coef=0.1", "run.name=my run", "inference.threads=1"]
    args = [part for item in sets for part in ("--set", item)]
    assert main(["demo", "--print-config", *args]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "job.toml").write_text(printed)
    job = load_config(tmp_path / "job.toml")
    assert job == load_config(example_config("reverse"), sets)
    assert (job.rl.steps, job.run.name) == (3, "my run")
    assert printed.count("\nsteps =") == 1  # replaced, not added twice
    assert printed.startswith(example_config("reverse").read_text().splitlines()[0])  # comments
    # A key the job refuses is refused here too, as the run would refuse it.
    assert main(["demo", "--print-config", "--set", "rl.stepz=3"]) == 2
    assert "[rl] unknown key 'stepz'; did you mean 'steps'?" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_demo_runs_its_first_steps_with_set(tmp_path, capsys, monkeypatch):
    # The shipped demo, cut to its first steps on the command line (as scripts/release-check
    # runs it from an installed wheel): the tiny model for the mini one, a short warm-up.
    monkeypatch.chdir(tmp_path)
    sets = ["model.base_model=tiny:qwen2:tiny", "sft.examples=8", "sft.epochs=1"]
    sets += ["rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "eval.held_out=2"]
    assert main(["demo", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "sft warm-up: 8 examples, 1 epochs" in out
    assert sum(line.startswith("rl step    1/1") for line in out.splitlines()) == 1
    assert "held-out accuracy (2 problems, greedy): before RL" in out
    assert main(["demo", "--set", "rl.stepz=1"]) == 2
    assert "[rl] unknown key 'stepz'; did you mean 'steps'?" in capsys.readouterr().err


def _toml(config: dict[str, dict[str, object]]) -> str:
    lines = []
    for table, values in config.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_a_sigkilled_train_process_resumes_bit_for_bit(tmp_path):
    """`posttrain train` in a subprocess, SIGKILLed as soon as the checkpoint of RL step 2 is
    on disk, then `posttrain train --resume` to the end: the same weights and metrics.jsonl (and
    history.jsonl) as an uninterrupted run, bit for bit, timing columns aside."""
    data: dict[str, dict[str, object]] = {
        "run": {"task": "reverse", "name": "job", "project": "t", "seed": 5},
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "sft": {"examples": 8, "batch_size": 4, "epochs": 2, "learning_rate": 1e-3},
        "rl": {"steps": 5, "prompts_per_step": 4, "group_size": 4, "max_tokens": 6,
               "learning_rate": 1e-3},
        "eval": {"held_out": 8, "every": 2},
    }  # fmt: skip
    whole = asyncio.run(
        run_job(
            parse_config({**data, "run": {**data["run"], "output_dir": str(tmp_path / "a")}}),
            echo=lambda _: None,
        )
    )
    config = tmp_path / "job.toml"
    config.write_text(_toml({**data, "run": {**data["run"], "output_dir": str(tmp_path / "b")}}))
    run_dir = tmp_path / "b" / "t" / "models" / "job"
    kill_and_resume(config, run_dir)
    # A kill mid-save leaves a hidden .N.tmp-* directory; the resumed run's pruning removes it.
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    a, b = _weights(whole.run_dir), _weights(run_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key
    assert _rows(run_dir) == _rows(whole.run_dir)

    def history(path: Path) -> list[dict]:
        rows = [json.loads(line) for line in (path / "history.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]

    assert history(run_dir) == history(whole.run_dir)


def test_a_run_on_the_tinker_service_is_not_started_over(tmp_path):
    """TinkerBackend keeps its checkpoints on the service and indexes them in
    checkpoints.jsonl, with no step directory: a new run of the same name is refused, as on
    LocalBackend, not re-run over the old one's metrics and run state."""
    config = _config(tmp_path)
    run_dir = tmp_path / "test" / "models" / "job"
    run_dir.mkdir(parents=True)
    record = {"step": 1, "path": "tinker://run-1/weights/step-000001", "run_state": {}}
    (run_dir / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    (run_dir / "metrics.jsonl").write_text('{"phase": "dpo", "step": 1}\n')
    with pytest.raises(
        ValueError,
        match=r"already holds a run \(checkpoints.jsonl names the "
        r"checkpoint of step 1\); continue it with .* --resume",
    ):
        prepare_run_dir(run_dir, config, resume=False)
    assert (run_dir / "metrics.jsonl").read_text() == '{"phase": "dpo", "step": 1}\n'
    (run_dir / "checkpoints.jsonl").write_text("")  # an empty index holds nothing yet
    prepare_run_dir(run_dir, config, resume=False)
