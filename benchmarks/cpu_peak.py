"""This machine's matmul ceiling: GFLOP/s of an n x n x n product (2048 by default).

Kinds: `fp32` is `torch.mm` on float32 (torch routes it to MKL's sgemm); `fp32_onednn` is the
same float32 product through oneDNN (`torch._C._nn.mkldnn_linear` on tensors converted once to
the mkldnn layout, conversion not timed; still true float32, no reduced-precision math mode);
`bf16` is `torch.mm` on bfloat16 (torch routes it to oneDNN's brgemm). Each figure is the
median of several timed runs after warm-up, with FLOPs = 2 n^3; the script reports the best
of a few such medians, each from a fresh process: other processes on the machine take cores
and only ever lower a figure.

    python benchmarks/cpu_peak.py [--size 2048] [--repeats 7] [--rounds 3]

Other benchmarks import `matmul_gflops(kind)`; it measures in the calling process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Literal, get_args

import torch

MatmulKind = Literal["fp32", "fp32_onednn", "bf16"]


def product(kind: MatmulKind, size: int) -> Callable[[], object]:
    """A closure computing one size^3 product of the given kind on fixed random inputs."""
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


def matmul_gflops(
    kind: MatmulKind = "fp32", *, size: int = 2048, repeats: int = 7, warmup: int = 3
) -> float:
    """Median GFLOP/s of `repeats` timed size^3 products of `kind`, after `warmup` untimed ones."""
    if kind not in get_args(MatmulKind):
        raise ValueError(f"kind must be one of {get_args(MatmulKind)}, got {kind!r}")
    if size < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need size >= 1, repeats >= 1, warmup >= 0; got {size}, {repeats}, {warmup}"
        )
    run = product(kind, size)
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds) / 1e9


def _in_fresh_process(
    kinds: list[MatmulKind], size: int, repeats: int, env: dict[str, str]
) -> list[float]:
    """Measure `kinds` one after another in a new Python process with environment `env`."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from cpu_peak import matmul_gflops; "
        "print(json.dumps([matmul_gflops(k, size=int(sys.argv[2]), repeats=int(sys.argv[3])) "
        "for k in sys.argv[4:]]))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    argv = [sys.executable, "-c", code, here, str(size), str(repeats), *kinds]
    stdout = subprocess.check_output(argv, env=env, text=True)
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="Matmul GFLOP/s ceiling of this machine.")
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7, help="timed products per median")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per figure")
    args = parser.parse_args()
    # Other processes take cores from the products and only ever lower a figure, so each
    # figure is the best of `rounds` fresh-process medians; all rounds are shown.
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.size}^3 products, "
          f"best of {args.rounds} rounds, 1-min load average {os.getloadavg()[0]:.2f} before")  # fmt: skip
    best: dict[str, float] = {}
    for kind in get_args(MatmulKind):
        rounds = [_in_fresh_process([kind], args.size, args.repeats, dict(os.environ))[0]
                  for _ in range(args.rounds)]  # fmt: skip
        best[kind] = max(rounds)
        print(f"  {kind:<12} {best[kind]:7.1f} GFLOP/s   rounds {_fmt(rounds)}")
    print(f"  fp32_onednn / fp32 = {best['fp32_onednn'] / best['fp32']:.2f}x, "
          f"bf16 / fp32_onednn = {best['bf16'] / best['fp32_onednn']:.2f}x")  # fmt: skip
    print(f"1-min load average {os.getloadavg()[0]:.2f} after")


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" for v in values)


if __name__ == "__main__":
    main()
