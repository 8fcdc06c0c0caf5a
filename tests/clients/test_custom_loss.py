"""forward_backward_custom on the local client (Tinker's semantics), bad custom losses refused
with nothing accumulated, and the named-loss registry with its entry point group.

Tolerance: the custom path reaches the same gradient through a cross_entropy backward whose
weights are −∂C/∂lp, so only the fp32 summation order differs; as in test_local_invariance.py
(relative L2 error, measured below 5e-7) we allow 2e-6. A wrong sign or a lost datum is off by
order 1.
"""

from __future__ import annotations

import sys

import pytest
import torch
from custom_losses import loss_distribution
from test_local_invariance import grads_of, make_datums, rel_error

from posttrain.algo.losses import LossConfig, with_art_clip_defaults
from posttrain.clients import custom_loss as registry
from posttrain.clients.create import create_training_client
from posttrain.clients.custom_loss import LossName, builtin_as_custom, custom_loss, register_loss
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.rl import _forward_backward

REL_TOL = 2e-6


@pytest.fixture
def pair(tiny_model_dir, tmp_path):
    made = [
        create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / name)
        for name in ("builtin", "custom")
    ]
    yield made
    for client in made:
        client.close()


@pytest.mark.parametrize("name", ["ppo", "cispo", "importance_sampling"])
def test_builtin_loss_as_custom_gives_the_same_gradient(pair, name):
    builtin, custom = pair
    config = with_art_clip_defaults(name, LossConfig())
    datums = make_datums(name)
    expected = builtin.forward_backward(datums, name, config).result()
    got = custom.forward_backward_custom(datums, builtin_as_custom(name, config)).result()
    assert rel_error(grads_of(custom), grads_of(builtin)) < REL_TOL
    assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)
    assert "surrogate_loss:sum" in got.metrics  # the SDK's metric names
    for out, ref in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        torch.testing.assert_close(out["logprobs"], ref["logprobs"], rtol=0, atol=1e-6)


def _vector(data, logprobs):
    return torch.stack([lp.sum() for lp in logprobs]), {}


def _nan(data, logprobs):
    return sum(lp.sum() for lp in logprobs) * float("nan"), {}


def _constant(data, logprobs):
    return torch.tensor(1.0), {}


def _nan_gradient(data, logprobs):
    return sum(lp.sqrt().sum() for lp in logprobs), {}  # logprobs < 0: sqrt' is NaN


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (_vector, r"scalar \(0-d\) tensor, got \(7,\)"),
        (_nan, "custom loss is nan"),
        (_constant, "does not depend on the logprobs"),
        (_nan_gradient, "is not finite|custom loss is nan"),
    ],
)
def test_a_bad_custom_loss_is_refused_and_nothing_accumulates(pair, loss_fn, message):
    client, _ = pair
    datums = make_datums("cross_entropy")
    with pytest.raises(ValueError, match=message):
        client.forward_backward_custom(datums, loss_fn).result()
    assert all(float(g.abs().sum()) == 0 for g in grads_of(client).values())
    # The client goes on: a good call after a refused one works (unlike the SDK's, which
    # refuses every later request).
    out = client.forward_backward(datums, "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0


def test_a_registered_loss_runs_in_the_trainer_as_the_builtin(pair, monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    builtin, custom = pair
    config = from_options(RLConfig, {"loss": "ppo"})
    name = register_loss("hand_ppo", builtin_as_custom("ppo", config.loss_fn_config))
    custom_config = from_options(RLConfig, {"loss": name})
    datums = make_datums("ppo")
    expected = _forward_backward(builtin, datums, config).result()
    got = _forward_backward(custom, datums, custom_config).result()
    assert rel_error(grads_of(custom), grads_of(builtin)) < REL_TOL
    assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)


def test_unknown_and_builtin_names_are_refused(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(
        ValueError, match="option loss='hand_ppo' is invalid: expected one of 'ppo'"
    ):
        from_options(RLConfig, {"loss": LossName("hand_ppo")})
    with pytest.raises(ValueError, match="unknown custom loss 'nope'"):
        custom_loss("nope")
    with pytest.raises(ValueError, match="built-in loss"):
        register_loss("ppo", _constant)


def test_a_loss_plugs_in_through_the_entry_point_group(tmp_path, monkeypatch):
    site = loss_distribution(
        tmp_path / "site",
        "art_ppo = custom_losses:art_ppo\nweighted_sum = custom_losses:weighted_logprob_sum\n",
    )
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.setattr(registry, "_registered", {})
    registry._entry_points.cache_clear()
    try:
        assert from_options(RLConfig, {"loss": "weighted_sum"}).loss_fn == "weighted_sum"
        from custom_losses import weighted_logprob_sum

        assert custom_loss("weighted_sum") is weighted_logprob_sum
    finally:
        registry._entry_points.cache_clear()


@pytest.mark.slow
def test_custom_loss_on_ray_dp2_matches_the_local_builtin(ray_started, tiny_model_dir, tmp_path):
    from posttrain.clients.ray import RayTrainingClient
    from posttrain.engine.ray.executor import RayConfig

    config = with_art_clip_defaults("cispo", LossConfig())
    datums = make_datums("cispo")
    local = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / "l")
    remote = create_training_client(
        tiny_model_dir,
        lora_rank=4,
        storage_dir=tmp_path / "r",
        executor="ray",
        num_workers=2,
        ray_config=RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0),
    )
    assert isinstance(remote, RayTrainingClient)
    try:
        expected = local.forward_backward(datums, "cispo", config).result()
        got = remote.forward_backward_custom(datums, builtin_as_custom("cispo", config)).result()
        per_rank = remote.executor.full_tensors("grads")
        names = {n for rank in per_rank for n, g in rank.items() if g is not None}
        # Each data-parallel rank holds its shard's gradient: their sum is the batch's.
        summed = {
            n: torch.stack([t for r in per_rank if (t := r.get(n)) is not None]).sum(0)
            for n in names
        }
        assert rel_error(summed, grads_of(local)) < REL_TOL
        assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)
        with pytest.raises(ValueError, match="scalar"):
            remote.forward_backward_custom(datums, _vector).result()
    finally:
        local.close()
        remote.close()


def test_unknown_loss_lists_only_the_losses_the_call_runs():
    """RL's loss message lists policy losses, not DPO's pair losses; TinkerBackend's lists only
    what its protocol carries, and says where dro and gspo run."""
    import posttrain.trainer.dpo  # noqa: F401  # registers dpo_sigmoid and dpo_ipo
    from posttrain.backends.tinker import resolve_tinker_rl

    with pytest.raises(ValueError) as local:
        from_options(RLConfig, {"loss": "nonsense"})
    assert "'dro'" in str(local.value) and "dpo_" not in str(local.value)
    with pytest.raises(ValueError, match="a loss of preference pairs, which train_dpo runs"):
        from_options(RLConfig, {"loss": "dpo_sigmoid"})
    with pytest.raises(ValueError) as remote:
        resolve_tinker_rl({"loss": "nonsense"})
    message = str(remote.value)
    assert "expected one of 'ppo', 'cispo', 'importance_sampling', a custom" in message
    assert "dro" not in message and "gspo" not in message and "dpo_" not in message
    with pytest.raises(ValueError, match=r"'gspo' is not carried by the Tinker protocol.*Ray"):
        resolve_tinker_rl({"loss": "gspo"})
    assert resolve_tinker_rl({"ppo": True}).loss_fn == "ppo"
