"""Peak memory and time of per-token sampling entropies: chunked against unchunked.

Variants, each on the same hidden states [tokens, H] and lm_head weight [V, H], no gradients
(a sampler's entropies are data, not part of the loss):
  unchunked  logits = h @ W^T for all tokens at once, then the textbook
             -(softmax * log_softmax).sum(-1) over the whole [tokens, V]
  chunked    `chunk` tokens' logits at a time through `engine.decode.entropy.sampling_entropies`,
             the function the sampler runs on each decode step's logits

Memory is peak resident set size (ru_maxrss), not tracemalloc (which does not see torch's
allocations): each variant runs in a fresh process that allocates its inputs, runs a small
warm-up, reads ru_maxrss as the baseline, then runs once; peak extra = ru_maxrss after - the
baseline. glibc's malloc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold
in its heap, and a 256-token chunk's logits are 31 MiB: the children run with
MALLOC_MMAP_THRESHOLD_=4194304 (unless set), so resident size follows live tensors rather than
the allocator's cache (with glibc's default the chunked peak reads ~1.1 GiB, all of it freed
blocks kept for reuse). Time is the median of the following runs. Threads: torch's intra-op threads are set
from OMP_NUM_THREADS (printed); run with OMP_NUM_THREADS=1 on a shared machine.

    OMP_NUM_THREADS=1 python benchmarks/entropy_memory.py [--vocab 32000] [--tokens 8192]
        [--hidden 512] [--chunk 256] [--repeats 3]
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

from posttrain.engine.decode.entropy import sampling_entropies

Variant = Literal["unchunked", "chunked"]


def entropies(
    variant: Variant, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Each token's entropy of softmax(h @ W^T) by the variant, [tokens]."""
    if variant == "unchunked":
        logits_NV = hidden_NH @ weight_VH.T
        return -(logits_NV.softmax(-1) * logits_NV.log_softmax(-1)).sum(-1)
    parts = [
        sampling_entropies(hidden_NH[s : s + chunk] @ weight_VH.T, chunk_rows=chunk)
        for s in range(0, hidden_NH.shape[0], chunk)
    ]
    return torch.cat(parts)


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(variant: Variant, args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this (fresh) process: peak extra MiB, median seconds, checksum."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen) / args.hidden**0.5
    weight = torch.randn(args.vocab, args.hidden, generator=gen)
    with torch.inference_mode():
        entropies(variant, hidden[:8], weight, 4)  # kernels and thread pools into the baseline
        baseline = _max_rss_mib()
        seconds: list[float] = []
        peak, total = 0.0, 0.0
        for _ in range(1 + args.repeats):
            start = time.perf_counter()
            h_N = entropies(variant, hidden, weight, args.chunk)
            seconds.append(time.perf_counter() - start)
            if len(seconds) == 1:
                peak, total = _max_rss_mib() - baseline, float(h_N.double().sum())
            del h_N
    timed = seconds[1:] or seconds
    return {
        "peak_mib": peak,
        "seconds": statistics.median(timed),
        "baseline_mib": baseline,
        "sum": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Chunked vs unchunked entropies memory/time.")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the first")
    parser.add_argument("--child", choices=get_args(Variant), help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    print(host_line(), flush=True)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}, "
        f"float32; one [tokens, vocab] tensor = {logits_mib:.0f} MiB; memory = peak RSS "
        f"(ru_maxrss); torch threads {torch.get_num_threads()} "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}); "
        f"1-min load average {os.getloadavg()[0]:.2f}"
    )
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "chunk")]
    env = {"MALLOC_MMAP_THRESHOLD_": "4194304", **os.environ}  # see the module docstring
    print(f"MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']}")
    results: dict[str, dict[str, float]] = {}
    for variant in get_args(Variant):
        argv = [sys.executable, __file__, f"--child={variant}", f"--repeats={args.repeats}", *flags]
        results[variant] = json.loads(
            subprocess.check_output(argv, text=True, env=env).splitlines()[-1]
        )
        r = results[variant]
        print(f"  {variant:<10} peak +{r['peak_mib']:7.0f} MiB   {r['seconds']:6.3f} s   "
              f"(baseline {r['baseline_mib']:.0f} MiB, sum of entropies {r['sum']:.4f})")  # fmt: skip
    base, chunked = results["unchunked"], results["chunked"]
    memory = chunked["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else float("nan")
    print(
        f"chunked / unchunked: peak memory {memory:.3f}, "
        f"time {chunked['seconds'] / base['seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
