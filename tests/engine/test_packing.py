"""Packed micro-batches (engine.packing): the plan, the packed layout, and logprobs, losses and
gradients equal to the unpacked pass with no attention across documents."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_shared_prefix import lora_model, rel

from posttrain.algo.losses import LossConfig
from posttrain.engine.packing import PackedRows, pack_datums, plan_packed
from posttrain.engine.worker import PassResult, Worker, WorkerConfig
from posttrain.models.load import load_hf_model
from posttrain.types import Datum, ModelInput

# fp32 tolerance: packed, each matrix product sees other rows and the attention other (masked)
# keys, so sums run in another order: a few float32 roundings per layer. Measured on the tiny
# model up to 2.7e-7 relative on a gradient and 9.5e-7 absolute on a logprob (magnitude ~5).
REL_TOL = 2e-6
LOGPROB_ATOL = 5e-6
# Documents from 3 to 300 tokens: 100x apart, so rows hold several short ones beside a long one.
LENGTHS = (3, 300, 17, 120, 5, 64, 250, 9, 33, 4)


def documents(lengths=LENGTHS, seed: int = 0, vocab: int = 256) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, vocab, (n + 1,), generator=gen).tolist()
        weights = torch.rand(n, generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights}
            )
        )
    return out


def test_rows_are_filled_first_fit_longest_first_within_the_longest():
    # Width 5 (the longest). Longest first: 0 (5) opens row A; 3 (4) opens B; 1 (3) fits in
    # neither (5+3, 4+3 > 5) and opens C; 2 (2) fills C to 5; 4 (1) fills B to 5. Two rows of 5
    # fit a budget of 10, so A and B share a micro-batch and C goes alone.
    assert plan_packed([5, 3, 2, 4, 1], budget=10) == [[[0], [3, 4]], [[1, 2]]]


def test_a_budget_below_the_longest_still_runs_one_row_per_micro_batch():
    # Width 4: 0 fills row A; 2 (2) opens B, and 1 (1) joins it (A is full).
    assert plan_packed([4, 1, 2], budget=3) == [[[0]], [[2, 1]]]
    assert plan_packed([], budget=8) == []
    with pytest.raises(ValueError, match="budget must be >= 1"):
        plan_packed([1], budget=0)


def test_positions_restart_at_each_document_and_the_tail():
    datums = documents((3, 2, 4))
    packed = pack_datums(datums, PackedRows(((2,), (0, 1))))
    assert packed.position_ids_RW.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert packed.input_ids_RW[1, :3].tolist() == datums[0].model_input.to_ints()
    assert packed.input_ids_RW[1, 3:].tolist() == datums[1].model_input.to_ints()
    # Unpacking puts each datum's tokens back in its own row, zeros after its end.
    values = torch.arange(10.0).reshape(2, 5)
    assert packed.unpack(values).tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [0, 1, 2, 3]]


def run(model_dir: Path, kind: str, datums, loss: str = "cross_entropy", **config):
    model = load_hf_model(model_dir) if kind == "full" else lora_model(model_dir)
    worker = Worker(model, WorkerConfig(**config))
    result = worker.forward_backward(datums, loss, LossConfig())
    grads = {
        n: p.grad.clone() for n, p in worker.trainable_parameters().items() if p.grad is not None
    }
    return result, grads


def assert_same(packed: tuple[PassResult, dict], plain: tuple[PassResult, dict]) -> None:
    (result, grads), (result_plain, grads_plain) = packed, plain
    assert result.num_tokens == result_plain.num_tokens
    assert result.loss_sum == pytest.approx(result_plain.loss_sum, rel=REL_TOL)
    for lp, lp_plain in zip(result.logprobs, result_plain.logprobs, strict=True):
        assert lp.shape == lp_plain.shape
        torch.testing.assert_close(lp, lp_plain, rtol=0, atol=LOGPROB_ATOL)
    assert result.entropies is not None and result_plain.entropies is not None
    for e, e_plain in zip(result.entropies, result_plain.entropies, strict=True):
        torch.testing.assert_close(e, e_plain, rtol=0, atol=LOGPROB_ATOL)
    assert grads.keys() == grads_plain.keys() and grads
    for name, grad in grads.items():
        assert grads_plain[name].norm() > 0, name
        assert rel(grad, grads_plain[name]) < REL_TOL, name


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_packed_pass_gives_the_unpacked_logprobs_loss_and_every_gradient(tiny_model_dir, kind):
    datums = documents()
    packed = run(tiny_model_dir, kind, datums, packing=True, micro_batch_tokens=700)
    plain = run(tiny_model_dir, kind, datums, packing=False, micro_batch_tokens=700)
    assert_same(packed, plain)


def test_a_per_sequence_loss_sees_the_unpacked_layout(tiny_model_dir):
    # GSPO's ratio is a per-sequence mean: packed logprobs are unpacked before any loss runs.
    datums = [
        Datum(
            d.model_input,
            {
                **d.loss_fn_inputs,
                "logprobs": torch.full((d.length,), -5.0),
                "advantages": d.loss_fn_inputs["weights"] - 0.5,
            },
        )
        for d in documents()
    ]
    datums = [
        Datum(d.model_input, {k: v for k, v in d.loss_fn_inputs.items() if k != "weights"})
        for d in datums
    ]
    packed = run(tiny_model_dir, "full", datums, loss="gspo", packing=True)
    plain = run(tiny_model_dir, "full", datums, loss="gspo", packing=False)
    assert_same(packed, plain)


def test_the_token_budget_does_not_change_the_result(tiny_model_dir):
    datums = documents()
    reference = run(tiny_model_dir, "full", datums, packing=True, micro_batch_tokens=100_000)
    for budget in (1, 300, 650):
        assert_same(
            run(tiny_model_dir, "full", datums, packing=True, micro_batch_tokens=budget), reference
        )


def test_no_token_attends_across_documents(tiny_model_dir):
    worker = Worker(load_hf_model(tiny_model_dir), WorkerConfig(packing=True))
    datums = documents()
    changed = list(datums)
    other = documents(seed=1)[3]  # 120 tokens, as datums[3]: the plan stays the same
    changed[3] = Datum(other.model_input, datums[3].loss_fn_inputs)
    before = worker.forward(datums, "cross_entropy", LossConfig()).logprobs
    after = worker.forward(changed, "cross_entropy", LossConfig()).logprobs
    assert not torch.equal(before[3], after[3])
    for i in range(len(datums)):
        if i != 3:  # masked keys add exp(-inf) = 0: the other documents' sums do not move
            assert torch.equal(before[i], after[i]), i


def test_bf16_packed_matches_bf16_unpacked(tiny_model_dir):
    # posttrain_sdpa runs bf16 attention in float32 on the CPU while training; the linear layers
    # stay bf16, whose products round to 8 bits of mantissa (2^-8 = 4e-3 relative): a kernel
    # that blocks its sums by the row layout may round differently packed and unpacked, so the
    # bound is bf16 rounding of a logit (~10 x 4e-3), not fp32. Measured: equal bit for bit.
    datums = documents()
    results = []
    for packing in (True, False):
        worker = Worker(
            load_hf_model(tiny_model_dir, dtype="bfloat16"), WorkerConfig(packing=packing)
        )
        results.append(worker.forward_backward(datums, "cross_entropy", LossConfig()))
    packed, plain = results
    assert packed.loss_sum == pytest.approx(plain.loss_sum, rel=4e-3)
    for lp, lp_plain in zip(packed.logprobs, plain.logprobs, strict=True):
        torch.testing.assert_close(lp, lp_plain, rtol=0, atol=0.1)
