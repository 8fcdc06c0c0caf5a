"""bf16: LoRA adapters in fp32 on a bf16 base, logprob agreement with fp32, the TIS warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain import Datum, ModelInput
from posttrain.algo.losses import LossConfig
from posttrain.backends.model import TrainableModel
from posttrain.backends.preflight import precision_mismatch
from posttrain.clients.create import create_training_client
from posttrain.models.tiny import tiny_model_path
from posttrain.trainer.config import RLConfig

# bf16 keeps 8 significant bits: one rounding of a value x is off by at most 2^-9 |x|, and by
# 2^-8 |x| with the one-ulp slack of a fused kernel. The log-softmax runs in fp32
# (algo.logprobs), and the roundings of the matmul operands are independent and average out
# in fp32 accumulations, so a whole bf16 forward is held to one bf16 step of the fp32
# logprob: |logp_bf16 - logp_fp32| <= 2^-8 |logp_fp32| per token. Measured max relative
# errors on random models: 0.05% (tiny), 0.25% (small, 10 layers), 0.22% (qwen2.5-0.5b).
BF16_RELATIVE = 2.0**-8


def batch(rows: int = 4, length: int = 48) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, 250, (length + 1,), generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1].tolist()),
                {"target_tokens": ids[1:], "weights": torch.full((length,), 1.0 / length)},
            )
        )
    return out


def logprobs(path: Path, dtype: str) -> torch.Tensor:
    client = create_training_client(path, lora_rank=8, dtype=dtype, device="cpu")
    out = client.forward(batch(), "cross_entropy").result()
    client.close()
    return torch.cat([o["logprobs"] for o in out.loss_fn_outputs])


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_bf16_logprobs_agree_with_fp32(size: str) -> None:
    path = tiny_model_path(size=size)  # pyright: ignore[reportArgumentType]
    fp32, bf16 = logprobs(path, "float32"), logprobs(path, "bfloat16")
    assert fp32.dtype == bf16.dtype == torch.float32  # reported in fp32 either way
    assert not torch.equal(fp32, bf16)  # the bf16 path really ran
    assert ((bf16 - fp32).abs() <= BF16_RELATIVE * fp32.abs()).all()


def test_lora_trains_fp32_adapters_on_a_bf16_base(tiny_model_dir: Path) -> None:
    client = create_training_client(tiny_model_dir, lora_rank=4, dtype="bfloat16", device="cpu")
    worker = client.dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    trainable = worker.trainable_parameters()
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}
    frozen = {p.dtype for p in worker.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    # The unembedding's fp32 adapter on a bf16 base used to fail here on a dtype mismatch.
    client.forward_backward(batch(2, 16), "cross_entropy").result()
    grads = worker.grads()
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    assert all(bool(torch.isfinite(g).all()) for g in grads.values() if g is not None)
    client.close()


def test_full_fine_tuning_in_half_precision_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="full fine-tuning in bfloat16 would round"):
        create_training_client(tiny_model_dir, lora_rank=None, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"full fine-tuning .* in float16 would round"):
        TrainableModel(name="m", project="p", base_model="x", lora_rank=None, dtype="float16")


def test_precision_mismatch_asks_for_tis() -> None:
    plain = RLConfig()
    tis = RLConfig(
        precalculate_logprobs=True, loss_fn_config=LossConfig(truncated_importance_sampling=2.0)
    )
    assert precision_mismatch("float32", "float32", plain) is None
    # None: the engine samples on the training weights, so the sampler's dtype is the model's.
    assert precision_mismatch("float32", None, plain) is None
    message = precision_mismatch("bfloat16", None, plain)
    assert message is not None and "truncated_importance_sampling" in message
    assert precision_mismatch("float32", "bfloat16", plain) is not None
    assert precision_mismatch("bfloat16", "bfloat16", tis) is None
