"""RL on the raw TrainingClient primitives (Tinker-style): sample, score, forward_backward, step.

Task: reverse a short lowercase string. Reward 1 for the exact reversal followed by EOS, else
partial credit for answering in lowercase letters (see `reward`).
Run: python recipes/rl_primitives.py --steps 20 [--base-model DIR]
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
from dataclasses import dataclass

import torch

from posttrain import (
    AdamParams,
    Datum,
    ModelInput,
    SamplingParams,
    create_training_client,
    group_advantages,
    make_tiny_model,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", help="model directory (default: build a tiny one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def render_prompt(tokenizer, word: str) -> list[int]:
    messages = [{"role": "user", "content": f"reverse: {word}"}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def reward(tokenizer, tokens: list[int], stop_reason: str, word: str) -> float:
    """1 for the exact reversal then EOS; otherwise 0.5 x the share of lowercase letters in the
    answer. The partial credit tells samples of an untrained model apart, so a group's rewards
    vary and even the first steps have a gradient."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if stop_reason == "stop" and text.strip() == word[::-1]:
        return 1.0
    return 0.5 * sum(c in string.ascii_lowercase for c in text) / max(1, len(text))


def make_datum(prompt: list[int], tokens: list[int], logprobs: list[float], adv: float) -> Datum:
    """Context tokens get advantage 0; sampled tokens carry the sequence's advantage."""
    full = prompt + tokens
    n_prompt = len(prompt) - 1  # targets are full[1:], the first len(prompt)-1 are prompt
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + logprobs,
            "advantages": [0.0] * n_prompt + [adv] * len(tokens),
            "mask": [0.0] * n_prompt + [1.0] * len(tokens),
        },
    )


@dataclass
class Step:
    reward: float  # mean over every sample of the step
    datums: list[Datum]  # what forward_backward got (empty: no group had reward variance)
    loss: float | None  # forward_backward's summed loss, None when nothing was trained


def rl_step(client, tokenizer, rng: random.Random, args: argparse.Namespace) -> Step:
    """Sample a group per prompt, GRPO advantages, one token-mean PPO update."""
    words = ["".join(rng.choices("abcdefgh", k=rng.randint(3, 5))) for _ in range(args.prompts)]
    prompts = [render_prompt(tokenizer, w) for w in words]
    params = SamplingParams(max_tokens=12, temperature=1.0)
    futures = [client.sample(ModelInput.from_ints(p), args.group_size, params) for p in prompts]
    datums, all_rewards = [], []
    for prompt, word, future in zip(prompts, words, futures, strict=True):
        sequences = future.result().sequences
        rewards_G = torch.tensor(
            [reward(tokenizer, s.tokens, s.stop_reason, word) for s in sequences]
        )
        all_rewards += rewards_G.tolist()
        adv_G = group_advantages(rewards_G)
        for seq, adv in zip(sequences, adv_G.tolist(), strict=True):
            if adv != 0.0:
                datums.append(make_datum(prompt, seq.tokens, seq.logprobs or [], adv))
    mean_reward = sum(all_rewards) / len(all_rewards)
    if not datums:
        return Step(mean_reward, [], None)
    # Token-mean reduction: scale advantages by 1 / (trainable tokens in the batch).
    total = sum(float(d.loss_fn_inputs["mask"].sum()) for d in datums)
    datums = [
        Datum(
            d.model_input,
            {**d.loss_fn_inputs, "advantages": d.loss_fn_inputs["advantages"] / total},
        )
        for d in datums
    ]
    out = client.forward_backward(datums, "ppo").result()
    client.optim_step(AdamParams(learning_rate=args.learning_rate, grad_clip_norm=1.0)).result()
    return Step(mean_reward, datums, out.metrics["loss:sum"])


def main(argv: list[str] | None = None) -> list[Step]:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    base = args.base_model or make_tiny_model(tempfile.mkdtemp(), seed=args.seed)
    client = create_training_client(base, lora_rank=None, seed=args.seed)
    tokenizer = client.get_tokenizer()
    steps = []
    for number in range(1, args.steps + 1):
        step = rl_step(client, tokenizer, rng, args)
        steps.append(step)
        loss = "n/a" if step.loss is None else f"{step.loss:+.4f}"
        print(f"step {number:3d}  reward {step.reward:.3f}  datums {len(step.datums)}  loss {loss}")
    client.close()
    return steps


if __name__ == "__main__":
    main()
