"""forward_backward throughput on the `small` model (~30M parameters, full fine-tuning, fp32),
and the achieved FLOP/s as a fraction of this machine's fp32 matmul peak (benchmarks/cpu_peak.py).

FLOPs per trained token = 6 * N, with N the parameters that take part in matmuls: every weight
except the input embedding (a lookup), the lm_head included. Attention's T^2 term is left out,
so the fraction is a slight under-estimate at long sequences. Only real tokens count, never
padding.

The peak is measured between the timed calls, not once up front: each forward_backward is
followed by a 2048^3 oneDNN product and the fraction is taken per pair, so load from other
processes on a shared machine lowers both sides of a pair alike. The figure reported is the
median of the per-pair fractions.

`--mixed RxL` adds a batch of R datums with lengths spread over [L/8, L] (as RL completions
are) under a `--micro-batch-tokens` budget, timed with the worker's micro-batching (longest
first, `engine.shared_prefix.plan_micro_batches`) and, alternating call by call, with grouping in call
order (`split_by_token_budget`, the worker's previous policy); both padded-token counts are
printed too.

    python benchmarks/fb_throughput.py [--shapes 8x256,16x128] [--mixed 64x256]
        [--micro-batch-tokens 2048] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine import batching
from posttrain.engine import worker as worker_module
from posttrain.engine.shared_prefix import MicroBatch, PrefixGroup, plan_micro_batches
from posttrain.engine.tiny import make_tiny_model

try:
    from cpu_peak import product
except ImportError:  # run from the repository root as `python benchmarks/fb_throughput.py`
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_peak import product

PEAK_SIZE = 2048


def matmul_params(client: LocalTrainingClient) -> int:
    model = client.dispatch.executor.workers[0].model  # type: ignore[attr-defined]
    embed = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embed


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


def peak_gflops(run: Callable[[], object]) -> float:
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return 2 * PEAK_SIZE**3 / statistics.median(seconds) / 1e9


def timed_pairs(
    client: LocalTrainingClient,
    batch: list[Datum],
    peak: Callable[[], object],
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]],
    repeats: int,
) -> dict[str, list[tuple[float, float]]]:
    """(seconds of one forward_backward, oneDNN peak GFLOP/s right after it) per variant,
    the variants alternating call by call."""
    worker = client.dispatch.executor.workers[0]  # type: ignore[attr-defined]
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_index in range(repeats + 1):  # the first round warms up
        for name, context in variants.items():
            with context():
                start = time.perf_counter()
                client.forward_backward(batch, "cross_entropy").result()
                seconds = time.perf_counter() - start
            worker.zero_grad()
            if round_index > 0:
                out[name].append((seconds, peak_gflops(peak)))
    return out


def report(label: str, flops: float, tokens: int, pairs: list[tuple[float, float]]) -> float:
    seconds = statistics.median(s for s, _ in pairs)
    fractions = [flops / s / 1e9 / p for s, p in pairs]
    print(
        f"{label}: {tokens / seconds:8.0f} tokens/s  {flops / seconds / 1e9:6.1f} GFLOP/s  "
        f"= {statistics.median(fractions):.2f} of the oneDNN peak measured beside it "
        f"(pairs {' '.join(f'{f:.2f}' for f in fractions)}; peak median "
        f"{statistics.median(p for _, p in pairs):.0f} GFLOP/s)"
    )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8x256,16x128")
    parser.add_argument("--mixed", default="", help="e.g. 64x256: lengths spread over [L/8, L]")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    client = create_training_client(
        make_tiny_model(tempfile.mkdtemp(), size="small"),
        lora_rank=None,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    n = matmul_params(client)
    peak = product("fp32_onednn", PEAK_SIZE)
    print(f"small model: {n / 1e6:.1f}M matmul parameters; threads {args.threads}")
    for shape in filter(None, args.shapes.split(",")):
        rows, length = (int(x) for x in shape.split("x"))
        pairs = timed_pairs(
            client, datums([length] * rows), peak, {"": contextlib.nullcontext}, args.repeats
        )
        report(f"{rows:3d} x {length:4d}", 6 * n * rows * length, rows * length, pairs[""])
    if args.mixed:
        rows, length = (int(x) for x in args.mixed.split("x"))
        lengths = mixed_lengths(rows, length)
        budget = args.micro_batch_tokens
        for name, groups in (
            (
                "longest first",
                [m.rows for m in plan_micro_batches([[0] * n for n in lengths], budget, 0)],
            ),
            ("call order", batching.split_by_token_budget(lengths, budget)),
        ):
            padded = batching.padded_tokens(lengths, groups)
            print(f"mixed {rows}x[{length // 8},{length}], budget {budget}: {name:13s} "
                  f"{len(groups)} micro-batches, {padded} tokens computed for {sum(lengths)}")  # fmt: skip
        variants = {"longest first": contextlib.nullcontext, "call order": call_order_grouping}
        pairs = timed_pairs(client, datums(lengths), peak, variants, args.repeats)
        flops, tokens = 6 * n * sum(lengths), sum(lengths)
        times = {name: report(f"mixed, {name:13s}", flops, tokens, p) for name, p in pairs.items()}
        ratios = [
            b[0] / a[0] for a, b in zip(pairs["longest first"], pairs["call order"], strict=True)
        ]
        print(f"longest first vs call order: {statistics.median(ratios):.2f}x faster "
              f"(per-pair {' '.join(f'{r:.2f}' for r in ratios)}; medians "
              f"{times['call order'] / times['longest first']:.2f}x)")  # fmt: skip
    client.close()


if __name__ == "__main__":
    main()
