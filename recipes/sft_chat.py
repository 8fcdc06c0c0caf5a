"""Chat SFT on a real model: train the assistant turns of two-turn chats, and watch the loss on
held-out chats fall.

Each chat is a word problem (`posttrain.tasks.word_problems`) answered with its sum written
out ("7 + 5 = 12."), then a follow-up question and its answer. The chats are written to JSONL
files and read back with `load_sft_dataset`, as your own chats would be: only the assistant
turns are trained, the system and user turns are context. The held-out chats come from the
task's held-out problems, so none of their stories is trained on. The held-out loss is the
mean negative logprob of the held-out assistant tokens (each turn's content and its end-of-turn
token: what SFT trains), scored with `sampler.compute_logprobs`.

Run: python recipes/sft_chat.py --base-model packaged:smollm2-135m-instruct (or a model
directory; without one, a tiny random model) [--chats 128] [--epochs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path

import posttrain
from posttrain.tasks import Problem, WordProblemsTask

SYSTEM_PROMPT = "Write the calculation, then the answer."


def chat(problem: Problem, more: int) -> list[dict[str, str]]:
    """The problem answered with its sum, a follow-up ("gets `more` more") and its answer."""
    words = problem.prompt.replace(".", " ").split()
    a, b = (int(w) for w in words if w.isdigit())
    sign = "+" if "more" in words else "-"
    answer, then = int(problem.reference()), int(problem.reference()) + more
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": f"{a} {sign} {b} = {answer}."},
        {"role": "user", "content": f"Then {words[0]} gets {more} more. How many now?"},
        {"role": "assistant", "content": f"{answer} + {more} = {then}."},
    ]


def write_chats(path: Path, problems: list[Problem], rng: random.Random) -> Path:
    lines = [json.dumps({"messages": chat(p, rng.randint(1, 9))}) for p in problems]
    path.write_text("\n".join(lines) + "\n")
    return path


async def held_out_loss(sampler, trajectories: list[posttrain.Trajectory]) -> float:
    """Mean negative logprob of the trainable (assistant) tokens, under the current weights."""
    total, count = 0.0, 0
    for trajectory in trajectories:
        tokens = [t for s in trajectory.segments for t in s.tokens]
        trained = [s.trainable for s in trajectory.segments for _ in s.tokens]
        logprobs = await sampler.compute_logprobs(tokens)  # [None, lp(token 1 | token 0), ...]
        for logprob, is_trained in zip(logprobs[1:], trained[1:], strict=True):
            if is_trained and logprob is not None:
                total, count = total - logprob, count + 1
    return total / count


async def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", help="model directory (default: build a tiny one)")
    parser.add_argument("--chats", type=int, default=128, help="training chats")
    parser.add_argument("--held-out", type=int, default=32, help="held-out chats")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning")
    parser.add_argument("--path", help="where the run and its chats go (default: a temp dir)")
    args = parser.parse_args(argv)
    path = args.path or tempfile.mkdtemp(prefix="posttrain-sft-chat-")
    base = args.base_model or str(posttrain.make_tiny_model(tempfile.mkdtemp()))
    backend = posttrain.LocalBackend(path)
    # LoRA leaves the unembedding alone: on a model with tied embeddings (SmolLM2) it is the
    # input embedding too. Full fine-tuning (rank 0) trains every weight.
    model = posttrain.TrainableModel(
        name="chat",
        project="recipes",
        base_model=base,
        lora_rank=args.lora_rank,
        train_unembed=args.lora_rank == 0,
    )
    await model.register(backend)
    sampler = backend.sampling_client(model)
    task, rng = WordProblemsTask(), random.Random(0)
    directory = Path(path)
    train_file = write_chats(directory / "train.jsonl", task.make_prompts(rng, args.chats), rng)
    test_file = write_chats(directory / "held_out.jsonl", task.held_out(0, args.held_out), rng)
    train = posttrain.load_sft_dataset(train_file, sampler.tokenizer)
    test = posttrain.load_sft_dataset(test_file, sampler.tokenizer)
    before = await held_out_loss(sampler, test)
    result = await backend.train_sft(
        model,
        train,
        learning_rate=args.learning_rate,
        epochs=args.epochs,
        batch_size=args.batch_size,
    )
    after = await held_out_loss(sampler, test)
    updates = int(result.metrics["num_updates"])
    print(f"{len(train)} chats, {updates} updates, train loss {result.metrics['loss']:.4f}")
    print(f"held-out loss ({len(test)} chats): {before:.4f} -> {after:.4f}")
    await backend.close()
    return {"before": before, "after": after, "train_loss": result.metrics["loss"]}


if __name__ == "__main__":
    asyncio.run(main())
