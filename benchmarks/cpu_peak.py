"""This machine's matmul ceiling: GFLOP/s of an n x n x n product (2048 by default).

Kinds: `fp32` is `torch.mm` on float32 (torch routes it to MKL's sgemm: the default path);
`fp32_onednn` is the same float32 product through oneDNN (`torch._C._nn.mkldnn_linear` on
tensors converted once to the mkldnn layout, conversion not timed; still true float32, no
reduced-precision math mode); `bf16` is `torch.mm` on bfloat16 (torch routes it to oneDNN's
brgemm). FLOPs = 2 n^3; a figure is the median of `repeats` timed products after warm-up.

The kinds alternate in one process, round after round, so that load from other processes
lowers all of them alike; each round's ratios (oneDNN / fp32, bf16 / oneDNN) are taken within
the round. The script prints every round, each kind's median and best, and the median ratios.
Other benchmarks measure `Peaks` between their own timed calls in the same way.

    python benchmarks/cpu_peak.py [--size 2048] [--repeats 5] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Literal, get_args

import torch
from host import host_line

MatmulKind = Literal["fp32", "fp32_onednn", "bf16"]
KINDS: tuple[MatmulKind, ...] = get_args(MatmulKind)


def product(kind: MatmulKind, size: int) -> Callable[[], object]:
    """A closure computing one size^3 product of the given kind on fixed random inputs."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    if kind == "fp32":
        return lambda: torch.mm(a, b)
    if kind == "bf16":
        a16, b16 = a.bfloat16(), b.bfloat16()
        return lambda: torch.mm(a16, b16)
    a_mkldnn, b_mkldnn = a.to_mkldnn(), b.to_mkldnn()
    # mkldnn_linear computes a @ b.T: the same 2 n^3 FLOPs as a @ b.
    return lambda: torch._C._nn.mkldnn_linear(a_mkldnn, b_mkldnn, None)  # pyright: ignore[reportAttributeAccessIssue]


class Peaks:
    """Every kind's product, built once; `measure()` times each kind in turn."""

    def __init__(self, size: int = 2048, repeats: int = 3, warmup: int = 1) -> None:
        if size < 1 or repeats < 1 or warmup < 0:
            raise ValueError(f"need size >= 1, repeats >= 1, warmup >= 0; got {size}, {repeats}, {warmup}")  # fmt: skip
        self.size, self.repeats, self.warmup = size, repeats, warmup
        self.products: dict[MatmulKind, Callable[[], object]] = {
            kind: product(kind, size) for kind in KINDS
        }

    def measure(self) -> dict[MatmulKind, float]:
        """GFLOP/s of each kind: the median of `repeats` products after `warmup` untimed ones."""
        out: dict[MatmulKind, float] = {}
        for kind, run in self.products.items():
            for _ in range(self.warmup):
                run()
            seconds = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - start)
            out[kind] = 2 * self.size**3 / statistics.median(seconds) / 1e9
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Matmul GFLOP/s ceiling of this machine.")
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="timed products per figure")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every kind in turn")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.size}^3 products, "
          f"{args.rounds} rounds of {' '.join(KINDS)}, median of {args.repeats} each; "
          f"1-min load average {os.getloadavg()[0]:.2f} before")  # fmt: skip
    peaks = Peaks(args.size, args.repeats)
    rounds = []
    for index in range(args.rounds):
        rounds.append(peaks.measure())
        print(f"  round {index + 1}: " + "  ".join(f"{k} {v:6.1f}" for k, v in rounds[-1].items()))
    for kind in KINDS:
        values = [r[kind] for r in rounds]
        print(f"  {kind:<12} median {statistics.median(values):7.1f} GFLOP/s, best {max(values):7.1f}")  # fmt: skip
    onednn = statistics.median(r["fp32_onednn"] / r["fp32"] for r in rounds)
    bf16 = statistics.median(r["bf16"] / r["fp32_onednn"] for r in rounds)
    print(f"  per round: fp32_onednn / fp32 = {onednn:.2f}x, bf16 / fp32_onednn = {bf16:.2f}x")
    print(f"1-min load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
