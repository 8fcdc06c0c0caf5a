"""On-policy distillation on the built-in `reverse` task: a small student learns from a larger
teacher trained here first, on CPU (about 2.5 minutes with --baseline on a quiet 2-core
machine; numbers in docs/distillation.md).

Run: OMP_NUM_THREADS=2 python recipes/distill.py [--steps 60] [--plot distill.png]

1. Teacher: the 0.5M-parameter `mini` model, SFT on solved problems (99% held out).
2. Student: the 0.1M-parameter `tiny` model, an SFT warm-up on fewer solved problems (~20%).
3. Distillation: each step the student samples completions of training prompts, the teacher
   scores the student's exact tokens, and `backend.train(..., teacher=teacher)` makes each
   token's advantage teacher - student logprob. The task reward is not used (`--reward-coef`
   mixes it in).
4. The student's held-out greedy accuracy, every `--eval-every` steps, against the teacher's;
   printed, and plotted to `--plot`. `--baseline` also runs the same steps as plain GRPO on the
   task reward from the same warm-up, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Literal

from posttrain import (
    LocalBackend,
    SamplingParams,
    Teacher,
    TrainableModel,
    evaluate,
    make_tiny_model,
    sample_groups,
    sft_examples,
)
from posttrain.tasks import ReverseTask

TASK = ReverseTask()
MAX_TOKENS = 10  # a 6-letter answer, EOS, and room to be wrong


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--teacher-examples", type=int, default=2000)
    parser.add_argument("--teacher-epochs", type=int, default=24)
    parser.add_argument("--teacher-lr", type=float, default=1e-3, help="teacher SFT")
    parser.add_argument("--student-examples", type=int, default=640)
    parser.add_argument("--student-epochs", type=int, default=13)
    parser.add_argument("--student-lr", type=float, default=3e-3, help="student warm-up")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--reward-coef", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--baseline", action="store_true", help="also run GRPO on the reward")
    parser.add_argument("--plot", type=Path, default=Path("distill.png"))
    parser.add_argument("--path", type=Path, default=None, help="run directory (default: temp)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


async def accuracy(backend: LocalBackend, model: TrainableModel, held_out: int) -> float:
    found = await evaluate(
        backend.sampling_client(model), TASK, held_out=held_out, max_tokens=MAX_TOKENS
    )
    return found.accuracy


async def warmed_up(
    backend: LocalBackend,
    name: str,
    size: Literal["tiny", "mini"],
    examples: int,
    epochs: int,
    learning_rate: float,
    seed: int,
) -> TrainableModel:
    """A registered model of `size`, SFT on `examples` solved training problems."""
    model = TrainableModel(
        name=name,
        project="distill",
        base_model=str(make_tiny_model(backend.path / "bases" / size, size=size)),
        lora_rank=None,
    )
    await model.register(backend)
    problems = TASK.make_prompts(random.Random(seed), examples)
    tokenizer = backend.sampling_client(model).tokenizer
    await backend.train_sft(
        model,
        sft_examples(TASK, problems, tokenizer),
        learning_rate=learning_rate,
        lr_schedule="constant",
        batch_size=64,
        epochs=epochs,
        save_checkpoint=False,
    )
    return model


async def train_student(
    backend: LocalBackend,
    model: TrainableModel,
    args: argparse.Namespace,
    teacher: Teacher | None,
) -> list[tuple[int, float]]:
    """`args.steps` steps (distillation with a teacher, else GRPO): (step, accuracy) rows."""
    rng = random.Random(args.seed + 1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    curve = [(0, await accuracy(backend, model, args.held_out))]
    label = "distill" if teacher is not None else "grpo"
    for step in range(1, args.steps + 1):
        problems = TASK.make_prompts(rng, args.prompts)
        sampled = await sample_groups(
            backend.sampling_client(model), TASK, problems, args.group_size, params
        )
        options = {"teacher": teacher, "distill_reward_coef": args.reward_coef} if teacher else {}
        result = await backend.train(
            model,
            sampled.groups,
            learning_rate=args.learning_rate,
            loss="importance_sampling",
            save_checkpoint=False,
            **options,  # pyright: ignore[reportArgumentType]
        )
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, await accuracy(backend, model, args.held_out)))
            kl = result.metrics.get("teacher_kl")
            shown = f" teacher_kl {kl:.3f}" if kl is not None else ""
            print(
                f"{label} step {step:3d}  reward {result.metrics['reward']:.3f}{shown}  "
                f"held-out accuracy {curve[-1][1]:.3f}",
                flush=True,
            )
    return curve


def plot(
    path: Path,
    curves: dict[str, list[tuple[int, float]]],
    teacher_accuracy: float,
) -> None:
    # A bare Agg Figure, as the job's report: the caller's matplotlib backend is left alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [a for _, a in curve], marker="o", label=label)
    ax.axhline(teacher_accuracy, color="gray", linestyle="--", label="teacher (mini)")
    ax.set_xlabel("student step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("reverse: tiny student distilled from a mini teacher")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


async def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    path = args.path or Path(tempfile.mkdtemp(prefix="posttrain-distill-"))
    backend = LocalBackend(path)
    start = time.perf_counter()
    teacher_model = await warmed_up(
        backend,
        "teacher",
        "mini",
        args.teacher_examples,
        args.teacher_epochs,
        args.teacher_lr,
        args.seed,
    )
    teacher_accuracy = await accuracy(backend, teacher_model, args.held_out)
    print(f"teacher (mini) held-out accuracy {teacher_accuracy:.3f}", flush=True)
    teacher = Teacher(backend.sampling_client(teacher_model), name="teacher (mini)")

    curves: dict[str, list[tuple[int, float]]] = {}
    kinds = [("distill", teacher), *([("grpo", None)] if args.baseline else [])]
    for label, kind_teacher in kinds:
        student = await warmed_up(
            backend,
            f"student-{label}",
            "tiny",
            args.student_examples,
            args.student_epochs,
            args.student_lr,
            args.seed + 2,
        )
        curves[label] = await train_student(backend, student, args, kind_teacher)
    await backend.close()
    seconds = time.perf_counter() - start
    plot(args.plot, curves, teacher_accuracy)
    for label, curve in curves.items():
        print(f"{label}: student held-out accuracy {curve[0][1]:.3f} -> {curve[-1][1]:.3f}")
    print(f"teacher {teacher_accuracy:.3f}; {seconds:.0f} s in all; plot {args.plot}")
    return {"teacher": teacher_accuracy, "curves": curves, "seconds": seconds}


if __name__ == "__main__":
    asyncio.run(main())
