"""LocalBackend on CUDA, through the paths a first RL/SFT/DPO run takes: a KL penalty against
the reference (LoRA off, or the frozen copy of a fully fine-tuned model), PPO with a critic,
SFT, DPO, and a checkpoint that a new backend resumes from.

Each first step is compared with the same step on the CPU. The loss and KL are sums of fp32
logprob terms computed by other kernels: tests/cuda/test_cuda_parity.py's 2e-5 relative bound.
"""

from __future__ import annotations

import pytest
from cuda_helpers import report

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.preferences import PreferencePair
from posttrain.types import TrainResult

FP32_TOL = 2e-5


def model_for(tiny_model_dir, name: str, rank: int | None) -> TrainableModel:
    return TrainableModel(name=name, project="gpu", base_model=str(tiny_model_dir), lora_rank=rank)


async def first_steps(tiny_model_dir, tmp_path, rank: int | None) -> dict[str, TrainResult]:
    results = {}
    for device in ("cpu", "cuda"):
        backend = LocalBackend(tmp_path / device, device=device)
        model = model_for(tiny_model_dir, "kl", rank)
        await model.register(backend)
        results[device] = await backend.train(
            model, synthetic_groups(0), learning_rate=1e-3, loss="ppo", kl_penalty_coef=0.5
        )
        await backend.close()
    return results


@pytest.mark.parametrize("rank", [4, None], ids=["lora", "full"])
async def test_a_kl_penalised_step_matches_the_cpu(tiny_model_dir, tmp_path, rank):
    results = await first_steps(tiny_model_dir, tmp_path, rank)
    cpu, cuda = results["cpu"].metrics, results["cuda"].metrics
    keys = ("loss", "kl", "logprobs", "entropy", "grad_norm")
    # Relative, except near zero (the KL of a policy that is still its reference): there the
    # bound is absolute, 2e-5 x 1e-2.
    gaps = {k: abs(cpu[k] - cuda[k]) / max(abs(cpu[k]), 1e-2) for k in keys}
    report(f"backend kl step cpu vs cuda {'lora' if rank else 'full'}", **gaps, bound=FP32_TOL)
    assert all(gap <= FP32_TOL for gap in gaps.values()), (cpu, cuda)


async def test_ppo_with_a_critic_sft_and_dpo_run_and_resume_on_cuda(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path, device="cuda")
    model = model_for(tiny_model_dir, "all", 4)
    await model.register(backend)
    gae = await backend.train(
        model,
        synthetic_groups(1),
        learning_rate=1e-3,
        loss="ppo",
        advantage_estimator="gae",
        critic_learning_rate=1e-2,
        num_minibatches=2,
    )
    assert "critic/value_loss" in gae.metrics
    critic = backend.critic_client(model)
    assert critic is not None
    worker = critic.dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    assert {p.device.type for p in worker.model.parameters()} == {"cuda"}
    trajectories = [t for g in synthetic_groups(2) for t in g.trajectories]
    sft = await backend.train_sft(model, trajectories, learning_rate=1e-3, batch_size=4)
    assert sft.metrics["num_trajectories"] == len(trajectories)
    pairs = [PreferencePair((104, 101, 108, i + 48), (97, 98, 99), (120, 121)) for i in range(4)]
    dpo = await backend.train_dpo(model, pairs, beta=0.1, learning_rate=1e-3, batch_size=2)
    assert dpo.metrics["num_pairs"] == 4
    assert model.step == 3
    await backend.close()

    again = LocalBackend(tmp_path, device="cuda")
    resumed = model_for(tiny_model_dir, "all", 4)
    await resumed.register(again)
    assert resumed.step == 3  # the DPO step's checkpoint, loaded onto the GPU
    step = await again.train(resumed, synthetic_groups(3), learning_rate=1e-3, loss="ppo")
    assert step.step == 4
    await again.close()
