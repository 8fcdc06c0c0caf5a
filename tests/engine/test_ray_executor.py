"""RayExecutor pieces that need no running Ray: configuration, the missing-extra error,
gradient buckets, and the checks `create_training_client` makes before starting anything.

A `WorkerHost` also runs here, in this process, as the only rank of a gloo group. The
executor itself (actors, all-reduce, failures) is tested against one in-process worker
in tests/clients/test_ray_client.py, on one shared local Ray.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import WorkerSpec, create_training_client
from posttrain.engine.ray_actor import WorkerHost, _buckets
from posttrain.engine.ray_executor import RayConfig
from posttrain.engine.ray_session import import_ray
from posttrain.engine.worker import WorkerConfig
from posttrain.types import Datum, ModelInput


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources_per_worker": {"CPU": -1.0}}, r"resources_per_worker\['CPU'\] must be >= 0"),
        ({"num_threads_per_worker": 0}, "num_threads_per_worker must be >= 1"),
        ({"backend": "mpi"}, "backend must be 'auto', 'gloo' or 'nccl'"),
        ({"collective_timeout_s": 0.0}, "collective_timeout_s must be > 0"),
        ({"startup_timeout_s": -5.0}, "startup_timeout_s must be > 0"),
        ({"call_timeout_s": 0.0}, "call_timeout_s must be > 0"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayConfig(**kwargs)


def test_threads_follow_the_cpus_granted():
    assert RayConfig().threads() == 1
    assert RayConfig(resources_per_worker={"CPU": 4.0}).threads() == 4
    assert RayConfig(resources_per_worker={"CPU": 0.5}).threads() == 1
    assert RayConfig(resources_per_worker={"CPU": 4.0}, num_threads_per_worker=2).threads() == 2


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[ray\]'"):
        import_ray()


def test_buckets_keep_order_and_bound_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 10, 2, 2)]
    buckets = _buckets(params, max_numel=7)
    # 3+4 = 7 fits; 10 alone exceeds the bound and gets its own bucket; then 2+2.
    assert [[p.numel() for p in b] for b in buckets] == [[3, 4], [10], [2, 2]]
    assert [p for b in buckets for p in b] == params


def test_ray_options_need_the_ray_executor(tiny_model_dir):
    with pytest.raises(ValueError, match="need executor='ray'"):
        create_training_client(tiny_model_dir, address="auto")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="executor must be 'local' or 'ray'"):
        create_training_client(tiny_model_dir, executor="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'GPU' share"):
        create_training_client(tiny_model_dir, executor="ray", device="cuda")


def test_worker_host_as_the_only_rank(tiny_model_dir):
    spec = WorkerSpec(str(tiny_model_dir), None, "cpu", "float32", WorkerConfig(), seed=0)
    host = WorkerHost(0, 1, spec.build, torch.get_num_threads(), loopback=True)
    host.build()
    rendezvous = host.create_store()
    assert rendezvous.startswith("file://")  # one machine: no listening socket at all
    host.join_group(rendezvous, "gloo", 30.0)
    try:
        datum = Datum(
            ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
        )
        host.call("forward_backward", ([datum], "cross_entropy", LossConfig.from_mapping({})))
        params = host.worker.trainable_parameters()
        untouched = next(iter(params))
        params[untouched].grad = None
        before = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        host.reduce_gradients()
        # A gradient absent on every rank stays absent (AdamW then leaves that weight alone);
        # the others are the sum over one rank, i.e. unchanged.
        assert params[untouched].grad is None
        assert all(torch.equal(params[n].grad, g) for n, g in before.items())  # type: ignore[arg-type]
        digest = host.weight_digest()
        assert len(digest) == 64 and digest == host.weight_digest()
    finally:
        dist.destroy_process_group()
