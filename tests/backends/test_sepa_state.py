"""The SEPA controller's state on every backend: kept in the model's run_state, saved with each
checkpoint, restored when the model registers again, and left as it was by a failed step.

lambda ramps 0, 0.25, 0.5, ... (sepa_steps 4, no delay, gate open): a state that was lost or
advanced by a failed step shows as another lambda on the next step.
"""

from __future__ import annotations

import json
import shutil

import pytest
from backend_kinds import MakeBackend, tiny

from local_groups import synthetic_groups
from posttrain.backends.model import TrainableModel
from posttrain.trainer.token_advantages import SEPA_STATE_KEY

OPTIONS = {
    "token_transform": "gtpo_sepa",
    "sepa_steps": 4,
    "sepa_delay_steps": 0,
    "sepa_correct_rate_gate": 0.0,
    "learning_rate": 1e-2,
}


def sepa_steps(model: TrainableModel) -> object:
    state = model.run_state[SEPA_STATE_KEY]
    assert isinstance(state, dict)
    return state["steps"]


async def test_the_sepa_state_is_checkpointed_and_restored(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path
):
    backend = make_backend(tmp_path)
    model = tiny("m", tiny_model_dir)
    await model.register(backend)
    model.run_state["cursor"] = 3  # the caller's own entries live beside the trainer's
    lambdas = []
    for step in range(2):
        result = await backend.train(model, synthetic_groups(step), **OPTIONS)
        lambdas.append(result.metrics["sepa_lambda"])
    assert lambdas == [0.0, 0.25]
    assert sepa_steps(model) == 2
    await backend.close()

    backend = make_backend(tmp_path)
    again = tiny("m", tiny_model_dir)
    await again.register(backend)  # resumes the checkpoint of step 2
    assert again.run_state == model.run_state
    assert again.run_state["cursor"] == 3
    result = await backend.train(again, synthetic_groups(2), **OPTIONS)
    assert result.metrics["sepa_lambda"] == 0.5
    await backend.close()


async def test_a_failed_step_leaves_the_sepa_state_as_it_was(tiny_model_dir, tmp_path):
    from posttrain.backends.local import LocalBackend

    backend = LocalBackend(tmp_path)
    model = tiny("m", tiny_model_dir)
    await model.register(backend)
    await backend.train(model, synthetic_groups(0), **OPTIONS)
    saved = json.loads((model.directory / "checkpoints" / "1" / "trainer_state.json").read_text())
    assert saved["run_state"][SEPA_STATE_KEY] == model.run_state[SEPA_STATE_KEY]
    before = dict(model.run_state)
    stray = model.directory / "checkpoints" / "2"  # step 2's checkpoint cannot be written
    stray.mkdir()
    (stray / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="refusing to replace"):
        await backend.train(model, synthetic_groups(1), **OPTIONS)
    assert model.run_state == before and model.step == 1
    shutil.rmtree(stray)
    result = await backend.train(model, synthetic_groups(1), **OPTIONS)
    assert result.metrics["sepa_lambda"] == 0.25  # the retry is the step an unbroken run takes
    assert sepa_steps(model) == 2
    await backend.close()
