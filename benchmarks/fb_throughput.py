"""forward_backward throughput, and its FLOP/s as a fraction of this machine's matmul peaks
(benchmarks/cpu_peak.py) measured beside it.

FLOPs per trained token = 4 N + 2 N_trained, with N the weights of every linear layer (the
unembedding included, tied or not; the input embedding is a lookup and left out): forward 2 N,
backward 2 N for the input gradients and 2 per trained weight for the weight gradients. Full
fine-tuning is the usual 6 N; LoRA about 4 N. Attention's T^2 term is left out, so the fraction
is a slight under-estimate at long sequences. Only real tokens count, never padding.

The peaks are measured between the timed calls, not once up front: each forward_backward is
followed by one measurement of every `cpu_peak` kind (2048^3 products: fp32 through MKL, the
default path; fp32 through oneDNN; bf16), and a fraction is taken per pair, so load from other
processes lowers both sides of a pair alike. The figures reported are medians of the per-pair
fractions. Variants (`--dtypes`) alternate call by call: `float32`, `bfloat16` (bf16 weights;
with LoRA, fp32 adapters), `autocast` (fp32 weights under `torch.autocast` to bf16). The
workers are built directly, so full fine-tuning in bf16 is timed although training refuses it
(no fp32 master weights).

`--mixed RxL` adds a batch of R datums with lengths spread over [L/8, L] (as RL completions
are) under a `--micro-batch-tokens` budget, timed with the worker's micro-batching (longest
first, `engine.shared_prefix.plan_micro_batches`) and, alternating call by call, with grouping
in call order (`split_by_token_budget`, the worker's previous policy), on the first variant.

    python benchmarks/fb_throughput.py [--size small] [--lora 0] [--dtypes float32,bfloat16]
        [--shapes 8x256,16x128] [--mixed 64x256] [--micro-batch-tokens 8192] [--repeats 5]
        [--threads 2] [--gradient-checkpointing]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from host import host_line
from torch import nn

from posttrain import Datum, ModelInput
from posttrain.algo.losses import LossConfig
from posttrain.engine import batching
from posttrain.engine import worker as worker_module
from posttrain.engine.shared_prefix import MicroBatch, PrefixGroup, plan_micro_batches
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model
from posttrain.models.tiny import tiny_model_path

try:
    from cpu_peak import KINDS, MatmulKind, Peaks
except ImportError:  # run from the repository root as `python benchmarks/fb_throughput.py`
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_peak import KINDS, MatmulKind, Peaks

Pair = tuple[float, dict[MatmulKind, float]]  # seconds of one call, the peaks right after it


@dataclass(frozen=True)
class Variant:
    worker: Worker
    context: Callable[[], contextlib.AbstractContextManager[object]]


def linear_weights(model: nn.Module) -> tuple[int, int]:
    """(all, trained) weights of the model's linear layers, LoRA's included."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return sum(w.numel() for w in weights), sum(w.numel() for w in weights if w.requires_grad)


def datums(lengths: list[int], seed: int = 0) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    weight = 1.0 / sum(lengths)
    out = []
    for length in lengths:
        ids = torch.randint(3, 250, (length + 1,), generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1].tolist()),
                {"target_tokens": ids[1:], "weights": torch.full((length,), weight)},
            )
        )
    return out


def mixed_lengths(rows: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(length // 8, length + 1, (rows,), generator=gen).tolist()


@contextlib.contextmanager
def call_order_grouping() -> Iterator[None]:
    """The worker with its previous micro-batching: consecutive datums, in call order."""
    planned = worker_module.plan_micro_batches

    def call_order(rows: list[list[int]], budget: int, min_length: int) -> list[MicroBatch]:
        groups = batching.split_by_token_budget([len(r) for r in rows], budget)
        return [MicroBatch(g, [PrefixGroup((i,), 0) for i in range(len(g))]) for g in groups]

    worker_module.plan_micro_batches = call_order
    try:
        yield
    finally:
        worker_module.plan_micro_batches = planned


def build_variants(args: argparse.Namespace) -> dict[str, Variant]:
    path = tiny_model_path(size=args.size)
    config = WorkerConfig(
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    workers: dict[str, Worker] = {}
    variants: dict[str, Variant] = {}
    for name in args.dtypes.split(","):
        dtype = "bfloat16" if name == "bfloat16" else "float32"
        if dtype not in workers:
            model = load_hf_model(path, dtype=dtype)
            if args.lora:
                model = apply_lora(model, LoraSettings(rank=args.lora), seed=0)
            workers[dtype] = Worker(model, config)
        context = contextlib.nullcontext
        if name == "autocast":
            context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        elif name not in ("float32", "bfloat16"):
            raise SystemExit(f"--dtypes: {name!r} is not float32, bfloat16 or autocast")
        variants[name] = Variant(workers[dtype], context)
    return variants


def timed_pairs(
    batch: list[Datum], variants: dict[str, Variant], peaks: Peaks, repeats: int
) -> dict[str, list[Pair]]:
    """(seconds of one forward_backward, every peak right after it) per variant, the variants
    alternating call by call."""
    out: dict[str, list[Pair]] = {name: [] for name in variants}
    for round_index in range(repeats + 1):  # the first round warms up
        for name, variant in variants.items():
            with variant.context():
                start = time.perf_counter()
                variant.worker.forward_backward(batch, "cross_entropy", LossConfig())
                seconds = time.perf_counter() - start
            variant.worker.zero_grad()
            if round_index > 0:
                out[name].append((seconds, peaks.measure()))
    return out


def report(label: str, flops: float, tokens: int, pairs: list[Pair]) -> float:
    seconds = statistics.median(s for s, _ in pairs)
    fractions = {k: statistics.median(flops / s / 1e9 / p[k] for s, p in pairs) for k in KINDS}
    print(
        f"{label}: {tokens / seconds:7.0f} tokens/s {flops / seconds / 1e9:6.1f} GFLOP/s = "
        + ", ".join(f"{fractions[k]:.2f} of {k}" for k in KINDS)
        + f" (peaks: {', '.join(f'{statistics.median(p[k] for _, p in pairs):.0f}' for k in KINDS)}"
        f" GFLOP/s; calls {' '.join(f'{s:.2f}' for s, _ in pairs)} s)"
    )
    return seconds


def compare_grouping(
    args: argparse.Namespace, variant: Variant, peaks: Peaks, flops_per_token: float
) -> None:
    rows, length = (int(x) for x in args.mixed.split("x"))
    lengths = mixed_lengths(rows, length)
    budget = args.micro_batch_tokens
    longest = [m.rows for m in plan_micro_batches([[0] * n for n in lengths], budget, 0)]
    for name, groups in (
        ("longest first", longest),
        ("call order", batching.split_by_token_budget(lengths, budget)),
    ):
        padded = batching.padded_tokens(lengths, groups)
        print(f"mixed {rows}x[{length // 8},{length}], budget {budget}: {name:13s} "
              f"{len(groups)} micro-batches, {padded} tokens computed for {sum(lengths)}")  # fmt: skip
    both = {
        "longest first": variant,
        "call order": Variant(variant.worker, call_order_grouping),
    }
    pairs = timed_pairs(datums(lengths), both, peaks, args.repeats)
    flops, tokens = flops_per_token * sum(lengths), sum(lengths)
    times = {name: report(f"mixed, {name:13s}", flops, tokens, p) for name, p in pairs.items()}
    ratios = [b[0] / a[0] for a, b in zip(pairs["longest first"], pairs["call order"], strict=True)]
    print(f"longest first vs call order: {statistics.median(ratios):.2f}x faster "
          f"(per-pair {' '.join(f'{r:.2f}' for r in ratios)}; medians "
          f"{times['call order'] / times['longest first']:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="small", help="a make-tiny-model size")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank; 0 trains every weight")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="float32,bfloat16,autocast")
    parser.add_argument("--shapes", default="8x256,16x128")
    parser.add_argument("--mixed", default="", help="e.g. 64x256: lengths spread over [L/8, L]")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--peak-size", type=int, default=2048, help="n of the n x n x n peak products"
    )
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    variants = build_variants(args)
    peaks = Peaks(args.peak_size)
    first = next(iter(variants.values()))
    n, trained = linear_weights(first.worker.model)
    per_token = 4 * n + 2 * trained
    print(f"{args.size}: {n / 1e6:.1f}M linear weights, {trained / 1e6:.2f}M trained "
          f"({'LoRA ' + str(args.lora) if args.lora else 'full'}), {per_token / n:.2f} N FLOPs "
          f"a token; threads {args.threads}, gradient checkpointing {args.gradient_checkpointing}, "
          f"1-min load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for shape in filter(None, args.shapes.split(",")):
        rows, length = (int(x) for x in shape.split("x"))
        pairs = timed_pairs(datums([length] * rows), variants, peaks, args.repeats)
        for name, p in pairs.items():
            report(f"{rows:3d} x {length:4d} {name:9s}", per_token * rows * length, rows * length, p)  # fmt: skip
    if args.mixed:
        compare_grouping(args, first, peaks, per_token)
    print(f"1-min load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
