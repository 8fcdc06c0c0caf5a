"""Sum semantics on a real tiny model: the gradient does not depend on how a batch is cut.

Tolerance: gradients are compared by relative L2 error. In fp32 a micro-batch split changes
padding and so the shapes of every matmul, which changes the summation order; each gradient
entry sums ~10^2-10^3 products with rounding ~6e-8 each, so errors of a few 1e-7 relative are
expected. We allow 2e-6 (measured: below 5e-7 on this machine); a real bug (a missing or
doubled micro-batch, a mean instead of a sum) shows up as an error of order 1e-1 or more.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from posttrain.algo.losses import LOSSES
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.protocol import LossConfigValue
from posttrain.engine.executor import InProcessExecutor
from posttrain.types import Datum, ModelInput

REL_TOL = 2e-6
LOSS_ATOL = 1e-5  # see assert_cut_invariant


def make_datums(loss_fn: str, seed: int = 0, count: int = 7) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 5 + 3 * i % 11
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        inputs: dict[str, torch.Tensor] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(length, generator=gen)
        elif loss_fn == "value":  # the critic's loss, here on the policy's logprobs as values
            inputs["returns"] = -5.7 + torch.randn(length, generator=gen)
            inputs["old_values"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
            inputs["value_clip"] = torch.full((length,), 0.2)
            inputs["weights"] = torch.rand(length, generator=gen)
        else:
            # Behaviour logprobs near typical values for a 300-token vocab (log(1/300) = -5.7).
            inputs["logprobs"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
            inputs["advantages"] = torch.randn(length, generator=gen)
            inputs["mask"] = (torch.rand(length, generator=gen) > 0.2).float()
            # For truncated IS and the KL penalty (unused, and unchecked, by the other configs).
            inputs["sampler_logprobs"] = inputs["logprobs"] + 0.2 * torch.randn(
                length, generator=gen
            )
            inputs["ref_logprobs"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def grads_of(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    executor.reduce_gradients()
    worker = executor.workers[0]
    return {n: g.clone() for n, g in worker.grads().items() if g is not None}


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    den = sum(float(a[k].double().norm() ** 2) for k in a)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def clients(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("inv")
    made = {
        "whole": create_training_client(tiny_model_dir, lora_rank=4, storage_dir=base / "a"),
        "micro": create_training_client(
            tiny_model_dir, lora_rank=4, storage_dir=base / "b", micro_batch_tokens=24
        ),
        "dp2": create_training_client(
            tiny_model_dir, lora_rank=4, storage_dir=base / "c", num_workers=2
        ),
        "dp3": create_training_client(
            tiny_model_dir,
            lora_rank=4,
            storage_dir=base / "d",
            num_workers=3,
            micro_batch_tokens=30,
        ),
        "full_whole": create_training_client(
            tiny_model_dir, storage_dir=base / "e", lora_rank=None
        ),
        "full_micro": create_training_client(
            tiny_model_dir, storage_dir=base / "f", micro_batch_tokens=24, lora_rank=None
        ),
    }
    yield made
    for client in made.values():
        client.close()


def config_for(loss_fn: str) -> dict[str, float]:
    return {"beta": 0.1} if loss_fn == "dro" else {}


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_gradient_is_invariant_to_how_the_batch_is_cut(clients, loss_fn):
    datums = make_datums(loss_fn)
    cfg = config_for(loss_fn)
    whole = clients["whole"]
    out = whole.forward_backward(datums, loss_fn, cfg).result()
    reference = grads_of(whole)
    whole.dispatch.executor.workers[0].zero_grad()
    assert sum(float(g.norm()) for g in reference.values()) > 0

    # Many micro-batches inside one call.
    micro = clients["micro"]
    out_micro = micro.forward_backward(datums, loss_fn, cfg).result()
    assert rel_error(reference, grads_of(micro)) < REL_TOL
    micro.dispatch.executor.workers[0].zero_grad()
    assert out_micro.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)

    # Three forward_backward calls before the (would-be) optim_step.
    parts = [datums[:2], datums[2:3], datums[3:]]
    losses = [whole.forward_backward(p, loss_fn, cfg).result().metrics["loss:sum"] for p in parts]
    assert rel_error(reference, grads_of(whole)) < REL_TOL
    assert sum(losses) == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)
    whole.dispatch.executor.workers[0].zero_grad()

    # Data parallel: 2 and 3 replicas (7 datums do not divide evenly), gradients summed.
    for name in ("dp2", "dp3"):
        client = clients[name]
        out_dp = client.forward_backward(datums, loss_fn, cfg).result()
        assert rel_error(reference, grads_of(client)) < REL_TOL, name
        assert out_dp.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)
        for worker in client.dispatch.executor.workers:
            worker.zero_grad()

    # Per-datum logprobs come back in the caller's order whatever the split.
    for a, b in zip(out.loss_fn_outputs, out_micro.loss_fn_outputs, strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)


def assert_cut_invariant(
    whole: LocalTrainingClient,
    micro: LocalTrainingClient,
    datums: list[Datum],
    loss_fn: str,
    cfg: Mapping[str, LossConfigValue],
) -> None:
    """One call on the whole batch == many micro-batches == 3 calls before one optim_step.

    The loss is a signed sum of ~70 per-token terms of size ~1 that can nearly cancel (0.13
    for the ppo case), so its rounding error is absolute: ~1e-7 per term, LOSS_ATOL in all
    (measured up to 2e-6; gradients agree to 2.5e-7 relative); a datum lost or doubled moves it by 1e-2 or more.
    """
    out = whole.forward_backward(datums, loss_fn, cfg).result()
    reference = grads_of(whole)
    whole.dispatch.executor.workers[0].zero_grad()  # pyright: ignore[reportAttributeAccessIssue]
    assert sum(float(g.norm()) for g in reference.values()) > 0
    out_micro = micro.forward_backward(datums, loss_fn, cfg).result()
    assert rel_error(reference, grads_of(micro)) < REL_TOL
    micro.dispatch.executor.workers[0].zero_grad()  # pyright: ignore[reportAttributeAccessIssue]
    loss = pytest.approx(out.metrics["loss:sum"], rel=REL_TOL, abs=LOSS_ATOL)
    assert out_micro.metrics["loss:sum"] == loss
    parts = [datums[:2], datums[2:3], datums[3:]]
    losses = [whole.forward_backward(p, loss_fn, cfg).result().metrics["loss:sum"] for p in parts]
    assert rel_error(reference, grads_of(whole)) < REL_TOL
    assert sum(losses) == loss
    whole.dispatch.executor.workers[0].zero_grad()  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_full_fine_tuning_gradient_is_invariant_to_the_cut(clients, loss_fn):
    """As above with every weight trainable (embeddings, norms, lm_head included)."""
    datums = make_datums(loss_fn, seed=1)
    assert_cut_invariant(
        clients["full_whole"], clients["full_micro"], datums, loss_fn, config_for(loss_fn)
    )


# Non-default options, each through the code it switches on: the ART-style clip range (wide
# enough high side that ratios near exp(±0.5) clip on both sides), sequence-level ratios
# (GSPO-token; a per-row mean), truncated IS against sampler logprobs, and the KL penalty in
# loss and in advantage mode (a per-row centring).
OPTION_CASES = [
    ("ppo", {"epsilon": 0.1, "epsilon_high": 0.3}),
    ("ppo", {"importance_sampling_level": "sequence", "epsilon": 0.2}),
    ("importance_sampling", {"importance_sampling_level": "sequence"}),
    ("ppo", {"truncated_importance_sampling": 1.5}),
    ("cispo", {"truncated_importance_sampling": 1.2, "importance_sampling_level": "average"}),
    ("ppo", {"kl_penalty_coef": 0.2}),
    ("importance_sampling", {"kl_penalty_coef": 0.2, "kl_mode": "advantage"}),
    ("gspo", {"kl_penalty_coef": 0.1, "kl_estimator": "k1"}),
]


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize(("loss_fn", "cfg"), OPTION_CASES, ids=lambda v: str(v))
def test_loss_options_keep_the_gradient_invariant(clients, loss_fn, cfg, full):
    datums = make_datums(loss_fn, seed=2)
    names = ("full_whole", "full_micro") if full else ("whole", "micro")
    assert_cut_invariant(clients[names[0]], clients[names[1]], datums, loss_fn, cfg)
