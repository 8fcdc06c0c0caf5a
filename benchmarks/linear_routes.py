"""Would routing a training step's float32 linear layers through oneDNN pay on this CPU?

torch computes a float32 `F.linear` with MKL's sgemm (the default path). oneDNN can compute the
same float32 product (no reduced-precision math mode) through `torch.ops.mkldnn._linear_pointwise`,
either on the plain weight or on one reordered once into oneDNN's blocked layout
(`_reorder_linear_weight`). A reordered weight only pays when the reorder is amortised: over a
step's micro-batches (the weights change at each optim_step), or for good with LoRA's frozen
base. The backward pass has two more products per layer: the input gradient (grad_out @ W, a
second layout of the same weight) and the weight gradient (grad_out^T @ x, two activations: no
weight to reorder).

For each layer shape of `--size` at `--tokens` tokens, the script times the three products of
a layer on both paths, alternating path by path, and prints GFLOP/s and oneDNN / MKL. The last
line weighs the shapes by their FLOPs in a forward_backward: the speed-up a full routing would
give the matmuls, an upper bound on the step's. `cpu_peak.py`'s 2048^3 kinds run beside it.

    OMP_NUM_THREADS=2 python benchmarks/linear_routes.py [--size small] [--tokens 2048]
        [--repeats 5] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from posttrain.models.tiny import build_config

sys.path.insert(0, str(Path(__file__).parent))
from cpu_peak import Peaks
from host import host_line

Product = Callable[[], object]


def layer_shapes(size: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear layer of the model `size` (the unembedding included)."""
    config = build_config(size=size)  # pyright: ignore[reportArgumentType]
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return {
        "q_proj/o_proj": (hidden, heads * head_dim),
        "k_proj/v_proj": (hidden, kv * head_dim),
        "gate/up_proj": (hidden, config.intermediate_size),
        "down_proj": (config.intermediate_size, hidden),
        "lm_head": (hidden, config.vocab_size),
    }


def layer_counts(size: str) -> dict[str, int]:
    """How many of each shape a forward runs (q and o share a shape, as do k and v)."""
    layers = build_config(size=size).num_hidden_layers  # pyright: ignore[reportArgumentType]
    return {
        "q_proj/o_proj": 2 * layers,
        "k_proj/v_proj": 2 * layers,
        "gate/up_proj": 2 * layers,
        "down_proj": layers,
        "lm_head": 1,
    }


def products(tokens: int, fan_in: int, fan_out: int) -> dict[str, dict[str, Product]]:
    """The forward, input-gradient and weight-gradient products on MKL and on oneDNN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=gen)
    w = torch.randn(fan_out, fan_in, generator=gen)
    grad = torch.randn(tokens, fan_out, generator=gen)
    linear = torch.ops.mkldnn._linear_pointwise
    packed = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
    w_t = w.t().contiguous()
    packed_t = torch.ops.mkldnn._reorder_linear_weight(w_t, tokens)
    grad_t, x_t = grad.t().contiguous(), x.t().contiguous()
    return {
        "mkl": {
            "forward": lambda: F.linear(x, w),
            "grad_input": lambda: grad @ w,
            "grad_weight": lambda: grad.t() @ x,
        },
        "onednn": {
            "forward": lambda: linear(x, packed, None, "none", [], ""),
            "grad_input": lambda: linear(grad, packed_t, None, "none", [], ""),
            # No weight to reorder: both operands are activations (transposes included).
            "grad_weight": lambda: linear(grad_t, x_t, None, "none", [], ""),
        },
    }


def seconds(product: Product, repeats: int) -> float:
    product()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="small")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--peak-size", type=int, default=2048, help="n of the n x n x n peak products"
    )
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    shapes, counts = layer_shapes(args.size), layer_counts(args.size)
    print(f"{args.size}, {args.tokens} tokens, {torch.get_num_threads()} threads")
    weighted = {"mkl": 0.0, "onednn": 0.0}
    peaks = Peaks(args.peak_size, repeats=2)
    for name, (fan_in, fan_out) in shapes.items():
        flops = 2 * args.tokens * fan_in * fan_out
        paths = products(args.tokens, fan_in, fan_out)
        timed: dict[str, dict[str, list[float]]] = {p: {k: [] for k in paths[p]} for p in paths}
        for _ in range(args.rounds):
            for kind in ("forward", "grad_input", "grad_weight"):
                for path in paths:
                    timed[path][kind].append(seconds(paths[path][kind], args.repeats))
        cells = []
        for kind in ("forward", "grad_input", "grad_weight"):
            mkl, dnn = (statistics.median(timed[p][kind]) for p in ("mkl", "onednn"))
            cells.append(
                f"{kind} {flops / mkl / 1e9:5.0f} -> {flops / dnn / 1e9:5.0f} ({mkl / dnn:.2f}x)"
            )
            for path, value in (("mkl", mkl), ("onednn", dnn)):
                weighted[path] += value * counts[name]
        print(f"  {name:14s} {fan_in:6d}x{fan_out:<6d} " + "  ".join(cells))
    peak = peaks.measure()
    print(
        f"\nall matmuls of a full fine-tuning forward_backward: oneDNN / MKL "
        f"{weighted['mkl'] / weighted['onednn']:.2f}x the speed"
    )
    print("peaks beside (GFLOP/s, 2048^3): " + ", ".join(f"{k} {v:.0f}" for k, v in peak.items()))


if __name__ == "__main__":
    main()
