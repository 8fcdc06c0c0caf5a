"""engine.fsdp without Ray: a `WorkerHost` sharding its worker with FSDP2 as the only rank of a
gloo group in this process. Two ranks (parity with one process, uneven pieces gathered to rank
0 for checkpoints) are tested in tests/clients/test_ray_fsdp.py.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from check_counting import count_checks, rows
from torch.distributed.tensor import DTensor

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import WorkerSpec
from posttrain.engine.executor import LoadRequest, PassShard, SaveRequest
from posttrain.engine.ray.actor import WorkerHost, store_directory
from posttrain.engine.ray.fsdp import ShardedWorker
from posttrain.engine.worker import WorkerConfig
from posttrain.models.load import LoraSettings, causal_lm
from posttrain.types import AdamParams, Datum, ModelInput


def datum(length: int, seed: int) -> Datum:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (length + 1,), generator=gen)
    return Datum(
        ModelInput.from_ints(ids[:-1].tolist()),
        {"target_tokens": ids[1:], "weights": torch.rand(length, generator=gen)},
    )


@contextlib.contextmanager
def sharded_host(spec: WorkerSpec) -> Iterator[WorkerHost]:
    """The only rank of a gloo group in this process, sharding `spec`'s worker with FSDP2."""
    made = WorkerHost(0, 1, spec.build, 1, True, "fsdp2", spec.on_cpu().build)
    made.build()
    rendezvous = made.create_store()
    made.join_group(rendezvous, "gloo", 30.0)
    try:
        yield made
    finally:
        dist.destroy_process_group()
        directory = store_directory(rendezvous)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def host(tiny_model_dir) -> Iterator[WorkerHost]:
    spec = WorkerSpec(
        str(tiny_model_dir), None, "cpu", "float32", WorkerConfig(micro_batch_tokens=16), seed=0
    )
    with sharded_host(spec) as made:
        yield made


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def sharded(host: WorkerHost) -> ShardedWorker:
    assert host._sharded is not None
    return host._sharded


def test_micro_batches_are_planned_longest_first(host, tiny_model_dir, monkeypatch):
    datums = [datum(n, seed) for seed, n in enumerate((8, 2, 2, 8, 2, 2))]
    passes: list[int] = []
    sharded(host).decoder.register_forward_pre_hook(lambda *_: passes.append(1))
    config = LossConfig.from_mapping({})
    counts = count_checks(monkeypatch)
    result = host.forward_backward(PassShard(datums, "cross_entropy", config))
    # Checked whole, once, before the first micro-batch; the micro-batches are not checked.
    assert counts.call == rows(datums) and counts.values == rows(datums)
    # Budget 16 padded tokens (rows x longest). In call order: [8, 2] (16), [2, 8] (16),
    # [2, 2] (4): 3 passes. Longest first: [8, 8] (16), [2, 2, 2, 2] (8): 2 passes.
    assert len(passes) == 2
    # Results come back in the caller's order: as one plain worker computes them (the same
    # fp32 kernels on the same rows; 1e-6 covers a different row grouping's rounding).
    plain = WorkerSpec(str(tiny_model_dir), None, "cpu", "float32", WorkerConfig(), seed=0).build()
    expected = plain.forward_backward(datums, "cross_entropy", config)
    for got, want in zip(result.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_checkpoint_replica_is_on_the_cpu_and_keeps_no_moments(host, tmp_path):
    config = LossConfig.from_mapping({})
    host.forward_backward(PassShard([datum(6, 0), datum(4, 1)], "cross_entropy", config))
    host.optim_step(AdamParams())
    params = host.worker.trainable_parameters()
    moments = {n: whole(host.worker.optimizer.state[p]["exp_avg"]) for n, p in params.items()}
    path = host.save_state(SaveRequest(tmp_path / "ckpt", True, {}))
    mirror = sharded(host).checkpoints.mirror()
    assert mirror.config.device == "cpu"
    assert all(p.device.type == "cpu" for p in mirror.model.parameters())
    assert not mirror.optimizer.state  # whole moments written, then dropped
    host.worker.optimizer.state.clear()
    assert path is not None
    host.load_state(LoadRequest(path, True))
    assert not mirror.optimizer.state
    # The moments came back from the checkpoint, sharded like their parameters.
    for name, want in moments.items():
        got = whole(host.worker.optimizer.state[params[name]]["exp_avg"])
        assert torch.equal(got, want), name


@pytest.mark.parametrize("lora", [None, LoraSettings(rank=4, train_unembed=True)])
def test_a_tied_embedding_stays_tied_and_replicated(tied_model_dir, tmp_path, lora):
    """Sharded, the embedding tied to the unembedding would get new parameters while the
    unembedding kept the old ones: full fine-tuning then trained two matrices (logprobs 0.29 off
    a plain worker's after one step) and its save missed lm_head.weight; a tied LoRA read its
    factors as shards. Kept replicated, a step is the plain worker's and the state round-trips."""
    spec = WorkerSpec(
        str(tied_model_dir), lora, "cpu", "float32", WorkerConfig(micro_batch_tokens=64), seed=0
    )
    with sharded_host(spec) as made:
        lm: Any = causal_lm(made.worker.model)
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
        plain = spec.build()
        config = LossConfig.from_mapping({})
        data = [datum(6, 0), datum(4, 1)]
        for _ in range(2):
            got = made.forward_backward(PassShard(data, "cross_entropy", config))
            want = plain.forward_backward(data, "cross_entropy", config)
            for a, b in zip(got.logprobs, want.logprobs, strict=True):  # pyright: ignore[reportAttributeAccessIssue, reportOptionalMemberAccess]
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            made.optim_step(AdamParams(learning_rate=1e-2))
            plain.optim_step(AdamParams(learning_rate=1e-2))
        before = {n: whole(p) for n, p in made.worker.trainable_parameters().items()}
        path = made.save_state(SaveRequest(tmp_path / "ckpt", True, {}))
        assert path is not None
        with torch.no_grad():
            for param in made.worker.trainable_parameters().values():
                param.zero_()
        made.load_state(LoadRequest(path, True))
        for name, param in made.worker.trainable_parameters().items():
            assert torch.equal(whole(param), before[name]), name
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
