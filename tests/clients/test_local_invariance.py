"""Sum semantics on a real tiny model: the gradient does not depend on how a batch is cut.

Tolerance: gradients are compared by relative L2 error. In fp32 a micro-batch split changes
padding and so the shapes of every matmul, which changes the summation order; each gradient
entry sums ~10^2-10^3 products with rounding ~6e-8 each, so errors of a few 1e-7 relative are
expected. We allow 2e-6 (measured: below 5e-7 on this machine); a real bug (a missing or
doubled micro-batch, a mean instead of a sum) shows up as an error of order 1e-1 or more.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algo.losses import LOSSES
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.types import Datum, ModelInput

REL_TOL = 2e-6


def make_datums(loss_fn: str, seed: int = 0, count: int = 7) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 5 + 3 * i % 11
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        inputs: dict[str, torch.Tensor] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(length, generator=gen)
        else:
            # Behaviour logprobs near typical values for a 300-token vocab (log(1/300) = -5.7).
            inputs["logprobs"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
            inputs["advantages"] = torch.randn(length, generator=gen)
            inputs["mask"] = (torch.rand(length, generator=gen) > 0.2).float()
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def grads_of(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    client.dispatch.executor.reduce_gradients()
    worker = client.dispatch.executor.workers[0]  # type: ignore[attr-defined]
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
        for worker in client.dispatch.executor.workers:  # type: ignore[attr-defined]
            worker.zero_grad()

    # Per-datum logprobs come back in the caller's order whatever the split.
    for a, b in zip(out.loss_fn_outputs, out_micro.loss_fn_outputs, strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
