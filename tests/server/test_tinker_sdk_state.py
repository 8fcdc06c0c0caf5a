"""The tinker SDK against a real `posttrain serve`: optimizer state across save and load, loading
into a live model, the training-run listing, and the losses whose values depend on the ratio
(dro, gspo, PPO with an active clip), each against values derived by hand.

Weights are read from the checkpoints the server writes under its --storage directory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from serve_helpers import KEY, ServerProcess

tinker = pytest.importorskip("tinker")
types = tinker.types

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

TOKENS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108, 100, 33, 33]]
LR = 1e-2
ADAM = types.AdamParams(learning_rate=LR)  # eps 1e-12, no weight decay, no clipping


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> Iterator[object]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


def sft_data():
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
        )
        for t in TOKENS
    ]


def rl_data(old_logprobs: list[list[float]], advantages: list[list[float]]):
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "logprobs": q, "advantages": a},
        )
        for t, q, a in zip(TOKENS, old_logprobs, advantages, strict=True)
    ]


def step(tc) -> float:
    loss = tc.forward_backward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(ADAM).result()
    return loss


def loss_now(tc) -> float:
    return tc.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]


def saved_weights(server: ServerProcess, tc, name: str) -> dict[str, torch.Tensor]:
    path = tc.save_state(name).result().path
    return load_file(server.checkpoint_dir(path) / "adapter_model.safetensors")


def update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    """The LoRA weights' change (the file also holds the frozen, tied lm_head base weight)."""
    return torch.cat([(after[k] - before[k]).flatten() for k in sorted(before) if "lora_" in k])


def test_optimizer_state_is_restored_or_fresh(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1)
    tc = tc.result()
    for _ in range(3):
        step(tc)
    path = tc.save_state("after-3").result().path
    w3 = load_file(server.checkpoint_dir(path) / "adapter_model.safetensors")
    loss3 = loss_now(tc)
    step(tc)
    uninterrupted = update(saved_weights(server, tc, "uninterrupted"), w3)

    with_optimizer = service.create_training_client_from_state_with_optimizer(path).result()
    fresh = service.create_training_client_from_state(path).result()
    # Both start from the saved weights: the same code on the same weights gives the same loss.
    assert loss_now(with_optimizer) == loss_now(fresh) == loss3
    step(with_optimizer)
    step(fresh)
    restored = update(saved_weights(server, with_optimizer, "restored"), w3)
    first = update(saved_weights(server, fresh, "fresh"), w3)

    # Restored Adam moments: the 4th update is the uninterrupted one. Same process, same code:
    # any difference is float32 rounding of w + Δ - w (|w| <~ 1, Δ ~ 1e-2: ~1e-5 of Δ at most;
    # measured 0).
    assert (restored - uninterrupted).norm() <= 1e-5 * uninterrupted.norm()
    # Fresh Adam: its first step has m̂ = g and v̂ = g², so every coordinate moves by
    # lr·g/(|g| + 1e-12) = ±lr (coordinates with |g| < 1e-9 would move less; there are none).
    assert torch.allclose(first.abs(), torch.full_like(first, LR), rtol=1e-3)
    # After three steps m̂/√v̂ is no longer ±1: the uninterrupted update moves most coordinates
    # by less than 0.9·lr (measured 99%), so the fresh update is far from it (measured 1.4x
    # its norm apart).
    assert float((uninterrupted.abs() < 0.9 * LR).float().mean()) > 0.5
    assert (first - uninterrupted).norm() > 0.5 * uninterrupted.norm()


def test_load_weights_into_a_live_model(service, tiny_model_dir: Path) -> None:
    """load_state on an existing model (model_id + seq_id): the weights, and with
    load_state_with_optimizer the moments too, replace the model's own."""
    base = str(tiny_model_dir)
    tc = service.create_lora_training_client(base_model=base, rank=4, seed=2).result()
    step(tc)
    path = tc.save_state("one").result().path
    loss_at_save = loss_now(tc)
    step(tc)
    step(tc)
    assert loss_now(tc) != loss_at_save
    tc.load_state(path).result()
    assert loss_now(tc) == loss_at_save  # the saved weights, bit for bit

    tc.load_state_with_optimizer(path).result()
    reference = service.create_training_client_from_state_with_optimizer(path).result()
    step(tc)
    step(reference)
    # Loaded moments on the live model equal those of a model created from the checkpoint
    # (float32 sums of the same values in the same order: equal to rounding).
    assert loss_now(tc) == pytest.approx(loss_now(reference), rel=1e-6)


def test_training_runs_are_listed_in_pages(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    base = str(tiny_model_dir)
    mine = [
        service.create_lora_training_client(
            base_model=base, rank=2, user_metadata={"index": str(i)}
        )
        .result()
        .model_id
        for i in range(3)
    ]
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    total = rest.list_training_runs(limit=1).result().cursor.total_count
    assert total >= 3
    pages = [rest.list_training_runs(limit=2, offset=o).result() for o in range(0, total, 2)]
    assert all(len(p.training_runs) == min(2, total - 2 * i) for i, p in enumerate(pages))
    assert all(p.cursor.total_count == total for p in pages)
    listed = [run.training_run_id for p in pages for run in p.training_runs]
    assert len(listed) == len(set(listed)) == total  # every run exactly once
    # Newest first: the three just created lead the listing, last created first.
    assert listed[:3] == mine[::-1]
    first = pages[0].training_runs[0]
    assert first.user_metadata == {"index": "2"} and first.lora_rank == 2
    assert rest.list_training_runs(limit=2, offset=total).result().training_runs == []


def own_logprobs(tc) -> list[list[float]]:
    out = tc.forward(sft_data(), "cross_entropy").result()
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def test_ratio_losses_with_hand_derived_values(service, tiny_model_dir: Path) -> None:
    """Sampler logprobs q = lp − log r set each token's ratio r = exp(lp − q) exactly, so the
    losses are known without the model: lp comes back from a forward pass on the same weights.
    Tolerance: q travels as float32 (|q| ~ 5: 5e-7 absolute), so r is exact to ~1e-6."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=3)
    tc = tc.result()
    lp = own_logprobs(tc)
    lengths = [len(x) for x in lp]  # 5 and 7 target tokens

    # PPO, clip range [0.8, 1.2]. Four cases, cycled over the 12 tokens (3 full cycles):
    #   r=2,   A=+1: −min(2, 1.2)     = −1.2  (clipped)
    #   r=2,   A=−1: −min(−2, −1.2)   = +2.0  (unclipped: the pessimistic side)
    #   r=0.5, A=+1: −min(0.5, 0.8)   = −0.5  (unclipped)
    #   r=0.5, A=−1: −min(−0.5, −0.8) = +0.8  (clipped)
    # loss = 3 · (−1.2 + 2.0 − 0.5 + 0.8) = 3.3; half the tokens are clipped.
    cases = [(2.0, 1.0), (2.0, -1.0), (0.5, 1.0), (0.5, -1.0)]
    flat = [cases[i % 4] for i in range(sum(lengths))]
    ratios, advs = split([r for r, _ in flat], lengths), split([a for _, a in flat], lengths)
    q = [
        [x - math.log(r) for x, r in zip(xs, rs, strict=True)]
        for xs, rs in zip(lp, ratios, strict=True)
    ]
    ppo = tc.forward(rl_data(q, advs), "ppo").result()
    assert ppo.metrics["loss:sum"] == pytest.approx(3.3, rel=1e-5)
    assert ppo.metrics["clipped_frac:mean"] == 0.5

    # GSPO: one ratio per sequence, s = exp(mean_t(lp_t − q_t)). Sequence 0: lp − q = log 2 + c_t
    # with Σ c_t = 0, so s = 2 although the token ratios differ; A = +1: −min(2, 1.2) = −1.2 per
    # token. Sequence 1: lp − q = log 1.1, A = −0.5: inside the clip, −1.1·(−0.5) = +0.55.
    # loss = 5·(−1.2) + 7·0.55 = −2.15 (token-level PPO would give another value).
    c = [0.3, -0.3, 0.2, -0.2, 0.0]
    q_gspo = [
        [x - math.log(2.0) - ci for x, ci in zip(lp[0], c, strict=True)],
        [x - math.log(1.1) for x in lp[1]],
    ]
    adv_gspo = [[1.0] * lengths[0], [-0.5] * lengths[1]]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    gspo = tc.forward(rl_data(q_gspo, adv_gspo), "gspo", config).result()
    assert gspo.metrics["loss:sum"] == pytest.approx(-2.15, rel=1e-5)

    # DRO with β = 0.1: −Σ (lp·A − ½β(lp − q)²). With lp − q = 1 and A = 1 on all 12 tokens:
    # −Σ lp + ½ · 0.1 · 12 = −Σ lp + 0.6.
    q_dro = [[x - 1.0 for x in xs] for xs in lp]
    ones = [[1.0] * n for n in lengths]
    dro = tc.forward(rl_data(q_dro, ones), "dro", {"beta": 0.1}).result()
    expected = -sum(sum(xs) for xs in lp) + 0.6
    assert dro.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def split(values: list[float], lengths: list[int]) -> list[list[float]]:
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out
