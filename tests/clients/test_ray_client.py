"""RayTrainingClient (2 actors, gloo, full replicas) against one in-process worker on the same data,
and what happens when a rank dies, stalls or fails.

One local Ray serves the module. Every parity test starts both clients from the same saved
state (the `fresh` fixture), so none depends on another's order.

Tolerances. Both sides run the same fp32 kernels; only the order of summation differs (the
batch is cut in two shards whose gradients all_reduce adds, instead of accumulating in one
tensor). Each gradient entry sums ~10^2-10^3 products rounded at ~6e-8, so a few 1e-7 relative
is expected (measured <= 5e-7): REL_TOL = 2e-6. A missing shard, a doubled reduction or a mean
instead of a sum is an error of 1e-1 or more.
Weight updates (w - w_prev, so an error is not diluted by the weights themselves) go through
AdamW, which divides by sqrt(v): an entry whose successive gradients nearly cancel amplifies the
gradients' relative error. Measured over seven steps of mixed losses, with and without
clipping (these steps, run longer): <= 3.5e-6 with replicas, <= 8.4e-6 with FSDP2, so
UPDATE_TOL = 3e-5. Stale or missing AdamW moments, a skipped or doubled step, or a gradient
scaled differently on a later step move the update by 1e-2 or more. AdamW's first step is
~lr * sign(g) and hides a gradient scale error, which is why gradients and the pre-clip norm are
compared directly too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import NoReturn

import pytest
import torch
from ray_helpers import (
    difference,
    local_grads,
    local_weights,
    make_datums,
    ray_tensors,
    rel_error,
    run_on_rank,
    stepped_norm,
    summed,
    wait_until_gone,
)

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.protocol import TrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.ray.actor import WorkerHost
from posttrain.engine.ray.executor import RayConfig, WorkerGroupError
from posttrain.types import AdamParams, Datum, ModelInput, SamplingParams

pytestmark = pytest.mark.slow

REL_TOL = 2e-6
UPDATE_TOL = 3e-5
TEST_RAY = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
# A killed actor's peer sees its gloo connection drop within ~60 ms and Ray reports the death
# within about a second; 30 s (collective_timeout_s) would mean the failure was only noticed
# by a timeout. A correctness bound, not a performance one.
KILL_BOUND_S = 5.0
Pair = tuple[LocalTrainingClient, RayTrainingClient]


@pytest.fixture(scope="module")
def pair(ray_started, tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Pair, str]]:
    base = tmp_path_factory.mktemp("ray-pair")
    local = create_training_client(tiny_model_dir, storage_dir=base / "local", lora_rank=None)
    remote = create_training_client(
        tiny_model_dir,
        storage_dir=base / "ray",
        executor="ray",
        num_workers=2,
        ray_config=TEST_RAY,
        lora_rank=None,
    )
    start = local.save_state("start").result().path  # before any step: empty AdamW state
    yield (local, remote), start
    local.close()
    remote.close()


@pytest.fixture
def fresh(pair) -> Pair:
    """Both clients at the saved start: same weights, empty optimizer, no gradients."""
    (local, remote), start = pair
    local.load_state(start, with_optimizer=True).result()
    remote.load_state(start, with_optimizer=True).result()
    return local, remote


def test_replicas_start_equal_and_sample_like_one_process(fresh):
    local, remote = fresh
    protocol_view: object = remote
    assert isinstance(protocol_view, TrainingClient)
    start = local_weights(local)
    for rank, weights in enumerate(ray_tensors(remote, "weights")):
        assert all(torch.equal(weights[n], start[n]) for n in start), rank
    before = remote.executor.served_counts()
    # Three prompts over two ranks: prompt i goes to rank floor((i + 0.5) * 2 / 3): 0, 1, 1.
    prompts = [ModelInput.from_ints(p) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    params = SamplingParams(max_tokens=5, seed=3, stop=[], entropies=True)
    expected = local.sample_many(prompts, 2, params).result()
    got = remote.sample_many(prompts, 2, params).result()
    assert len(got) == 3
    for a, b in zip(expected, got, strict=True):
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            assert sa.tokens == sb.tokens
            assert sa.logprobs == pytest.approx(sb.logprobs, rel=REL_TOL)
            assert sa.entropies is not None and len(sa.entropies) == len(sa.tokens)
            assert sa.entropies == pytest.approx(sb.entropies, rel=REL_TOL)
    after = remote.executor.served_counts()
    assert [after[r]["sample"] - before[r].get("sample", 0) for r in (0, 1)] == [1, 2]


@pytest.mark.parametrize(
    ("loss_fn", "count"),
    [("cross_entropy", 7), ("ppo", 5), ("cross_entropy", 1)],  # 1 datum: rank 1 holds nothing
)
def test_steps_match_one_process(fresh, loss_fn, count):
    local, remote = fresh
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
        per_rank = ray_tensors(remote, "grads")
        expected = local_grads(local)
        assert rel_error(summed(per_rank, set(expected)), expected) < REL_TOL
        # A doubled or averaged all-reduce would show in the pre-clip norm (AdamW hides it).
        before_l, before_r = local_weights(local), ray_tensors(remote, "weights")[0]
        norm_l, norm_r = stepped_norm(local, adam), stepped_norm(remote, adam)
        assert norm_r == pytest.approx(norm_l, rel=REL_TOL)
        digests = remote.weight_digests().result()
        assert digests[0] == digests[1]  # every rank stepped on identical summed gradients
        update_l = difference(local_weights(local), before_l)
        update_r = difference(ray_tensors(remote, "weights")[0], before_r)
        assert rel_error(update_r, update_l) < UPDATE_TOL


def test_all_reduce_gives_every_rank_the_whole_batch_gradient(fresh):
    local, remote = fresh
    datums = make_datums("ppo", seed=99, count=3)
    local.forward_backward(datums, "ppo").result()
    remote.forward_backward(datums, "ppo").result()
    remote.executor.reduce_gradients()
    rank0, rank1 = ray_tensors(remote, "grads")
    expected = local_grads(local)
    assert all(torch.equal(rank0[n], rank1[n]) for n in expected)
    assert rel_error({n: rank0[n] for n in expected}, expected) < REL_TOL


def test_sampling_after_training_matches_one_process_on_the_same_weights(fresh):
    local, remote = fresh
    for step in range(2):
        datums = make_datums("cross_entropy", seed=50 + step, count=4)
        remote.forward_backward(datums, "cross_entropy").result()
        remote.optim_step(AdamParams(learning_rate=1e-2)).result()
    # The same weights in one process: the ray client's own checkpoint, loaded locally.
    local.load_state(remote.save_state("trained").result().path).result()
    trained = ray_tensors(remote, "weights")
    assert all(torch.equal(t, local_weights(local)[n]) for n, t in trained[1].items())
    before = remote.executor.served_counts()
    # Five prompts: prompt i goes to rank floor((i + 0.5) * 2 / 5): 0, 0, 1, 1, 1.
    prompts = [ModelInput.from_ints([5 + i, 6, 7][: 1 + i % 3]) for i in range(5)]
    params = SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])
    expected = local.sample_many(prompts, 2, params).result()
    got = remote.sample_many(prompts, 2, params).result()
    assert [[s.tokens for s in r.sequences] for r in got] == [
        [s.tokens for s in r.sequences] for r in expected
    ]
    after = remote.executor.served_counts()
    assert [after[r]["sample"] - before[r].get("sample", 0) for r in (0, 1)] == [2, 3]
    # A snapshot read in this process from rank 0's files samples the same weights (rank 0 on
    # another node: tests/backends/test_ray_cluster.py).
    snapshot = remote.save_weights_and_get_sampling_client().result()
    again = snapshot.sample_many(prompts, 2, params).result()
    assert [[s.tokens for s in r.sequences] for r in again] == [
        [s.tokens for s in r.sequences] for r in expected
    ]
    snapshot.close()


def test_bad_input_is_refused_on_every_rank_and_the_group_stays_usable(fresh):
    local, remote = fresh
    datums = make_datums("cross_entropy", seed=5, count=4)
    bad = Datum(
        ModelInput.from_ints([5, 6, 9999]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
    )
    remote.optim_step(AdamParams()).result()  # no gradients: only settles the placement
    # The bad datum is last, so it lands on rank 1 while rank 0's shard is fine.
    trips = remote.executor.round_trips
    with pytest.raises(ValueError, match="outside the vocabulary"):
        remote.forward_backward([*datums, bad], "cross_entropy").result()
    assert remote.executor.round_trips == trips + 1  # checked and refused in the call itself
    assert ray_tensors(remote, "grads") == [{}, {}]  # no rank computed anything
    before_l, before_r = local_weights(local), ray_tensors(remote, "weights")[0]
    local.forward_backward(datums, "cross_entropy").result()
    remote.forward_backward(datums, "cross_entropy").result()
    local.optim_step(AdamParams(learning_rate=1e-3)).result()
    remote.optim_step(AdamParams(learning_rate=1e-3)).result()
    update_l = difference(local_weights(local), before_l)
    update_r = difference(ray_tensors(remote, "weights")[0], before_r)
    assert rel_error(update_r, update_l) < UPDATE_TOL


def test_each_datum_is_checked_once_over_two_ranks(fresh):
    _, remote = fresh
    datums = make_datums("cross_entropy", seed=8, count=5)

    def count_checks(host: WorkerHost) -> None:  # runs in each actor
        from posttrain.engine import datum_checks

        seen = host.__dict__.setdefault("checked", [])
        real = datum_checks.check_call
        host.__dict__["real_check_call"] = real

        def check_call(datums, *args, **kwargs):
            seen.extend(tuple(d.model_input.to_ints()) for d in datums)
            return real(datums, *args, **kwargs)

        datum_checks.check_call = check_call

    def checked(host: WorkerHost) -> list[tuple[int, ...]]:
        from posttrain.engine import datum_checks

        datum_checks.check_call = host.__dict__.pop("real_check_call")
        return host.__dict__.pop("checked")

    for rank in (0, 1):
        run_on_rank(remote, rank, count_checks)
    remote.forward_backward(datums, "cross_entropy").result()
    per_rank = [run_on_rank(remote, rank, checked) for rank in (0, 1)]
    # Each rank checked its own shard, once: together every datum exactly once.
    assert all(per_rank)
    assert sorted(per_rank[0] + per_rank[1]) == sorted(
        tuple(d.model_input.to_ints()) for d in datums
    )


def test_each_call_is_one_round_trip_and_its_placement_one_more(fresh):
    _, remote = fresh
    datums = make_datums("cross_entropy", seed=7, count=3)
    prompts = [ModelInput.from_ints([5, 6]), ModelInput.from_ints([7, 8])]
    calls = {
        "forward_backward": lambda: remote.forward_backward(datums, "cross_entropy").result(),
        "optim_step": lambda: remote.optim_step(AdamParams(learning_rate=1e-3)).result(),
        "sample": lambda: remote.sample_many(prompts, 1, SamplingParams(max_tokens=2)).result(),
    }
    calls["optim_step"]()  # everything on the device: the training placement
    trips: list[int] = []
    for name in ["forward_backward", "optim_step", "sample", "forward_backward", "optim_step"]:
        before = remote.executor.round_trips
        calls[name]()
        trips.append(remote.executor.round_trips - before)
    # Nothing to move for the first two; sampling parks the gradients and AdamW moments in
    # one call, and forward_backward and optim_step each bring back what they need in one.
    # (Before: forward_backward 2 with its commit, optim_step 2 with its all-reduce, and one
    # per moved group: [2, 2, 3, 3, 3].)
    assert trips == [1, 1, 2, 2, 2]


def make_group(
    tiny_model_dir, tmp_path, config: RayConfig = TEST_RAY, num_workers: int = 2
) -> RayTrainingClient:
    client = create_training_client(
        tiny_model_dir,
        storage_dir=tmp_path,
        executor="ray",
        num_workers=num_workers,
        ray_config=config,
        lora_rank=None,
    )
    assert isinstance(client, RayTrainingClient)
    return client


def test_an_exception_mid_update_on_one_rank_retires_the_group(
    ray_started, tiny_model_dir, tmp_path
):
    client = make_group(tiny_model_dir, tmp_path)
    datums = make_datums("cross_entropy", seed=3, count=2)

    def fail_the_pass(host: WorkerHost) -> None:  # runs in rank 1's actor
        def fails(*args: object, **kwargs: object) -> NoReturn:
            raise RuntimeError("simulated fault in the pass")

        host.worker.forward_backward = fails

    # Both ranks accept the input; rank 1's pass then fails while rank 0 accumulates gradients.
    # (optim_step, load_state, ... take the same path: see test_ray_executor's read_only test.)
    run_on_rank(client, 1, fail_the_pass)
    with pytest.raises(WorkerGroupError, match="rank 1 raised RuntimeError during forward_b"):
        client.forward_backward(datums, "cross_entropy").result(timeout=60)
    with pytest.raises(WorkerGroupError, match=r"unusable.*rank 1 raised RuntimeError"):
        client.forward(datums, "cross_entropy").result(timeout=60)
    client.close()


def test_a_killed_actor_fails_the_call_at_once_and_the_checkpoint_stays_valid(
    ray_started, tiny_model_dir, tmp_path
):
    client = make_group(tiny_model_dir, tmp_path)
    datums = make_datums("cross_entropy", seed=1, count=4)
    client.forward_backward(datums, "cross_entropy").result()
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    saved = client.save_state("before").result()
    weights = ray_tensors(client, "weights")[0]
    client.forward_backward(datums, "cross_entropy").result()
    start = time.monotonic()
    os.kill(client.executor.pids()[1], signal.SIGKILL)
    # optim_step's all-reduce waits on the dead rank; the caller hears of it at once.
    with pytest.raises(WorkerGroupError, match="rank 1 died"):
        client.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < KILL_BOUND_S, f"{elapsed:.1f} s: noticed by a timeout, not the death"
    with pytest.raises(WorkerGroupError, match="unusable"):
        client.forward(datums, "cross_entropy").result(timeout=60)
    client.close()
    # The last checkpoint loads into a fresh client and holds the weights of that step.
    fresh = create_training_client(tiny_model_dir, storage_dir=tmp_path / "fresh", lora_rank=None)
    fresh.load_state(saved.path, with_optimizer=True).result()
    restored = local_weights(fresh)
    assert all(torch.equal(restored[n], weights[n]) for n in weights)
    fresh.close()


def test_a_stalled_rank_fails_the_call_within_the_collective_timeout(
    ray_started, tiny_model_dir, tmp_path
):
    timeout_s = 5.0
    client = make_group(tiny_model_dir, tmp_path, replace(TEST_RAY, collective_timeout_s=timeout_s))
    client.forward_backward(make_datums("cross_entropy", seed=4, count=3), "cross_entropy").result()
    pids = client.executor.pids()
    os.kill(pids[1], signal.SIGSTOP)  # alive but silent, as a hung rank is
    try:
        start = time.monotonic()
        with pytest.raises(
            WorkerGroupError, match=r"rank 0 failed.*rank\(s\) \[1\] did not answer"
        ):
            client.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=120)
        elapsed = time.monotonic() - start
        # Rank 0's all-reduce gives up after timeout_s; the executor then gives the silent rank
        # 1 s to show whether it died. 10 s more covers scheduling on a loaded machine; without
        # the bound the call would wait forever (the stalled rank never answers).
        assert timeout_s <= elapsed < timeout_s + 10.0, elapsed
    finally:
        os.kill(pids[1], signal.SIGCONT)
    with pytest.raises(WorkerGroupError, match="unusable"):
        client.forward(make_datums("cross_entropy", seed=4, count=1), "cross_entropy").result()
    client.close()
    assert wait_until_gone(pids), "close() left actor processes running"


def test_startup_failures_are_clear_and_bounded(ray_started, tiny_model_dir, tmp_path):
    # No node has this resource: placement never happens, the startup timeout ends the wait.
    unplaceable = RayConfig(
        resources_per_worker={"CPU": 1.0, "tpu_pod": 1.0}, startup_timeout_s=3.0
    )
    with pytest.raises(WorkerGroupError, match=r"did not start within startup_timeout_s=3.0"):
        make_group(tiny_model_dir, tmp_path, unplaceable)
    # A worker's own error keeps its type, as with the local executor (one actor shows it).
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        make_group(tmp_path / "no-such-model", tmp_path, num_workers=1)


def test_one_actor_refuses_bad_input_and_bounds_every_call(ray_started, tiny_model_dir, tmp_path):
    client = make_group(tiny_model_dir, tmp_path, num_workers=1)
    datums = make_datums("cross_entropy", seed=2, count=6)
    bad = Datum(
        ModelInput.from_ints([5, 6, 10**7]), {"target_tokens": [6, 7, 8], "weights": [1.0] * 3}
    )
    # Refused before anything changed, as with two ranks: the group carries on.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.forward_backward([*datums, bad], "cross_entropy").result(timeout=60)
    client.forward_backward(datums, "cross_entropy").result(timeout=60)
    # 1 ms is shorter than any forward pass: the call is abandoned and the group retired.
    # (The executor reads its config on every call; one actor waits as a group of any size.)
    client.executor.config = replace(TEST_RAY, call_timeout_s=1e-3)
    with pytest.raises(WorkerGroupError, match="did not finish on rank"):
        client.forward_backward(datums, "cross_entropy").result(timeout=60)
    with pytest.raises(WorkerGroupError, match="unusable"):
        client.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60)
    client.close()
