"""SDPA forward + backward on the CPU: float32, bfloat16, and bfloat16 upcast to float32 inside
(what `posttrain.models.attention` does when training a bf16 model).

Shapes are (batch, query heads, KV heads, tokens, head dim), grouped-query attention as in
Qwen2; causal. The three ways alternate call by call, `--rounds` times; each figure is the
median.

    OMP_NUM_THREADS=2 python benchmarks/attention_dtypes.py [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from host import host_line

SHAPES = ((32, 8, 4, 48, 64), (8, 8, 4, 256, 64), (64, 14, 2, 48, 64), (8, 14, 2, 256, 64))


def step(dtype: torch.dtype, upcast: bool, shape: tuple[int, ...]) -> Callable[[], None]:
    batch, heads, kv_heads, tokens, dim = shape
    gen = torch.Generator().manual_seed(0)

    def leaf(h: int) -> torch.Tensor:
        return torch.randn(batch, h, tokens, dim, generator=gen).to(dtype).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)

    def run() -> None:
        args = (q.float(), k.float(), v.float()) if upcast else (q, k, v)
        out = F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=True)
        out.to(dtype).sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    ways = {
        "float32": (torch.float32, False),
        "bf16": (torch.bfloat16, False),
        "bf16_upcast": (torch.bfloat16, True),
    }
    print(f"SDPA forward + backward, ms (median of {args.rounds}), {args.threads} threads")
    print(f"  {'batch,heads,kv,tokens,dim':28s} " + " ".join(f"{w:>12s}" for w in ways))
    for shape in SHAPES:
        runs = {name: step(*way, shape) for name, way in ways.items()}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for round_index in range(args.rounds + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if round_index:  # the first round warms up
                    times[name].append((time.perf_counter() - start) * 1e3)
        cells = " ".join(f"{statistics.median(times[name]):12.1f}" for name in ways)
        print(f"  {','.join(map(str, shape)):28s} {cells}")


if __name__ == "__main__":
    main()
