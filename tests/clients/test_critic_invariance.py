"""A critic's gradient does not depend on how its batch is cut: one call, many micro-batches,
several calls before the optimizer step, or 2 data-parallel replicas.

The critic (`head="value"`) runs the policy's pass with a scalar head, so the tolerance is the
policy's (tests/clients/test_local_invariance.py): fp32 summation order only, measured below
5e-7 relative; 2e-6 allowed, far below what a lost or doubled micro-batch does (~1e-1).
The zero-initialised head would give the decoder no gradient, so each test first sets the
head to the same random values on every replica.
"""

from __future__ import annotations

import pytest
import torch
from test_local_invariance import REL_TOL, grads_of, rel_error

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.executor import InProcessExecutor
from posttrain.types import Datum, ModelInput


def value_datums(seed: int = 0, count: int = 7) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 5 + 3 * i % 11
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        inputs = {
            "target_tokens": tokens[1:],
            "returns": torch.randn(length, generator=gen),
            "old_values": 0.3 * torch.randn(length, generator=gen),
            "value_clip": torch.full((length,), 0.2),
            "weights": torch.rand(length, generator=gen),
            "mask": (torch.rand(length, generator=gen) > 0.2).float(),
        }
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def set_head(client: LocalTrainingClient, seed: int) -> None:
    """The trainable value head of every replica set to the same random values."""
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    for worker in executor.workers:
        gen = torch.Generator().manual_seed(seed)
        heads = [
            p for n, p in worker.model.named_parameters() if "lm_head" in n and p.requires_grad
        ]
        assert len(heads) == 2  # weight [1, H] and bias [1]
        with torch.no_grad():
            for p in heads:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def zero(client: LocalTrainingClient) -> None:
    for worker in client.dispatch.executor.workers:  # pyright: ignore[reportAttributeAccessIssue]
        worker.zero_grad()


@pytest.mark.parametrize("lora_rank", [None, 4], ids=["full", "lora"])
def test_critic_gradient_is_invariant_to_the_cut(tiny_model_dir, tmp_path, lora_rank):
    def critic(name: str, **kwargs: object) -> LocalTrainingClient:
        made = create_training_client(  # pyright: ignore[reportCallIssue]
            tiny_model_dir,
            lora_rank=lora_rank,
            head="value",
            storage_dir=tmp_path / name,
            **kwargs,  # pyright: ignore[reportArgumentType]
        )
        set_head(made, seed=1)
        return made

    whole, micro, dp2 = critic("a"), critic("b", micro_batch_tokens=24), critic("c", num_workers=2)
    datums = value_datums()
    out = whole.forward_backward(datums, "value").result()
    reference = grads_of(whole)
    zero(whole)
    decoder = [k for k in reference if "lm_head" not in k]
    assert decoder and sum(float(reference[k].norm()) for k in decoder) > 0
    assert out.metrics["value_clipped:mean"] > 0  # the clip is part of what is compared

    out_micro = micro.forward_backward(datums, "value").result()
    assert rel_error(reference, grads_of(micro)) < REL_TOL
    assert out_micro.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)

    parts = [datums[:2], datums[2:3], datums[3:]]
    losses = [whole.forward_backward(p, "value").result().metrics["loss:sum"] for p in parts]
    assert rel_error(reference, grads_of(whole)) < REL_TOL
    assert sum(losses) == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)

    out_dp = dp2.forward_backward(datums, "value").result()
    assert rel_error(reference, grads_of(dp2)) < REL_TOL
    assert out_dp.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=REL_TOL)
    # The values come back per datum, in the caller's order, whatever the split.
    for a, b in zip(out.loss_fn_outputs, out_dp.loss_fn_outputs, strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    for client in (whole, micro, dp2):
        client.close()
