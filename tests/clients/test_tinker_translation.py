"""What TinkerTrainingClient sends: posttrain's loss config and datums in Tinker's vocabulary.

Folding the trainer's per-token `weights` into `advantages` must leave the loss and its
gradient unchanged for importance_sampling, ppo and cispo. Both sides run posttrain's own loss
on the same tiny model, so the only difference is the order of two float32 products per token:
relative gradient errors of ~1e-7 are rounding, we allow 1e-5; a wrong fold (weights dropped,
applied twice, or applied to the ratio) is off by orders of magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_local_invariance import grads_of, rel_error

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import create_training_client
from posttrain.clients.tinker import protocol_inputs, protocol_loss_config
from posttrain.clients.token_metrics import with_token_metrics
from posttrain.types import Datum, ForwardBackwardOutput, ModelInput

REL_TOL = 1e-5


def test_clip_range_travels_as_thresholds():
    config = protocol_loss_config("ppo", LossConfig(epsilon=0.2, epsilon_high=0.28))
    assert config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert protocol_loss_config("cispo", LossConfig(epsilon=0.5)) == pytest.approx(
        {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    )
    assert protocol_loss_config("ppo", LossConfig(epsilon_high=0.3)) == {"clip_high_threshold": 1.3}
    assert protocol_loss_config("importance_sampling", None) == {}
    assert protocol_loss_config("cross_entropy", LossConfig()) == {}
    # Tinker-style mappings (code ported from the tinker SDK) are parsed, then sent the same way.
    mapped = protocol_loss_config("ppo", {"epsilon": 0.2, "epsilon_high": 0.28, "beta": None})
    assert mapped == config
    assert protocol_loss_config("cross_entropy", {"kl_penalty_coef": 0.0}) == {}


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        ("ppo", LossConfig(kl_penalty_coef=0.1), "kl_penalty_coef=0.1 is not carried"),
        ("ppo", LossConfig(truncated_importance_sampling=2.0), "truncated_importance_sampling"),
        ("ppo", LossConfig(importance_sampling_level="sequence"), "importance_sampling_level"),
        ("ppo", LossConfig(dro_beta=0.1), "dro_beta=0.1 is not carried"),
        ("ppo", {"kl_penalty_coef": 0.1}, "kl_penalty_coef=0.1 is not carried"),
        ("ppo", {"clip_ratio": 0.2}, "unknown loss config key 'clip_ratio'"),
        ("dro", {}, "loss_fn='dro' cannot be sent"),
        ("gspo", {}, "loss_fn='gspo' cannot be sent"),
    ],
)
def test_what_the_protocol_cannot_carry_is_refused(loss_fn, config, message):
    with pytest.raises(ValueError, match=message):
        protocol_loss_config(loss_fn, config)


def trainer_datums(seed: int = 0) -> list[Datum]:
    """Datums shaped like the shared trainer's: masked advantages, token-mean weights."""
    gen = torch.Generator().manual_seed(seed)
    datums = []
    masks = [(torch.rand(6 + i, generator=gen) > 0.3).float() for i in range(5)]
    total = float(sum(m.sum() for m in masks))
    for mask in masks:
        length = mask.numel()
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        adv = float(torch.randn(1, generator=gen))
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": torch.where(mask > 0, -5.7 + 0.3 * torch.randn(length, generator=gen), 0.0),
            "advantages": mask * adv,
            "mask": mask,
            "weights": mask / total,
        }
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def test_weights_fold_into_advantages_inputs():
    datum = trainer_datums()[0]
    sent = protocol_inputs("ppo", datum)
    assert set(sent) == {"target_tokens", "logprobs", "advantages"}
    expected = datum.loss_fn_inputs["advantages"] * datum.loss_fn_inputs["weights"]
    assert torch.equal(sent["advantages"], expected)
    assert sent["target_tokens"].dtype == torch.int64
    ce = Datum(
        datum.model_input,
        {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "weights": datum.loss_fn_inputs["weights"],
        },
    )
    assert set(protocol_inputs("cross_entropy", ce)) == {"target_tokens", "weights"}


def test_negative_weights_cannot_be_folded():
    datum = trainer_datums()[0]
    inputs = dict(datum.loss_fn_inputs)
    inputs["weights"] = -inputs["weights"]
    with pytest.raises(ValueError, match="negative per-token weights"):
        protocol_inputs("ppo", Datum(datum.model_input, inputs))


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_folded_datums_give_the_same_loss_and_gradient(tiny_model_dir, tmp_path, loss_fn):
    datums = trainer_datums()
    # importance_sampling does not clip: posttrain refuses a clip range for it (and so does the fold).
    if loss_fn == "importance_sampling":
        config = LossConfig()
    else:
        config = LossConfig(epsilon=0.2, epsilon_high=0.28)
    folded = [Datum(d.model_input, protocol_inputs(loss_fn, d)) for d in datums]
    results = []
    for name, batch, cfg in (
        ("posttrain", datums, config),
        # What the server does with the wire keys: LossConfig.from_mapping.
        (
            "protocol",
            folded,
            LossConfig.from_mapping(protocol_loss_config(loss_fn, config), loss_fn),
        ),
    ):
        client = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / name)
        out = client.forward_backward(batch, loss_fn, cfg).result()
        results.append((out.metrics["loss:sum"], grads_of(client)))
        client.close()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-9)
    assert rel_error(grads_a, grads_b) < REL_TOL


def test_token_metrics_count_only_the_masked_tokens():
    """The server, sent no mask, reports statistics over every token; the client's replace them.

    One datum of 4 tokens, the first two the prompt (mask 0, advantage 0, sampler logprob 0).
    Returned logprobs lp = [-1, -2, -0.5, -1.5], sampler q = [0, 0, -0.5, -1.2], so on the two
    counted tokens r = [e^0, e^-0.3] = [1, 0.740818]: mean 0.870409; with advantages [1, -1]
    PPO's [0.8, 1.2] clips the second (clip(r)·A = -0.8 < r·A = -0.74), clipped_frac 0.5; logprobs
    mean -1.0; entropy mean (3 + 5) / 2 = 4. Over all four tokens the ratio's mean would be
    (e^-1 + e^-2 + 1 + 0.740818) / 4 = 0.54037.
    """
    datum = Datum(
        ModelInput.from_ints([5, 6, 7, 8]),
        {
            "target_tokens": torch.tensor([6, 7, 8, 9]),
            "logprobs": torch.tensor([0.0, 0.0, -0.5, -1.2]),
            "advantages": torch.tensor([0.0, 0.0, 1.0, -1.0]),
            "weights": torch.tensor([0.0, 0.0, 0.5, 0.5]),
            "mask": torch.tensor([0.0, 0.0, 1.0, 1.0]),
        },
    )
    server = ForwardBackwardOutput(
        "ArrayRecord",
        [
            {
                "logprobs": torch.tensor([-1.0, -2.0, -0.5, -1.5]),
                "entropy": torch.tensor([1.0, 2.0, 3.0, 5.0]),
            }
        ],
        {"loss:sum": 0.25, "tokens:sum": 4.0, "ratio:mean": 0.54037, "ratio_p95:max": 1.0},
    )
    metrics = with_token_metrics(server, [datum], "ppo", LossConfig()).metrics
    assert metrics["loss:sum"] == 0.25  # the server's: the loss ignores uncounted tokens anyway
    assert metrics["tokens:sum"] == 2.0
    assert metrics["ratio:mean"] == pytest.approx((1 + math.exp(-0.3)) / 2, rel=1e-6)
    assert metrics["clipped_frac:mean"] == 0.5
    assert metrics["logprobs:mean"] == -1.0
    assert metrics["entropy:mean"] == 4.0
    # ratio_p95 of [0.740818, 1]: 0.740818 + 0.95 * (1 - 0.740818)
    assert metrics["ratio_p95:max"] == pytest.approx(0.740818 + 0.95 * 0.259182, rel=1e-5)
    del server.loss_fn_outputs[0]["entropy"]  # a server that returns none (the Tinker service)
    assert "entropy:mean" not in with_token_metrics(server, [datum], "ppo", LossConfig()).metrics
