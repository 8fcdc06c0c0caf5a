"""RayTrainingClient with FSDP2 (`sharding="fsdp2"`, 2 actors, gloo) against one in-process
worker, for LoRA and for full fine-tuning.

The Ray side runs with a 40-token micro-batch budget, so ranks run different numbers of
micro-batches (rank 1 none at all for a 1-datum batch) and the zero-loss padding passes of
`engine.fsdp` are exercised. Layout under test (engine.fsdp): decoder weights are sharded and
their gradients summed by FSDP's reduce-scatter; the unembedding (`lm_head`, and its LoRA
adapter) is replicated and summed by the all-reduce in optim_step.

Tolerances as in test_ray_client.py: gradients REL_TOL = 2e-6 (summation order only; measured
<= 5e-7), weight updates through AdamW UPDATE_TOL = 3e-5 (measured <= 8.4e-6). Every step clips
(grad_clip_norm=1 against norms of ~20-80), so the sharded norm and the clipping it drives are
checked through the updates as well as through the reported norm.
"""

from __future__ import annotations

from collections.abc import Iterator

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
)

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.ray.actor import WorkerHost
from posttrain.engine.ray.executor import RayConfig
from posttrain.types import AdamParams, ModelInput, SamplingParams

pytestmark = pytest.mark.slow

REL_TOL = 2e-6
UPDATE_TOL = 3e-5
FSDP_RAY = RayConfig(sharding="fsdp2", collective_timeout_s=60.0, startup_timeout_s=180.0)
Pair = tuple[LocalTrainingClient, RayTrainingClient]


# LoRA rank 3: each A matrix (3 rows) is cut into pieces of 2 and 1 rows, so checkpoints gather
# uneven pieces to rank 0.
@pytest.fixture(scope="module", params=[3, None], ids=["lora", "full"])
def pair(request, ray_started, tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Pair, str]]:
    base = tmp_path_factory.mktemp("fsdp-pair")
    local = create_training_client(
        tiny_model_dir, lora_rank=request.param, storage_dir=base / "local"
    )
    remote = create_training_client(
        tiny_model_dir,
        lora_rank=request.param,
        storage_dir=base / "ray",
        executor="ray",
        num_workers=2,
        micro_batch_tokens=40,
        ray_config=FSDP_RAY,
    )
    start = local.save_state("start").result().path
    yield (local, remote), start
    local.close()
    remote.close()


@pytest.fixture
def fresh(pair) -> Pair:
    """Both clients at the saved start (loading it is FSDP's broadcast-and-shard path)."""
    (local, remote), start = pair
    local.load_state(start, with_optimizer=True).result()
    remote.load_state(start, with_optimizer=True).result()
    return local, remote


def step_both(local: LocalTrainingClient, remote: RayTrainingClient, count: int, seed: int) -> None:
    """One forward_backward + clipped optim_step on both; checks losses, gradients, update."""
    datums = make_datums("ppo", seed=seed, count=count)
    out_l = local.forward_backward(datums, "ppo").result()
    out_r = remote.forward_backward(datums, "ppo").result()
    for key, value in out_l.metrics.items():
        # A sum of PPO terms of both signs (advantages ~ N(0, 1)) can be far smaller than the
        # sum of their magnitudes (~ the token count, 20-70), which is what rounding scales
        # with: micro-batches cut differently give ~1e-6 absolute; 1e-5 is ~2e-7 of that.
        assert out_r.metrics[key] == pytest.approx(value, rel=REL_TOL, abs=1e-5), key
    expected = local_grads(local)
    per_rank = ray_tensors(remote, "grads")
    replicated = {n for n in expected if "lm_head" in n}
    assert replicated and replicated < expected.keys()
    # Sharded gradients come out whole and already summed on every rank; replicated ones are
    # each rank's share until optim_step sums them.
    got = {n: per_rank[0][n] for n in expected.keys() - replicated}
    assert all(torch.equal(per_rank[1][n], g) for n, g in got.items())
    got |= summed(per_rank, replicated)
    assert rel_error(got, expected) < REL_TOL
    adam = AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)
    before_l, before_r = local_weights(local), ray_tensors(remote, "weights")[0]
    norm_l, norm_r = stepped_norm(local, adam), stepped_norm(remote, adam)
    assert norm_l > 2.0  # the clip engages
    assert norm_r == pytest.approx(norm_l, rel=REL_TOL)
    update_l = difference(local_weights(local), before_l)
    update_r = difference(ray_tensors(remote, "weights")[0], before_r)
    assert rel_error(update_r, update_l) < UPDATE_TOL


def test_steps_match_one_process(fresh):
    local, remote = fresh
    # 7 datums: ranks hold 4 and 3 (different micro-batch counts); 1 datum: rank 1 holds none.
    for step, count in enumerate((7, 3, 1)):
        step_both(local, remote, count, seed=20 + step)
    digests = remote.weight_digests().result()
    assert digests[0] == digests[1]  # each rank digests the same gathered weights


def test_checkpoints_hold_whole_weights_and_resume_exactly(fresh, tmp_path):
    local, remote = fresh
    step_both(local, remote, 5, seed=30)
    saved = remote.save_state("one-step").result().path
    # Gathered on rank 0 and written in the single-process format: a local client loads it.
    local.load_state(saved, with_optimizer=True).result()
    weights = local_weights(local)
    assert all(torch.equal(weights[n], t) for n, t in ray_tensors(remote, "weights")[1].items())
    # A step away and back: loading broadcasts and re-shards weights and AdamW moments, so the
    # next step on both sides starts from the same state (an optimizer left behind would
    # show in the update).
    step_both(local, remote, 4, seed=31)
    local.load_state(saved, with_optimizer=True).result()
    remote.load_state(saved, with_optimizer=True).result()
    assert all(torch.equal(weights[n], t) for n, t in ray_tensors(remote, "weights")[0].items())
    step_both(local, remote, 4, seed=31)
    # A missing checkpoint is refused on rank 0 before anything changes: the group carries on.
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        remote.load_state(str(tmp_path / "missing"), with_optimizer=True).result()
    step_both(local, remote, 2, seed=32)

    def holds_a_replica(host: WorkerHost) -> bool:
        return host._sharded is not None and host._sharded.checkpoints._mirror is not None

    # Rank 0 alone read every checkpoint (the others need not see its files): only it built
    # the plain replica that reads them.
    assert [run_on_rank(remote, rank, holds_a_replica) for rank in (0, 1)] == [True, False]


def test_sampling_matches_one_process_on_the_same_weights(fresh):
    local, remote = fresh
    step_both(local, remote, 6, seed=40)
    local.load_state(remote.save_state("sampled").result().path).result()
    before = remote.executor.served_counts()
    # Prompt i goes to rank floor((i + 0.5) * 2 / 3): 0, 1, 1; each rank decodes its own
    # number of steps on gathered weights.
    prompts = [ModelInput.from_ints(p) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    params = SamplingParams(max_tokens=6, seed=5, temperature=1.0, stop=[])
    expected = local.sample_many(prompts, 2, params).result()
    got = remote.sample_many(prompts, 2, params).result()
    for a, b in zip(expected, got, strict=True):
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            assert sa.tokens == sb.tokens
            assert sa.logprobs == pytest.approx(sb.logprobs, rel=REL_TOL)
    after = remote.executor.served_counts()
    assert [after[r]["sample"] - before[r].get("sample", 0) for r in (0, 1)] == [1, 2]
    # compute_logprobs runs on rank 0 alone; rank 1 joins only to gather the weights.
    prompt = ModelInput.from_ints([5, 6, 7, 8])
    first, *rest = remote.compute_logprobs(prompt).result()
    expected_first, *expected_rest = local.compute_logprobs(prompt).result()
    assert first is None and expected_first is None  # position 0 has no prefix
    assert rest == pytest.approx(expected_rest, rel=REL_TOL)
