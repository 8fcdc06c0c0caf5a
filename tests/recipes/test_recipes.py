"""Both recipes run 2 steps on the tiny model, train on each, and make the update they should.

"The update they should" is checked against a naive reference: the policy-gradient loss
written out by hand in float64 on a fresh copy of the base model, its gradient clipped to norm
1, then AdamW's first step from zero moments, which in exact arithmetic is
    Δw = -lr · m̂ / (sqrt(v̂) + eps) = -lr · g / (|g| + eps)        (m̂ = g, v̂ = g²)
i.e. -lr · sign(g) wherever |g| >> eps = 1e-12.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import posttrain
from posttrain.clients.create import create_training_client
from posttrain.models.load import load_hf_model, load_tokenizer

RECIPES = Path(__file__).parents[2] / "recipes"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class Sequence:
    """One trained sequence: tokens, per-target advantage (already reduction-scaled), the
    sampler's logprob of each target, and which targets count."""

    tokens: list[int]
    adv: list[float]
    old_logprobs: list[float]
    mask: list[float]


def naive_gradient(base_model: Path, sequences: list[Sequence]) -> dict[str, torch.Tensor]:
    """d/dθ of -Σ_t m_t·A_t·exp(lp_t - old_t), in float64 (PPO's loss while no ratio is clipped)."""
    model = load_hf_model(base_model).double()
    model.zero_grad()
    for seq in sequences:
        ids = torch.tensor([seq.tokens[:-1]])
        logp_T = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        lp_T = logp_T.gather(-1, torch.tensor(seq.tokens[1:])[:, None])[:, 0]
        old_T = torch.tensor(seq.old_logprobs, dtype=torch.float64)
        mask_T = torch.tensor(seq.mask, dtype=torch.float64)
        ratio_T = torch.exp(torch.where(mask_T > 0, lp_T - old_T, 0.0))
        # On-policy: every counted ratio is 1 up to sampler/trainer rounding, far from a clip.
        assert float((ratio_T.detach() - 1).abs().max()) < 1e-3
        (-(mask_T * torch.tensor(seq.adv, dtype=torch.float64) * ratio_T).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def unreached(base_model: Path, sequences: list[Sequence]) -> dict[str, torch.Tensor]:
    """Weights no sequence's loss can reach (the gradient is 0 whatever the advantages: every
    advantage set to 1). A weight reached only through rows whose advantage is 0 is not here:
    the trainer's float64 mean may leave such an advantage at ~1e-17 where the test's Python sum
    gives exactly 0, and AdamW's first step moves by lr x g / (|g| + 1e-12) even for tiny g."""
    ones = [Sequence(s.tokens, [1.0] * len(s.adv), s.old_logprobs, s.mask) for s in sequences]
    return {n: g == 0 for n, g in naive_gradient(base_model, ones).items()}


def check_first_adam_step(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    lr: float,
    unreached: dict[str, torch.Tensor],
) -> float:
    """Assert `after - before` is AdamW's first step on `grads` clipped to norm 1; return the
    share of weights checked to the exact value."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    scale = min(1.0, 1.0 / (norm + 1e-6))  # torch's clip_grad_norm_
    biggest = max(float(g.abs().max()) for g in grads.values())
    checked = total = 0
    for name, grad in grads.items():
        g = (grad * scale).float()
        w0, w1 = before[name], after[name]
        step = w1.double() - w0.double()
        # The update is computed in fp32 and added to fp32 weights: allow 2 ulps of the weight.
        ulp = (torch.nextafter(w0.abs(), torch.tensor(math.inf)) - w0.abs()).double()
        expected = -lr * g.double() / (g.double().abs() + 1e-12)
        # fp32 gradients differ from this float64 reference by ~1e-6 of the largest entry, so
        # the sign of an entry below 1e-3 of it is not certain: there only |Δw| <= lr is checked.
        sure = g.abs() > 1e-3 * biggest * scale
        torch.testing.assert_close(step[sure], expected[sure], rtol=1e-5, atol=float(2 * ulp.max()))
        assert bool((step[unreached[name]] == 0).all()), name  # no gradient, no moment, no move
        assert bool((step.abs() <= lr * (1 + 1e-5) + 2 * ulp).all()), name
        checked += int(sure.sum())
        total += g.numel()
    return checked / total


def weights(client) -> dict[str, torch.Tensor]:
    model = client.dispatch.executor.workers[0].model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_primitives_recipe_trains_and_makes_the_expected_update(tiny_model_dir):
    recipe = load("rl_primitives")
    args = recipe.parse_args(["--prompts", "3", "--group-size", "4"])
    client = create_training_client(tiny_model_dir, lora_rank=None, seed=0)
    tokenizer, rng = client.get_tokenizer(), random.Random(0)
    before = weights(client)
    first = recipe.rl_step(client, tokenizer, rng, args)
    after = weights(client)
    second = recipe.rl_step(client, tokenizer, rng, args)
    client.close()
    for step in (first, second):
        assert step.datums and step.loss is not None and math.isfinite(step.loss)
    # PPO's loss at ratio 1 is -Σ_t A_t (advantages already divided by the token count); the
    # sampler's logprobs match the trainer's to ~1e-6, so the ratio is 1 to that precision.
    advantages = [d.loss_fn_inputs["advantages"] for d in first.datums]
    hand_loss = -sum(float(a.sum()) for a in advantages)
    assert abs(first.loss - hand_loss) <= 1e-5 * sum(float(a.abs().sum()) for a in advantages)
    sequences = [
        Sequence(
            [*d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist()[-1]],
            d.loss_fn_inputs["advantages"].tolist(),
            d.loss_fn_inputs["logprobs"].tolist(),
            d.loss_fn_inputs["mask"].tolist(),
        )
        for d in first.datums
    ]
    grads = naive_gradient(tiny_model_dir, sequences)
    share = check_first_adam_step(
        before, after, grads, args.learning_rate, unreached(tiny_model_dir, sequences)
    )
    print(f"exactly checked: {share:.1%} of the weights")
    assert share > 0.5, share  # most weights are checked to their exact value


def logged_sequences(path: Path) -> list[Sequence]:
    """The step's trajectories from model.log's file, with GRPO advantages and the token mean
    written out by hand: A_i = (r_i - mean r) / (std r + 1e-6), population std, groups of
    equal rewards dropped, then divided by the number of trainable tokens of the step."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    groups: dict[int, list[dict]] = {}
    for record in records:
        groups.setdefault(record["group"], []).append(record)
    kept: list[tuple[dict, float]] = []
    for members in groups.values():
        rewards = [m["reward"] for m in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if max(rewards) - min(rewards) > 1e-12:
            kept += [(m, (m["reward"] - mean) / (std + 1e-6)) for m in members]
    out = []
    total = sum(len(s["tokens"]) for m, _ in kept for s in m["segments"] if s["trainable"])
    for member, adv in kept:
        tokens, mask, old = [], [], []
        for segment in member["segments"]:
            tokens += segment["tokens"]
            mask += [float(segment["trainable"])] * len(segment["tokens"])
            old += segment["logprobs"] or [0.0] * len(segment["tokens"])
        out.append(Sequence(tokens, [adv / total] * (len(tokens) - 1), old[1:], mask[1:]))
    return out


async def test_backend_recipe_trains_and_makes_the_expected_update(tiny_model_dir, tmp_path):
    metrics = await load("rl_backend").main(
        ["--steps", "2", "--base-model", str(tiny_model_dir), "--path", str(tmp_path)]
    )
    assert len(metrics) == 2
    for step in metrics:
        assert step["num_updates"] == 1 and step["num_trainable_tokens"] > 0
        assert step["nothing_to_train"] == 0 and math.isfinite(step["loss"])
    run = tmp_path / "recipes" / "models" / "reverser"
    assert [json.loads(line)["step"] for line in (run / "history.jsonl").open()] == [1, 2]
    sequences = logged_sequences(run / "trajectories" / "train" / "00001.jsonl")
    assert len(sequences) == metrics[0]["num_trajectories"]
    grads = naive_gradient(tiny_model_dir, sequences)
    base = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(run / "checkpoints" / "1" / "model.safetensors")
    before = {n: base[n] for n in grads}
    share = check_first_adam_step(
        before, {n: after[n] for n in grads}, grads, 2e-4, unreached(tiny_model_dir, sequences)
    )
    print(f"exactly checked: {share:.1%} of the weights")
    assert share > 0.5, share


@pytest.mark.slow  # builds and trains two models: about 8 s
async def test_distill_recipe_runs_both_curves_and_plots(tmp_path):
    # The whole recipe at toy sizes: one SFT update each, two steps of each kind. What it
    # measures at full size is in docs/distillation.md.
    found = await load("distill").main(
        [
            *("--teacher-examples", "64", "--teacher-epochs", "1"),
            *("--student-examples", "64", "--student-epochs", "1"),
            *("--steps", "2", "--eval-every", "1", "--held-out", "8", "--prompts", "4"),
            *("--baseline", "--plot", str(tmp_path / "curve.png"), "--path", str(tmp_path)),
        ]
    )
    assert set(found["curves"]) == {"distill", "grpo"}
    for curve in found["curves"].values():
        assert [step for step, _ in curve] == [0, 1, 2]
        assert all(0.0 <= accuracy <= 1.0 for _, accuracy in curve)
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.slow  # two tiny models trained for 4 updates each: about 9 s apiece
@pytest.mark.parametrize("rank", ["16", "0"], ids=["lora", "full"])
async def test_sft_chat_recipe_trains_assistant_turns_and_lowers_held_out_loss(
    tiny_model_dir, tmp_path, rank
):
    recipe = load("sft_chat")
    found = await recipe.main(
        [
            *("--base-model", str(tiny_model_dir), "--path", str(tmp_path)),
            *("--chats", "16", "--held-out", "4", "--epochs", "2", "--batch-size", "8"),
            *("--learning-rate", "1e-3", "--lora-rank", rank),
        ]
    )
    tokenizer = load_tokenizer(str(tiny_model_dir))
    held_out = posttrain.load_sft_dataset(tmp_path / "held_out.jsonl", tokenizer)
    # Only the assistant turns are trained: each one's content and the end-of-turn token.
    for trajectory, line in zip(held_out, (tmp_path / "held_out.jsonl").open(), strict=True):
        messages = json.loads(line)["messages"]
        trained = [tokenizer.decode(list(s.tokens)) for s in trajectory.segments if s.trainable]
        answers = [m["content"] + "<|eos|>" for m in messages if m["role"] == "assistant"]
        assert trained == answers
    # The loss before training, from the base model by hand: mean -log p of the trained tokens.
    model = load_hf_model(tiny_model_dir)
    total, count = 0.0, 0
    for trajectory in held_out:
        tokens = [t for s in trajectory.segments for t in s.tokens]
        trained = [s.trainable for s in trajectory.segments for _ in s.tokens]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)
        for i in range(1, len(tokens)):
            if trained[i]:
                total, count = total - float(logp[i - 1, tokens[i]]), count + 1
    # fp32 logprobs of a few hundred tokens, summed: agreement to ~1e-6 relative.
    assert found["before"] == pytest.approx(total / count, rel=1e-5)
    assert found["after"] < found["before"] - 0.1, found
