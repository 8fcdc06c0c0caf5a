"""`posttrain train`'s errors: a job error is one line and exit code 2, its traceback behind
`--debug`."""

from __future__ import annotations

import pytest

from posttrain.backends import client_models
from posttrain.cli.main import main
from posttrain.inference.faults import FaultyEngine

# The SFT warm-up moves the weights (model step 1); the split engine never applies them (the
# "base" fault) while it claims it does, so RL step 1's rollouts come from the base model and
# the parity check fails that step (on its tokens, or, when every group has one reward and
# nothing trains, on the probe after its sync).
JOB = """
[run]
task = "reverse"
[model]
base_model = "tiny:qwen2:tiny"
lora_rank = 4
[sft]
examples = 4
batch_size = 4
epochs = 1
learning_rate = 5e-2
[rl]
steps = 1
prompts_per_step = 2
group_size = 2
max_tokens = 4
[eval]
held_out = 1
[inference]
devices = "cpu,cpu"
threads = 1
"""


@pytest.mark.slow  # an SFT step and an RL step with an engine process: ~10 s
def test_a_parity_failure_is_one_line_and_debug_shows_its_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opened = client_models.open_engine

    async def open_faulty(*args, **kwargs):
        session = await opened(*args, **kwargs)
        session.engine = FaultyEngine(session.engine, "base")
        return session

    monkeypatch.setattr(client_models, "open_engine", open_faulty)
    config = tmp_path / "job.toml"
    config.write_text(JOB)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    failed = [line for line in err.splitlines() if line.startswith("posttrain train: error:")]
    assert len(failed) == 1, err
    assert "the 'pytorch' engine does not sample the trained policy" in failed[0]
    assert "parity_check = 'warn'" in failed[0]  # the fix, on the same line
    # --debug raises instead: the traceback is Python's (here the run directory the failed run
    # left, a job error like the parity one).
    with pytest.raises(ValueError, match="already holds a run"):
        main(["train", str(config), "--debug"])
