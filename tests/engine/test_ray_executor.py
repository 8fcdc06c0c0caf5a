"""RayExecutor pieces that need no running Ray: configuration, the missing-extra error,
gradient buckets, what each host method declares (which calls may fail without retiring a
group, which need every rank), and the checks `create_training_client` makes before starting
anything.

A `WorkerHost` also runs here, in this process, as the only rank of a gloo group. The
executor itself (actors, all-reduce, failures) is tested against one in-process worker in
tests/clients/test_ray_client.py, FSDP2 in test_ray_fsdp.py, and the local Ray's lifecycle
in test_ray_lifecycle.py.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from check_counting import count_checks, rows

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import WorkerSpec, create_training_client
from posttrain.engine.executor import Executor, LoadRequest, PassShard
from posttrain.engine.ray.actor import WorkerHost, _buckets
from posttrain.engine.ray.executor import RayConfig, RayExecutor
from posttrain.engine.ray.rank_calls import Rejected, kind_of
from posttrain.engine.ray.session import import_ray
from posttrain.engine.worker import WorkerConfig
from posttrain.types import Datum, ModelInput


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources_per_worker": {"CPU": -1.0}}, r"resources_per_worker\['CPU'\] must be >= 0"),
        ({"num_threads_per_worker": 0}, "num_threads_per_worker must be >= 1"),
        ({"backend": "mpi"}, "backend must be 'auto', 'gloo' or 'nccl'"),
        ({"sharding": "zero3"}, "sharding must be 'replicate' or 'fsdp2'"),
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


def test_every_call_is_bounded_by_default():
    assert RayConfig().call_timeout_s < float("inf")


def declared(method: Callable[..., object]) -> bool:
    try:
        kind_of(method)
    except TypeError:
        return False
    return True


def test_every_host_method_declares_how_it_is_called():
    # The executor reads what it needs from the method it calls: an undeclared one would fail
    # at its first call, on a cluster.
    methods = dict(inspect.getmembers(WorkerHost, inspect.isfunction))
    public = [name for name in methods if not name.startswith("_")]
    assert len(public) > 20
    assert [name for name in public if not declared(methods[name])] == []
    assert not declared(WorkerHost._agree)  # an internal step: the executor never calls it


def test_only_calls_that_change_nothing_may_fail_without_retiring_the_group():
    # A worker's exception in any of these may have left some ranks changed and not others.
    updates = [WorkerHost.forward_backward, WorkerHost.optim_step, WorkerHost.reduce_gradients]
    updates += [WorkerHost.load_state, WorkerHost.move, WorkerHost.set_logprob_chunk_size]
    updates += [WorkerHost.set_packing]
    updates += [WorkerHost.create_store, WorkerHost.join_group]
    assert not [m.__name__ for m in updates if kind_of(m).read_only]
    reads = [WorkerHost.forward, WorkerHost.sample, WorkerHost.compute_logprobs]
    reads += [WorkerHost.reference_logprobs, WorkerHost.save_state, WorkerHost.save_weights]
    reads += [WorkerHost.build]  # a model that does not load keeps its error's type
    assert all(kind_of(m).read_only for m in reads)


def test_which_calls_need_every_rank():
    # The ranks agree on a forward_backward's input, so every rank takes part, sharded or not.
    assert kind_of(WorkerHost.forward_backward).everyone(sharded=False)
    # Under FSDP2 what reads or writes weights gathers them: every rank, given work or not.
    gathering = [WorkerHost.forward, WorkerHost.sample, WorkerHost.compute_logprobs]
    gathering += [WorkerHost.reference_logprobs, WorkerHost.save_state, WorkerHost.save_weights]
    gathering += [WorkerHost.load_state]
    assert all(kind_of(m).everyone(sharded=True) for m in gathering)
    assert not any(kind_of(m).everyone(sharded=False) for m in gathering)


def test_the_ray_executor_offers_every_executor_method():
    # Pyright checks the Executor protocol where a RayExecutor is given to Dispatch; this
    # checks it where pyright does not run.
    wanted = {n for n in dir(Executor) if not n.startswith("_")}
    assert wanted and wanted <= set(dir(RayExecutor))


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
        create_training_client(tiny_model_dir, address="auto", lora_rank=None)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="executor must be 'local' or 'ray'"):
        create_training_client(tiny_model_dir, executor="mpi", lora_rank=None)  # pyright: ignore[reportCallIssue, reportArgumentType]
    with pytest.raises(ValueError, match="'GPU' share"):
        create_training_client(tiny_model_dir, executor="ray", device="cuda", lora_rank=None)


def test_worker_host_as_the_only_rank(tiny_model_dir, tmp_path, monkeypatch):
    spec = WorkerSpec(str(tiny_model_dir), None, "cpu", "float32", WorkerConfig(), seed=0)
    host = WorkerHost(0, 1, spec.build, torch.get_num_threads(), loopback=True)
    host.build()
    rendezvous = host.create_store()
    assert rendezvous.startswith("file://")  # one machine: no listening socket at all
    host.join_group(rendezvous, "gloo", 30.0)
    try:
        config = LossConfig.from_mapping({})
        bad = Datum(
            ModelInput.from_ints([5, 6, 999]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
        )
        # A forward_backward is checked first: refused before anything is computed, as a
        # value, also when this rank is the whole group (its executor then keeps the group
        # usable).
        refused = host.forward_backward(PassShard([bad], "cross_entropy", config))
        assert isinstance(refused, Rejected) and isinstance(refused.error, ValueError)
        assert all(p.grad is None for p in host.worker.trainable_parameters().values())
        # A checkpoint that is not there is refused too, as a value: the group carries on.
        missing = host.load_state(LoadRequest(tmp_path / "missing", True))
        assert isinstance(missing, Rejected) and isinstance(missing.error, FileNotFoundError)
        datum = Datum(
            ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
        )
        counts = count_checks(monkeypatch)
        host.forward_backward(PassShard([datum], "cross_entropy", config))
        # Checked once, by the agreement; the pass is told so.
        assert counts.call == rows([datum]) and counts.values == rows([datum])
        params = host.worker.trainable_parameters()
        computed = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        # One prepare's moves in one call, in Dispatch's order; repeating one changes nothing
        # (a retry after a failed move), and the gradients come back as they were.
        host.move(["optimizer", "grads"], [])
        host.move(["grads"], ["grads"])
        assert host.worker.parking.offloaded == {"optimizer"}
        host.move([], ["optimizer"])
        assert host.worker.parking.offloaded == set()
        assert computed and all(torch.equal(params[n].grad, g) for n, g in computed.items())  # pyright: ignore[reportArgumentType]
        untouched = next(iter(params))
        params[untouched].grad = None
        before = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        host.reduce_gradients()
        # A gradient absent on every rank stays absent (AdamW then leaves that weight alone);
        # the others are the sum over one rank, i.e. unchanged.
        assert params[untouched].grad is None
        assert all(torch.equal(params[n].grad, g) for n, g in before.items())  # pyright: ignore[reportArgumentType]
        digest = host.weight_digest()
        assert len(digest) == 64 and digest == host.weight_digest()
    finally:
        dist.destroy_process_group()
