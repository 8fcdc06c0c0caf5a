"""The shipped real-model example, word-problems.toml, stays a job that runs: the same file on a
tiny model (the same Llama architecture as SmolLM2), for 2 RL steps of 2 x 2 completions. What
the example does on SmolLM2-135M-Instruct is measured in docs/real-models.md."""

from __future__ import annotations

import json
from dataclasses import replace

from posttrain.cli.main import main
from posttrain.cli.train_cmd import example_config
from posttrain.jobs.config import load_config
from posttrain.jobs.train_job import run_job


async def test_the_word_problems_example_runs_two_steps_on_a_tiny_model(tmp_path):
    shipped = load_config(example_config("word-problems"))
    assert shipped.model.base_model == "packaged:smollm2-135m-instruct"
    config = replace(
        shipped,
        run=replace(shipped.run, output_dir=str(tmp_path)),
        model=replace(shipped.model, base_model="tiny:llama:tiny"),
        rl=replace(shipped.rl, steps=2, prompts_per_step=2, group_size=2),
        eval=replace(shipped.eval, held_out=4, every=1),
    )
    lines: list[str] = []
    result = await run_job(config, echo=lines.append)
    run = tmp_path / "demo" / "models" / "word-problems"
    assert result.run_dir == run and result.plot_path == run / "curve.png"
    assert result.plot_path.stat().st_size > 0
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    # Evaluated before RL, after each step (every = 1), and after RL; one row per RL step.
    assert [(r["phase"], r["step"]) for r in rows] == [
        ("eval", 0),
        ("rl", 1),
        ("eval", 1),
        ("rl", 2),
        ("eval", 2),
    ]
    assert any(
        line.startswith("held-out accuracy (4 problems, greedy): before RL") for line in lines
    )
    # The [task] table reached the task: stories that add or take away, numbers 1-9.
    trained = (run / "trajectories" / "train" / "00001.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["metadata"]["prompt"] for line in trained]
    assert len(prompts) == 4 and all(" more." in p or " away " in p for p in prompts)


def test_demo_prints_the_real_example(capsys):
    assert main(["demo", "word-problems", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert (
        'task = "word-problems"' in out and 'base_model = "packaged:smollm2-135m-instruct"' in out
    )
