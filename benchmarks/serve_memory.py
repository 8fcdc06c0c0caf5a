"""Resident memory of `posttrain serve` with 1, 2, 4, 8 LoRA clients of one base model.

Each client is a training client that has taken `--steps` forward_backward + optim_step (so its
AdamW moments exist) plus a sampling client of its weights (`save_weights_and_get_sampling_client`,
sampled once, so the sampler is loaded). One fresh server per row; its resident set (VmRSS) is
read from /proc after every client is live, and the peak (VmHWM) beside it.

The floor is what cannot be shared: per training client its adapter, its AdamW moments (2x the
adapter) and, while it trains, its gradients (1x, freed by optim_step); per sampler an adapter.
The table prints that arithmetic beside the measurement, so the sharing can be checked: memory
beyond it is memory the clients did not share.

    python benchmarks/serve_memory.py [--size qwen2.5-0.5b] [--rank 8] [--clients 1,2,4,8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker
from host import host_line
from serve_process import KEY, serve_process
from tinker import types

from posttrain.models.tiny import tiny_model_path

MIB = 1 << 20


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sft_batch(rows: int, length: int) -> list[types.Datum]:
    data = []
    for i in range(rows):
        tokens = [3 + (7 * i + 13 * j) % 250 for j in range(length + 1)]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
                    "weights": types.TensorData.from_numpy(np.ones(length, np.float32)),
                },
            )
        )
    return data


def adapter_bytes(model_dir: Path, rank: int) -> int:
    """fp32 bytes of one adapter: rank x (in + out) per adapted layer: attention, MLP and the
    unembedding (the tinker SDK's `train_unembed=True`; on a tied model, one adapter on the
    shared embedding matrix)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = (hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + inter) * 3
    total = per_layer * config.num_hidden_layers
    total += hidden + config.vocab_size
    return rank * total * 4


def measure(model_dir: Path, clients: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp) / "storage"
        extra = ["--sampler-cache-size", str(max(clients, 1))]
        with serve_process(model_dir, storage, args.threads, extra) as served:
            idle = status_kib(served.pid, "VmRSS")
            service = tinker.ServiceClient(base_url=served.url, api_key=KEY)
            data = sft_batch(args.rows, args.length)
            began = time.perf_counter()
            for index in range(clients):
                trainer = service.create_lora_training_client(
                    base_model=str(model_dir), rank=args.rank, seed=index
                ).result()
                for _ in range(args.steps):
                    trainer.forward_backward(data, "cross_entropy").result()
                    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                sampler = trainer.save_weights_and_get_sampling_client(f"c{index}").result()
                sampler.sample(
                    types.ModelInput.from_ints([5, 6, 7]),
                    1,
                    types.SamplingParams(max_tokens=2, temperature=0.0),
                ).result()
                print(
                    f"  {clients} clients: {index + 1} live after "
                    f"{time.perf_counter() - began:.0f} s",
                    flush=True,
                )
            rss = status_kib(served.pid, "VmRSS")
            peak = status_kib(served.pid, "VmHWM")
            service.close("success").result()  # its heartbeats would outlive the server
    return {"idle_mib": idle / 1024, "rss_mib": rss / 1024, "peak_mib": peak / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--size", default="qwen2.5-0.5b", choices=["tiny", "mini", "small", "qwen2.5-0.5b"]
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=1, help="training steps per client")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(host_line(), flush=True)
    model_dir = tiny_model_path(size=args.size)
    counts = [int(c) for c in args.clients.split(",")]
    adapter = adapter_bytes(model_dir, args.rank)
    print(
        f"{args.size}, LoRA rank {args.rank}: one adapter {adapter / MIB:.1f} MiB fp32; "
        f"server at OMP_NUM_THREADS={args.threads}"
    )
    rows = {n: measure(model_dir, n, args) for n in counts}
    one = rows[counts[0]]["rss_mib"]
    print(
        "\n| training + sampling clients | resident MiB | x one client | floor MiB "
        "(one client + adapters and moments) | peak MiB |"
    )
    print("|---|---|---|---|---|")
    for n, row in rows.items():
        # Each further client: adapter + 2 moments (training) + adapter (sampler).
        floor = one + (n - counts[0]) * 4 * adapter / MIB
        print(
            f"| {n} + {n} | {row['rss_mib']:.0f} | {row['rss_mib'] / one:.2f} | "
            f"{floor:.0f} | {row['peak_mib']:.0f} |"
        )
    print(f"\nserver idle before any client: {rows[counts[0]]['idle_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
