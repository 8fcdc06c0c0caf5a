import numpy as np
import pytest
import torch

from posttrain.types import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    TokenSegment,
    Trajectory,
    TrajectoryGroup,
)


def test_model_input_round_trip():
    mi = ModelInput.from_ints([3, 1, 4])
    assert mi.length == 3
    assert mi.to_ints() == [3, 1, 4]
    assert mi.append_int(1).to_ints() == [3, 1, 4, 1]


def test_datum_coerces_lists_numpy_and_tensors():
    d = Datum(
        model_input=ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "weights": np.array([0.0, 1.0, 0.5]),
            "advantages": torch.tensor([1, 1, 1]),
        },
    )
    assert d.loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert d.loss_fn_inputs["weights"].dtype == torch.float32
    assert d.loss_fn_inputs["advantages"].dtype == torch.float32
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 0.5]


def test_datum_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\].*model_input.length=3"):
        Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3, 4], "weights": [1.0]})


def test_datum_rejects_empty_input():
    with pytest.raises(ValueError, match="empty"):
        Datum(ModelInput.from_ints([]), {})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"beta1": 1.0}, "beta1"),
        ({"eps": 0.0}, "eps"),
        ({"grad_clip_norm": float("nan")}, "grad_clip_norm"),
    ],
)
def test_adam_params_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdamParams(**kwargs)


def test_sampling_params_stop_kinds():
    assert SamplingParams(stop="\n").stop_strings() == ("\n",)
    assert SamplingParams(stop=[5, 6]).stop_tokens() == (5, 6)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a", 1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_trajectory_validation():
    seg = TokenSegment(tokens=(1, 2), trainable=True, logprobs=(-0.1, -0.2))
    traj = Trajectory(segments=(TokenSegment(tokens=(7,)), seg), reward=1.0)
    assert traj.tokens == [7, 1, 2]
    assert traj.num_trainable_tokens == 2
    with pytest.raises(ValueError, match="reward"):
        Trajectory(segments=(seg,), reward=float("nan"))
    with pytest.raises(ValueError, match="one logprob per token"):
        TokenSegment(tokens=(1, 2), logprobs=(-0.1,))
    with pytest.raises(ValueError, match="group needs trajectories"):
        TrajectoryGroup(trajectories=())
