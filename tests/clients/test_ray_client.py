"""RayTrainingClient (2 actors, gloo) against one in-process worker on the same data.

One local Ray serves the whole module. Tolerance: both sides run the same fp32 kernels; only
the order of summation differs (the batch is cut in two shards, and the two shard gradients
are added by all_reduce instead of accumulating in one tensor). Each gradient entry sums
~10^2-10^3 products with rounding ~6e-8 each, so a few 1e-7 relative is expected. We allow
2e-6, as the in-process invariance tests do; a missing shard, a doubled reduction or a mean
instead of a sum is an error of order 1e-1 or more.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.protocol import TrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.ray_executor import RayConfig, WorkerGroupError
from posttrain.engine.ray_session import ray_session
from posttrain.types import AdamParams, Datum, ModelInput, SamplingParams

pytestmark = pytest.mark.slow

REL_TOL = 2e-6
# A stalled peer is bounded by the group's timeout; kept short here so a regression fails fast.
TEST_RAY = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
Grads = dict[str, torch.Tensor]


def make_datums(loss_fn: str, seed: int, count: int) -> list[Datum]:
    """`count` datums of different lengths (5 to 15 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 5 + 3 * i % 11
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        inputs: dict[str, torch.Tensor] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(length, generator=gen)
        else:
            inputs["logprobs"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
            inputs["advantages"] = torch.randn(length, generator=gen)
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def rel_error(a: Grads, b: Grads) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    den = sum(float(a[k].double().norm() ** 2) for k in a)
    return (num / den) ** 0.5


def local_grads(client: LocalTrainingClient) -> Grads:
    worker = client.dispatch.executor.workers[0]  # type: ignore[attr-defined]
    return {n: g.clone() for n, g in worker.grads().items() if g is not None}


def local_weights(client: LocalTrainingClient) -> Grads:
    worker = client.dispatch.executor.workers[0]  # type: ignore[attr-defined]
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}


def ray_grads(client: RayTrainingClient) -> list[dict[str, torch.Tensor | None]]:
    return client.executor.run("grads", [()] * client.executor.num_workers)  # type: ignore[return-value]


def ray_weights(client: RayTrainingClient, rank: int = 0) -> Grads:
    args: list[tuple[object, ...] | None] = [None] * client.executor.num_workers
    args[rank] = ()
    params = client.executor.run("trainable_parameters", args)[rank]
    return {n: p.detach() for n, p in params.items()}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def local_ray():
    # Four CPUs of bookkeeping on two cores: two 2-actor groups may be alive at once.
    with ray_session(num_cpus=4):
        yield


@pytest.fixture(scope="module")
def pair(local_ray, tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ray-pair")
    local = create_training_client(tiny_model_dir, storage_dir=base / "local")
    remote = create_training_client(
        tiny_model_dir, storage_dir=base / "ray", executor="ray", num_workers=2, ray_config=TEST_RAY
    )
    assert isinstance(remote, RayTrainingClient)
    yield local, remote
    local.close()
    remote.close()


def test_replicas_start_equal_and_sample_like_one_process(pair):
    local, remote = pair
    protocol_view: object = remote
    assert isinstance(protocol_view, TrainingClient)
    start = local_weights(local)
    for rank in (0, 1):
        got = ray_weights(remote, rank)
        assert all(torch.equal(got[n], start[n]) for n in start), rank
    # Three prompts over two ranks (2 + 1); seeds follow the global prompt index.
    prompts = [ModelInput.from_ints(p) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    params = SamplingParams(max_tokens=5, seed=3, stop=[])
    expected = local.sample_many(prompts, 2, params).result()
    got = remote.sample_many(prompts, 2, params).result()
    assert len(got) == 3
    for a, b in zip(expected, got, strict=True):
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            assert sa.tokens == sb.tokens
            assert sa.logprobs == pytest.approx(sb.logprobs, rel=REL_TOL)


@pytest.mark.parametrize(
    ("loss_fn", "count"),
    [("cross_entropy", 7), ("ppo", 5), ("cross_entropy", 1)],  # 1 datum: rank 1 holds nothing
)
def test_steps_match_one_process(pair, loss_fn, count):
    local, remote = pair
    adam = AdamParams(learning_rate=1e-3, grad_clip_norm=0.0)
    for step in range(2):
        datums = make_datums(loss_fn, seed=10 * count + step, count=count)
        out_l = local.forward_backward(datums, loss_fn).result()
        out_r = remote.forward_backward(datums, loss_fn).result()
        # Loss metrics are global token-weighted values, not a mean of per-rank means.
        assert out_r.metrics.keys() == out_l.metrics.keys()
        for key, value in out_l.metrics.items():
            assert out_r.metrics[key] == pytest.approx(value, rel=REL_TOL), key
        for a, b in zip(out_l.loss_fn_outputs, out_r.loss_fn_outputs, strict=True):
            torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=0, atol=1e-5)
        # Per-rank gradients before the all-reduce sum to the one-process gradient.
        per_rank = ray_grads(remote)
        expected = local_grads(local)
        summed = {
            n: torch.stack([g for rank in per_rank if (g := rank[n]) is not None]).sum(0)
            for n in expected
        }
        assert rel_error(expected, summed) < REL_TOL
        # A doubled or averaged all-reduce would show in the pre-clip norm (AdamW hides it).
        norm_l = local.optim_step(adam).result().metrics["grad_norm:mean"]
        norm_r = remote.optim_step(adam).result().metrics["grad_norm:mean"]
        assert norm_r == pytest.approx(norm_l, rel=REL_TOL)
        digests = remote.weight_digests().result()
        assert digests[0] == digests[1]  # every rank stepped on identical summed gradients
        assert rel_error(local_weights(local), ray_weights(remote)) < REL_TOL


def test_all_reduce_gives_every_rank_the_whole_batch_gradient(pair):
    local, remote = pair
    datums = make_datums("ppo", seed=99, count=3)
    local.forward_backward(datums, "ppo").result()
    remote.forward_backward(datums, "ppo").result()
    remote.executor.reduce_gradients()
    rank0, rank1 = ray_grads(remote)
    expected = local_grads(local)
    assert all(torch.equal(rank0[n], rank1[n]) for n in expected)  # type: ignore[arg-type]
    assert rel_error(expected, {n: rank0[n] for n in expected}) < REL_TOL  # type: ignore[misc]
    local.dispatch.executor.run("zero_grad", [()])
    remote.executor.run("zero_grad", [(), ()])


def test_bad_input_on_one_rank_leaves_every_rank_unchanged(pair):
    _, remote = pair
    datums = make_datums("cross_entropy", seed=5, count=4)
    bad = Datum(
        ModelInput.from_ints([5, 6, 9999]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        remote.forward_backward([*datums, bad], "cross_entropy").result()
    assert all(g is None for grads in ray_grads(remote) for g in grads.values())
    out = remote.forward(datums, "cross_entropy").result()  # still usable
    assert out.metrics["loss:sum"] > 0


def test_a_killed_actor_fails_the_call_and_the_checkpoint_stays_valid(
    local_ray, tiny_model_dir, tmp_path
):
    client = create_training_client(
        tiny_model_dir, storage_dir=tmp_path, executor="ray", num_workers=2, ray_config=TEST_RAY
    )
    assert isinstance(client, RayTrainingClient)
    datums = make_datums("cross_entropy", seed=1, count=4)
    client.forward_backward(datums, "cross_entropy").result()
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    saved = client.save_state("before").result()
    weights = ray_weights(client)
    client.forward_backward(datums, "cross_entropy").result()
    os.kill(client.executor.pids()[1], signal.SIGKILL)
    # The all-reduce in optim_step waits on the dead rank; the caller must hear of it. The
    # timeout here only turns a hang into a failure.
    with pytest.raises(WorkerGroupError, match="rank 1 died"):
        client.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
    with pytest.raises(WorkerGroupError, match="unusable"):
        client.forward(datums, "cross_entropy").result(timeout=60)
    client.close()
    # The last checkpoint loads into a fresh client and holds the weights of that step.
    fresh = create_training_client(tiny_model_dir, storage_dir=tmp_path / "fresh")
    fresh.load_state(saved.path, with_optimizer=True).result()
    restored = local_weights(fresh)
    assert all(torch.equal(restored[n], weights[n]) for n in weights)
    fresh.close()


def test_startup_failures_are_clear_and_bounded(local_ray, tiny_model_dir, tmp_path):
    # No node has this resource: placement never happens, the startup timeout ends the wait.
    unplaceable = RayConfig(
        resources_per_worker={"CPU": 1.0, "tpu_pod": 1.0}, startup_timeout_s=3.0
    )
    with pytest.raises(WorkerGroupError, match=r"did not start within startup_timeout_s=3.0"):
        create_training_client(
            tiny_model_dir, executor="ray", num_workers=2, ray_config=unplaceable
        )
    # A worker's own error keeps its type, as with the local executor.
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        create_training_client(
            tmp_path / "no-such-model", executor="ray", num_workers=2, ray_config=TEST_RAY
        )


def test_a_call_past_call_timeout_fails_instead_of_waiting(local_ray, tiny_model_dir, tmp_path):
    # 1 ms is shorter than any forward pass: the call is abandoned and the group retired.
    impatient = replace(TEST_RAY, call_timeout_s=1e-3)
    client = create_training_client(
        tiny_model_dir, storage_dir=tmp_path, executor="ray", num_workers=2, ray_config=impatient
    )
    datums = make_datums("cross_entropy", seed=2, count=6)
    with pytest.raises(WorkerGroupError, match="did not finish on rank"):
        client.forward_backward(datums, "cross_entropy").result(timeout=60)
    with pytest.raises(WorkerGroupError, match="unusable"):
        client.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
    client.close()
