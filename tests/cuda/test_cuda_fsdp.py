"""FSDP2 over NCCL on the GPU, without Ray: a `WorkerHost` shards its worker as the only rank of
an NCCL group in this process (tests/engine/test_fsdp.py does the same over gloo on the CPU).

One rank holds whole shards, so the sharded step is the plain worker's step computed by other
code (DTensor parameters, FSDP2's hooks and reduce-scatter): the same fp32 kernels on the same
rows, hence tests/engine/test_fsdp.py's 1e-6 for logprobs and 2e-6 relative for gradients
(tests/clients/test_local_invariance.py's bound) and a bit-exact checkpoint after the step.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from cuda_helpers import rel_error, report, sft_datums

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import WorkerSpec
from posttrain.engine.executor import PassShard, SaveRequest
from posttrain.engine.ray.actor import WorkerHost, store_directory
from posttrain.engine.worker import WorkerConfig
from posttrain.types import AdamParams


def spec(tiny_model_dir) -> WorkerSpec:
    config = WorkerConfig(micro_batch_tokens=64, device="cuda")
    return WorkerSpec(str(tiny_model_dir), None, "cuda", "float32", config, seed=0)


@pytest.fixture
def host(tiny_model_dir) -> Iterator[WorkerHost]:
    torch.cuda.set_device(0)
    made_spec = spec(tiny_model_dir)
    made = WorkerHost(0, 1, made_spec.build, 4, True, "fsdp2", made_spec.on_cpu().build)
    made.build()
    rendezvous = made.create_store()
    made.join_group(rendezvous, "nccl", 60.0)
    yield made
    dist.destroy_process_group()
    directory = store_directory(rendezvous)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def test_fsdp2_over_nccl_matches_a_plain_gpu_worker(host, tiny_model_dir, tmp_path):
    assert dist.get_backend() == "nccl"
    datums = sft_datums()
    config = LossConfig.from_mapping({})
    sharded = host.forward_backward(PassShard(datums, "cross_entropy", config))
    host.reduce_gradients()
    plain = spec(tiny_model_dir).build()
    expected = plain.forward_backward(datums, "cross_entropy", config)
    got = torch.cat([lp.cpu() for lp in sharded.logprobs])
    want = torch.cat([lp.cpu() for lp in expected.logprobs])
    grads = {n: g for n, g in host.full_tensors("grads").items() if g is not None}
    plain_grads = {
        n: p.grad.cpu() for n, p in plain.trainable_parameters().items() if p.grad is not None
    }
    figures = {
        "logprob_max_abs": float((got - want).abs().max()),
        "grad_rel": rel_error(plain_grads, grads),
    }
    report("fsdp2 nccl 1 rank vs plain cuda worker", **figures)
    assert figures["logprob_max_abs"] <= 1e-6
    assert figures["grad_rel"] <= 2e-6

    # A step, then a checkpoint gathered whole on rank 0's CPU replica, as a cluster writes it.
    host.optim_step(AdamParams(learning_rate=1e-3))
    path = host.save_state(SaveRequest(tmp_path / "ckpt", True, {}))
    assert path is not None
    loaded = WorkerSpec(
        str(tiny_model_dir), None, "cpu", "float32", WorkerConfig(device="cpu"), seed=0
    ).build()
    loaded.load_state(path, with_optimizer=False)
    after = host.full_tensors("weights")
    for name, param in loaded.trainable_parameters().items():
        assert torch.equal(param.detach(), after[name]), name
