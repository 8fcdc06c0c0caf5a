"""Where a GRPO step's time goes: py-spy samples posttrain's side of `vs_trl.py` and splits
the samples by phase.

The child process runs `vs_trl.PosttrainSide` (the same step as the TRL comparison: sample_many,
TrajectoryBuilder, backend.train) for `--warmup` steps, then py-spy attaches to it and records
every thread at `--rate` Hz through `--steps` more steps (the model build and warm-up are not
recorded). Each sample is put in the first phase whose function is on its stack, searched from
the outermost frame:

- sampling: posttrain's sampler (`sample_many`);
- forward_backward, optim_step: the training client's calls;
- logprobs: the trainer's extra logprob passes (`precalculate_logprobs`, reference scores);
- outside them: the rest of the step's wall time (building trajectories, advantages, Python
  between calls), computed as the mean step time minus the phases.

A phase's time per step is its samples / rate / steps: the phases run one at a time on the
training client's compute thread, so their samples are that thread's wall time. Samples that
fall in no phase (threads waiting, the event loop) are not counted as time. py-spy shares the
two cores with the step, so steps run slower under it; the split, not the total, is the result.

Within each phase the script lists the leaf functions with the most samples (self time). With
`--native`, py-spy also unwinds C/C++ frames, so the leaves are torch's kernels (MKL's sgemm,
oneDNN's brgemm, ...) instead of the Python call that reached them; it samples slower.

    OMP_NUM_THREADS=2 python benchmarks/profile_step.py [--model-size small] [--dtype float32]
        [--lora-rank R] [--steps 3] [--warmup 1] [--rate 50] [--native] [--top 8]

py-spy is a benchmark-only dependency: `pip install -r benchmarks/requirements-trl.txt`.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host import host_line

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampling", ("sample_many", "sample")),
    ("forward_backward", ("forward_backward",)),
    ("optim_step", ("optim_step",)),
    ("logprobs", ("precalculate_logprobs", "reference_logprobs", "compute_logprobs")),
)
START_MARK = "profile_step: ready"
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1


def phase_of(frames: list[str]) -> str:
    """The first phase whose function is on the stack (outermost frame first)."""
    for frame in frames:
        names = frame.split(" (", 1)[0].split(".")  # Class.method.<locals>.<lambda>
        for phase, functions in PHASES:
            if any(name in functions for name in names):
                return phase
    return "other"


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's `--format raw` (collapsed stacks): `frame;frame;... count` per line."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def summarize(
    stacks: list[tuple[list[str], int]], step_seconds: list[float], rate: int, top: int
) -> dict[str, object]:
    by_phase: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for frames, n in stacks:
        phase = phase_of(frames)
        by_phase[phase] += n
        leaves[phase][frames[-1]] += n
    steps = len(step_seconds)
    step = sum(step_seconds) / steps
    phases = {p: by_phase[p] / rate / steps for p, _ in PHASES}
    return {
        "step_seconds": step,
        "phase_seconds": {**phases, "outside": max(0.0, step - sum(phases.values()))},
        "leaves": {p: leaves[p].most_common(top) for p, _ in PHASES if by_phase[p]},
    }


def print_summary(summary: dict) -> None:
    step = summary["step_seconds"]
    print(f"\nmean step under py-spy {step:.2f} s; per step:")
    for phase, seconds in summary["phase_seconds"].items():
        print(f"  {phase:18s} {seconds:7.2f} s  {seconds / step:6.1%}")
    for phase, leaves in summary["leaves"].items():
        print(f"\n{phase}: leaf functions by samples")
        for frame, n in leaves:
            print(f"  {n:6d}  {frame[:110]}")


def child(args: argparse.Namespace) -> None:
    """The profiled process: posttrain's side of the TRL comparison, alone."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from vs_trl import BenchConfig, PosttrainSide, make_problems

    from posttrain.models.tiny import tiny_model_path

    config = BenchConfig(
        model_size=args.model_size,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        warmup_steps=args.warmup,
        steps=args.steps,
        rounds=1,
        threads=args.threads,
    )
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model_path = tiny_model_path(size=config.model_size)  # pyright: ignore[reportArgumentType]
    problems = make_problems(config)
    batches = [problems[i : i + config.prompts] for i in range(0, len(problems), config.prompts)]
    with tempfile.TemporaryDirectory(prefix="posttrain-profile-") as tmp:
        side = PosttrainSide(model_path, config, Path(tmp))
        for batch in batches[: config.warmup_steps]:
            side.step(batch)
        allow_tracing_by_parent_tools()
        print(START_MARK, flush=True)
        sys.stdin.readline()  # py-spy is attached
        for batch in batches[config.warmup_steps :]:
            timing = side.step(batch)
            print(f"step {timing.seconds:.2f} s (sampling {timing.generation_seconds:.2f} s)")
        side.close()


def allow_tracing_by_parent_tools() -> None:
    """Let py-spy (not this process's ancestor) attach where Linux's Yama restricts ptrace."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-size", default="small", choices=["tiny", "mini", "small", "qwen2.5-0.5b"]
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="unwind C/C++ frames too")
    parser.add_argument("--top", type=int, default=8, help="leaf functions listed per phase")
    parser.add_argument("--output", type=Path, default=None, help="keep py-spy's raw stacks")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    print(host_line(), flush=True)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install -r benchmarks/requirements-trl.txt")
    with tempfile.TemporaryDirectory(prefix="posttrain-pyspy-") as tmp:
        raw = args.output or Path(tmp) / "stacks.txt"
        command = [py_spy, "record", "--format", "raw", "--rate", str(args.rate), "-o", str(raw)]
        command += ["--native"] if args.native else []
        child_args = [sys.executable, __file__, "--child", *child_arguments(args)]
        process = subprocess.Popen(
            child_args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert process.stdin is not None and process.stdout is not None
        for line in process.stdout:
            if line.strip() == START_MARK:
                break
        else:
            raise SystemExit(
                f"the profiled process ended before its warm-up finished ({process.wait()})"
            )
        recorder = subprocess.Popen([*command, "--pid", str(process.pid)])
        time.sleep(1.0)  # let py-spy attach before the first measured step
        process.stdin.write("go\n")
        process.stdin.flush()
        step_seconds = []
        for line in process.stdout:
            print(line, end="")
            if line.startswith("step "):
                step_seconds.append(float(line.split()[1]))
        if process.wait() != 0:
            raise SystemExit(f"the profiled process failed ({process.returncode})")
        recorder.wait()
        stacks = parse_raw(raw.read_text())
    if not stacks or not step_seconds:
        raise SystemExit("py-spy recorded no sample inside the measured steps")
    print_summary(summarize(stacks, step_seconds, args.rate, args.top))


def child_arguments(args: argparse.Namespace) -> list[str]:
    out = ["--model-size", args.model_size, "--dtype", args.dtype]
    out += [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]
    if args.lora_rank is not None:
        out += ["--lora-rank", str(args.lora_rank)]
    return out


if __name__ == "__main__":
    main()
