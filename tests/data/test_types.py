import dataclasses
import math

import numpy as np
import pytest
import torch

from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ModelInput,
    SamplingParams,
    TrainResult,
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


INF = float("inf")


@pytest.mark.parametrize(
    ("kind", "kwargs", "message"),
    [
        # Infinity means nothing for these: lr=inf once turned every weight into NaN.
        (AdamParams, {"learning_rate": INF}, "AdamParams.learning_rate must be a finite number"),
        (AdamParams, {"eps": INF}, "AdamParams.eps must be a finite number > 0"),
        (AdamParams, {"weight_decay": INF}, "AdamParams.weight_decay must be a finite"),
        (AdamParams, {"grad_clip_norm": INF}, "AdamParams.grad_clip_norm must be a finite"),
        (AdamParams, {"beta2": -INF}, r"AdamParams.beta2 must be in \[0, 1\)"),
        (SamplingParams, {"temperature": INF}, "SamplingParams.temperature must be a finite"),
        (SamplingParams, {"top_p": math.nan}, r"SamplingParams.top_p must be in \(0, 1\]"),
        # Untyped input (JSON, TOML) names the field instead of failing inside a comparison.
        (
            AdamParams,
            {"learning_rate": "fast"},
            "AdamParams.learning_rate must be a number, got str",
        ),
        (AdamParams, {"beta1": True}, "AdamParams.beta1 must be a number, got bool"),
        (SamplingParams, {"max_tokens": "8"}, "SamplingParams.max_tokens must be an integer"),
        (SamplingParams, {"seed": 1.5}, "SamplingParams.seed must be an integer"),
        (SamplingParams, {"top_k": 0}, r"SamplingParams.top_k must be -1 \(off\) or >= 1"),
    ],
)
def test_settings_are_finite_numbers_named_when_wrong(kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kind(**kwargs)


def test_settings_accept_numpy_numbers_and_huge_seeds():
    lr = np.float32(1e-3)  # numpy scalars arrive from configs and arrays
    assert AdamParams(learning_rate=lr).learning_rate == lr  # pyright: ignore[reportArgumentType]
    # The sampler hashes its seed: any integer seeds it.
    four = np.int64(4)
    assert SamplingParams(seed=2**80, max_tokens=four).seed == 2**80  # pyright: ignore[reportArgumentType]


def test_sampling_params_stop_kinds():
    assert SamplingParams(stop="\n").stop_strings() == ("\n",)
    assert SamplingParams(stop=[5, 6]).stop_tokens() == (5, 6)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a", 1])  # pyright: ignore[reportArgumentType]
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


# ---------------------------------------------------------------- token ids


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([3, -1], r"EncodedTextChunk.tokens\[1\] is -1; token ids must be integers >= 0"),
        ([1.5], r"tokens\[0\] is 1.5; token ids must be integers"),
        ([True], r"tokens\[0\] is True"),
        (["7"], r"tokens\[0\] is '7'"),
    ],
)
def test_encoded_text_chunk_rejects_bad_token_ids(tokens, match):
    with pytest.raises(ValueError, match=match):
        EncodedTextChunk(tokens=tuple(tokens))
    with pytest.raises(ValueError, match=match):
        ModelInput.from_ints(tokens)


def test_encoded_text_chunk_accepts_numpy_ints():
    chunk = EncodedTextChunk(tokens=tuple(np.array([0, 5], dtype=np.int32)))
    assert chunk.tokens == (0, 5) and all(type(t) is int for t in chunk.tokens)
    assert ModelInput.from_ints([1]).append(chunk).to_ints() == [1, 0, 5]


# ---------------------------------------------------------------- Datum validation


def _datum(**inputs):
    return Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ({"weights": []}, r"loss_fn_inputs\['weights'\] has shape \(0,\).*model_input.length=3"),
        ({"advantages": 1.0}, r"loss_fn_inputs\['advantages'\] must be numeric"),
        ({"advantages": torch.tensor(1.0)}, r"loss_fn_inputs\['advantages'\] has shape \(\)"),
        ({"logprobs": [[0.0]] * 4}, r"loss_fn_inputs\['logprobs'\] has shape \(4, 1\)"),
        ({"weights": ["a", "b", "c"]}, r"loss_fn_inputs\['weights'\] must be numeric"),
        ({"weights": [1 + 1j] * 3}, r"loss_fn_inputs\['weights'\] must hold real numbers"),
        ({"target_tokens": [1.0, 2.5, 3.0]}, r"'target_tokens'\] holds non-integer values"),
        ({"target_tokens": [1, -100, 3]}, r"'target_tokens'\] holds token id -100; .* >= 0"),
    ],
)
def test_datum_rejects_bad_inputs_naming_the_key(inputs, match):
    with pytest.raises(ValueError, match=match):
        _datum(**inputs)


def test_datum_rejects_bad_containers():
    with pytest.raises(ValueError, match="loss_fn_inputs must be a mapping"):
        Datum(ModelInput.from_ints([1]), [1.0])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="keys must be non-empty strings, got 3"):
        Datum(ModelInput.from_ints([1]), {3: [1.0]})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"model_input must be a posttrain.types.ModelInput"):
        Datum([1, 2], {})  # pyright: ignore[reportArgumentType]


def test_datum_validation_also_runs_on_replace():
    # dataclasses.replace goes through the same constructor, so a copy is checked too.
    datum = _datum(target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\] has shape \(2,\)"):
        dataclasses.replace(datum, loss_fn_inputs={"weights": [1.0, 1.0]})
    moved = dataclasses.replace(datum, model_input=ModelInput.from_ints([7, 8, 9]))
    assert moved.model_input.to_ints() == [7, 8, 9]
    assert torch.equal(moved.loss_fn_inputs["target_tokens"], torch.tensor([2, 3, 4]))


def test_datum_keeps_integer_valued_float_tokens_and_nan_logprobs():
    # Integer-valued floats are token ids (as numpy float arrays often hold); NaN logprobs are
    # the placeholders of unknown sampler logprobs that the losses resolve or reject.
    datum = _datum(target_tokens=np.array([2.0, 3.0, 4.0]), logprobs=[float("nan"), -1.0, -2.0])
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert torch.isnan(datum.loss_fn_inputs["logprobs"][0])
    assert Datum(ModelInput.from_ints([1])).loss_fn_inputs == {}  # as Tinker, inputs optional


# ---------------------------------------------------------------- Tinker SDK compatibility


def test_names_and_constructors_match_the_tinker_sdk():
    tinker_types = pytest.importorskip("tinker.types")
    tokens, inputs = [1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [1.0, 0.0, 1.0]}
    ours = Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
    theirs = tinker_types.Datum(
        model_input=tinker_types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs
    )
    assert ours.model_input.to_ints() == theirs.model_input.to_ints()
    assert ours.loss_fn_inputs["weights"].tolist() == theirs.loss_fn_inputs["weights"].tolist()
    assert [f.name for f in dataclasses.fields(Datum)] == [
        f.name for f in dataclasses.fields(tinker_types.Datum)
    ][:2]
    assert [f.name for f in dataclasses.fields(EncodedTextChunk)] == list(
        tinker_types.EncodedTextChunk.model_fields
    )
    for ours_cls, theirs_cls in (
        (SamplingParams, tinker_types.SamplingParams),
        (AdamParams, tinker_types.AdamParams),
    ):
        # posttrain's extensions: entropies (the protocol cannot carry it), and vLLM's and
        # OpenAI's min_p and penalties (SDK 0.38 has no fields for them; issue 36).
        extensions = (
            {"entropies", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
            if ours_cls is SamplingParams
            else set()
        )
        defaults = {
            f.name: f.default for f in dataclasses.fields(ours_cls) if f.name not in extensions
        }
        their_defaults = {k: v.default for k, v in theirs_cls.model_fields.items()}
        assert defaults == their_defaults, ours_cls.__name__
    for name in ("from_ints", "to_ints", "empty", "append", "append_int", "length"):
        assert hasattr(ModelInput, name) and hasattr(tinker_types.ModelInput, name), name


# ---------------------------------------------------------------- TrainResult


def test_train_result_validation():
    result = TrainResult(step=3, metrics={"loss": np.float32(0.5), "num_updates": 2})  # pyright: ignore[reportArgumentType]
    assert result.metrics == {"loss": 0.5, "num_updates": 2.0}
    assert all(type(v) is float for v in result.metrics.values())
    # A skipped (non-finite) step is reported, not refused: see TrainResult's docstring.
    assert math.isnan(TrainResult(step=0, metrics={"grad_norm": float("nan")}).metrics["grad_norm"])
    for step in (-1, True, 1.0, "2"):
        with pytest.raises(ValueError, match=r"TrainResult.step must be an int >= 0"):
            TrainResult(step=step, metrics={})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"TrainResult.metrics\['loss'\] must be a number"):
        TrainResult(step=1, metrics={"loss": "low"})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"metrics\['done'\] must be a number"):
        TrainResult(step=1, metrics={"done": True})
    with pytest.raises(ValueError, match="metrics keys must be non-empty strings"):
        TrainResult(step=1, metrics={"": 1.0})
    with pytest.raises(ValueError, match="checkpoint_path must be None or a non-empty path"):
        TrainResult(step=1, metrics={}, checkpoint_path="")
