"""Peak memory and time of forward+backward token logprobs: chunked against unchunked.

Variants, each on the same hidden states [tokens, H], lm_head weight [V, H] and targets, with
loss = sum(logp * adv) for random per-token advantages:
  unchunked       logits = h @ W^T, then log_softmax over the whole [tokens, V] and gather
  chunked_logits  the same logits, then `token_logprobs` (softmax chunked, logits still whole)
  chunked_hidden  `token_logprobs_from_hidden` (no [tokens, V] tensor at all)

Each variant runs in a fresh process that allocates its inputs, runs one small warm-up, reads
its peak resident set size (ru_maxrss) as the baseline, then runs forward+backward: peak extra
memory = ru_maxrss after the first run - baseline. Time is the median of the following runs.
Tensors above glibc's mmap threshold (at most 32 MiB) are mmapped and returned on free, so
at the default sizes resident size follows live tensors; at small sizes it is coarser.

    python benchmarks/logprobs_memory.py [--vocab 32000] [--tokens 8192] [--hidden 512]
        [--chunk 1024] [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Literal, get_args

import torch
from host import host_line

from posttrain.algo.logprobs import token_logprobs, token_logprobs_from_hidden

Variant = Literal["unchunked", "chunked_logits", "chunked_hidden"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def forward_backward(
    variant: Variant,
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    adv_N: torch.Tensor,
    chunk: int,
) -> None:
    """One forward and backward pass of the variant; gradients land in hidden and weight."""
    hidden_BTH, targets_BT = hidden_NH.unsqueeze(0), targets_N.unsqueeze(0)
    if variant == "chunked_hidden":
        logp_BT, _ = token_logprobs_from_hidden(hidden_BTH, weight_VH, targets_BT, chunk_size=chunk)
    elif variant == "chunked_logits":
        logp_BT, _ = token_logprobs(hidden_BTH @ weight_VH.T, targets_BT, chunk_size=chunk)
    else:
        logits_BTV = (hidden_BTH @ weight_VH.T).float()
        logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, targets_BT.unsqueeze(-1))
    (logp_BT.flatten() * adv_N).sum().backward()


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(variant: Variant, args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this (fresh) process: peak extra MiB and median seconds."""
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = (torch.randn(args.tokens, args.hidden, generator=gen) / args.hidden**0.5).to(dtype)
    weight = torch.randn(args.vocab, args.hidden, generator=gen).to(dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    adv = torch.randn(args.tokens, generator=gen)
    # Warm up kernels and thread pools on a tiny slice, so the baseline includes their memory.
    forward_backward(variant, hidden[:8].detach().requires_grad_(), weight, targets[:8], adv[:8], 4)
    weight.grad = None
    baseline = _max_rss_mib()
    seconds: list[float] = []
    peak = 0.0
    for _ in range(1 + args.repeats):
        hidden.grad, weight.grad = None, None
        start = time.perf_counter()
        forward_backward(variant, hidden, weight, targets, adv, args.chunk)
        seconds.append(time.perf_counter() - start)
        if len(seconds) == 1:
            peak = _max_rss_mib() - baseline
    timed = seconds[1:] or seconds
    return {"peak_mib": peak, "seconds": statistics.median(timed), "baseline_mib": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description="Chunked vs unchunked logprobs memory/time.")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the first")
    parser.add_argument("--child", choices=get_args(Variant), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    print(host_line(), flush=True)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}, "
        f"{args.dtype}; one float32 [tokens, vocab] tensor = {logits_mib:.0f} MiB; "
        f"1-min load average {os.getloadavg()[0]:.2f}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "chunk", "dtype")]
    results: dict[str, dict[str, float]] = {}
    for variant in get_args(Variant):
        argv = [sys.executable, __file__, f"--child={variant}", f"--repeats={args.repeats}", *flags]
        results[variant] = json.loads(subprocess.check_output(argv, text=True).splitlines()[-1])
        r = results[variant]
        print(f"  {variant:<15} peak +{r['peak_mib']:7.0f} MiB   {r['seconds']:6.2f} s   "
              f"(baseline {r['baseline_mib']:.0f} MiB)")  # fmt: skip
    base = results["unchunked"]
    print("ratios to unchunked (chunked / unchunked; below 1 means less):")
    for variant in ("chunked_logits", "chunked_hidden"):
        r = results[variant]
        # ru_maxrss may not grow at tiny sizes: a zero peak gives no ratio rather than a crash.
        memory = r["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else float("nan")
        smaller = f"{1 / memory:.1f}x smaller" if memory > 0 else "n/a"
        print(f"  {variant:<15} peak memory ratio {memory:.3f} ({smaller})   "
              f"time ratio {r['seconds'] / base['seconds']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
