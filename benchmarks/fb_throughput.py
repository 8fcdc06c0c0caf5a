"""forward_backward throughput on the `small` model (~30M parameters, full fine-tuning, fp32),
and the achieved FLOP/s as a fraction of this machine's fp32 matmul peak (benchmarks/cpu_peak.py).

FLOPs per trained token = 6 * N, with N the parameters that take part in matmuls: every weight
except the input embedding (a lookup), the lm_head included. Attention's T^2 term is left out,
so the fraction is a slight under-estimate at long sequences.

    python benchmarks/fb_throughput.py [--shapes 8x256,16x128] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.engine.tiny import make_tiny_model

try:
    from cpu_peak import matmul_gflops
except ImportError:  # run from the repository root as `python benchmarks/fb_throughput.py`
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_peak import matmul_gflops


def matmul_params(client) -> int:
    model = client.dispatch.executor.workers[0].model
    embed = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embed


def datums(rows: int, length: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (rows, length + 1), generator=gen)
    weight = torch.full((length,), 1.0 / (rows * length))
    return [
        Datum(ModelInput.from_ints(r[:-1].tolist()), {"target_tokens": r[1:], "weights": weight})
        for r in ids
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8x256,16x128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    client = create_training_client(
        make_tiny_model(tempfile.mkdtemp(), size="small"), lora_rank=None
    )
    n = matmul_params(client)
    peaks = {kind: matmul_gflops(kind) for kind in ("fp32", "fp32_onednn")}
    print(f"small model: {n / 1e6:.1f}M matmul parameters; threads {args.threads}")
    print(f"fp32 peak: MKL {peaks['fp32']:.0f} GFLOP/s, oneDNN {peaks['fp32_onednn']:.0f} GFLOP/s")
    for shape in args.shapes.split(","):
        rows, length = (int(x) for x in shape.split("x"))
        batch = datums(rows, length)
        client.forward_backward(batch, "cross_entropy").result()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            client.forward_backward(batch, "cross_entropy").result()
            times.append(time.perf_counter() - start)
            client.dispatch.executor.workers[0].zero_grad()
        seconds = statistics.median(times)
        tokens = rows * length
        gflops = 6 * n * tokens / seconds / 1e9
        print(
            f"{rows:3d} x {length:4d}: {tokens / seconds:8.0f} tokens/s  {gflops:6.1f} GFLOP/s  "
            f"= {gflops / peaks['fp32_onednn']:.2f} of oneDNN peak, {gflops / peaks['fp32']:.2f} of MKL peak"
        )
    client.close()


if __name__ == "__main__":
    main()
