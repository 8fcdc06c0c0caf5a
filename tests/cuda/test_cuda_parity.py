"""CPU vs CUDA through the public client: the same seed, data and loss give the same logprobs,
losses and gradients, for LoRA and full fine-tuning.

Tolerance (fp32): the two devices run different GEMM and attention kernels, so every sum is
accumulated in another order (and cuBLAS may split K). One fp32 rounding is 2^-24 = 6e-8
relative; the tiny model's longest accumulation is its MLP (K = 256), so a sum is off by about
sqrt(256) x 6e-8 = 1e-6 relative, and a few layers compound that to a few 1e-6. We allow 2e-5
(relative for gradients and the loss, absolute for logprobs of magnitude ~5.6): 10x headroom
over the estimate, while a real device bug (a mask lost in a copy, a micro-batch dropped, a bf16
kernel where fp32 was asked, TF32 matmuls at 2^-11 = 5e-4) is 1e-4 or far more. TF32 must be
off for this to hold, and it is torch's default: the test checks it.

bf16 (LoRA on a bf16 base, on CUDA) against fp32 on the CPU is held to tests/engine/test_bf16.py's
bound, one bf16 step of the fp32 logprob: |logp_bf16 - logp_fp32| <= 2^-8 |logp_fp32|.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cuda_helpers import rel_error, report, rl_datums, sft_datums

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.executor import InProcessExecutor

FP32_TOL = 2e-5
BF16_RELATIVE = 2.0**-8
KINDS = {"lora": 8, "full": None}


def grads_of(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    grads = {
        n: g.detach().cpu().clone() for n, g in executor.workers[0].grads().items() if g is not None
    }
    executor.workers[0].zero_grad()
    return grads


@pytest.fixture(scope="module")
def pairs(tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, tuple[LocalTrainingClient, ...]]]:
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls would break the fp32 bound"
    base = tmp_path_factory.mktemp("parity")
    made = {
        kind: tuple(
            create_training_client(
                tiny_model_dir, lora_rank=rank, device=device, storage_dir=base / f"{kind}-{device}"
            )
            for device in ("cpu", "cuda")
        )
        for kind, rank in KINDS.items()
    }
    yield made
    for clients in made.values():
        for client in clients:
            client.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_same_seed_gives_the_same_weights_on_both_devices(pairs, kind):
    cpu, cuda = pairs[kind]
    a, b = cpu.trainable_weights().result(), cuda.trainable_weights().result()
    assert a.keys() == b.keys()
    # LoRA's A matrices are drawn on the CPU from the seed whatever the device, so a run is
    # reproducible across devices; full fine-tuning starts from the checkpoint's bits.
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logprobs_losses_and_gradients_match_the_cpu(pairs, kind, loss_fn):
    cpu, cuda = pairs[kind]
    datums = sft_datums() if loss_fn == "cross_entropy" else rl_datums()
    out_cpu = cpu.forward_backward(datums, loss_fn).result()
    out_cuda = cuda.forward_backward(datums, loss_fn).result()
    g_cpu, g_cuda = grads_of(cpu), grads_of(cuda)
    logp_cpu = torch.cat([o["logprobs"] for o in out_cpu.loss_fn_outputs])
    logp_cuda = torch.cat([o["logprobs"] for o in out_cuda.loss_fn_outputs])
    loss_cpu, loss_cuda = out_cpu.metrics["loss:sum"], out_cuda.metrics["loss:sum"]
    figures = {
        "logprob_max_abs": float((logp_cpu - logp_cuda.cpu()).abs().max()),
        "loss_rel": abs(loss_cpu - loss_cuda) / abs(loss_cpu),
        "grad_rel": rel_error(g_cpu, g_cuda),
    }
    report(f"cpu-vs-cuda fp32 {kind} {loss_fn}", **figures, bound=FP32_TOL)
    assert sum(float(g.norm()) for g in g_cpu.values()) > 0  # the comparison is not of zeros
    assert logp_cuda.device.type == "cpu"  # outputs come back on the CPU whatever the device
    assert all(value <= FP32_TOL for value in figures.values()), figures


def test_bf16_lora_on_cuda_stays_within_one_bf16_step_of_fp32(tiny_model_dir, pairs, tmp_path):
    cpu, _ = pairs["lora"]
    datums = sft_datums(seed=1)
    fp32 = torch.cat(
        [o["logprobs"] for o in cpu.forward(datums, "cross_entropy").result().loss_fn_outputs]
    )
    client = create_training_client(
        tiny_model_dir, lora_rank=8, dtype="bfloat16", device="cuda", storage_dir=tmp_path
    )
    try:
        out = client.forward(datums, "cross_entropy").result()
    finally:
        client.close()
    bf16 = torch.cat([o["logprobs"] for o in out.loss_fn_outputs])
    relative = float(((bf16 - fp32).abs() / fp32.abs()).max())
    report("cpu fp32 vs cuda bf16 lora logprobs", max_relative=relative, bound=BF16_RELATIVE)
    assert bf16.dtype == torch.float32  # reported in fp32 either way
    assert not torch.equal(bf16, fp32)  # the bf16 path really ran
    assert relative <= BF16_RELATIVE
