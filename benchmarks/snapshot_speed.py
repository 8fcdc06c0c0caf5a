"""Seconds per `save_weights_and_get_sampling_client` on an in-process training client, as a
cookbook RL loop calls it: once per step, the previous snapshot client dropped (or closed)
after the next one is taken.

The `small` tiny model (30M parameters) with LoRA rank 32 by default. The first snapshot
builds a replica; later ones reuse the replica a released client left.

    python benchmarks/snapshot_speed.py [--size small] [--lora-rank 32] [--snapshots 8] [--close]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from host import host_line

from posttrain.clients.create import create_training_client
from posttrain.models.tiny import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description="Seconds per snapshot sampling client")
    parser.add_argument("--size", default="small")
    parser.add_argument("--lora-rank", type=int, default=32, help="0: full fine-tuning")
    parser.add_argument("--snapshots", type=int, default=8)
    parser.add_argument("--close", action="store_true", help="close() each previous client")
    args = parser.parse_args()
    print(host_line(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", arch="qwen2", size=args.size, seed=0)
        client = create_training_client(
            model_dir, lora_rank=args.lora_rank or None, storage_dir=Path(tmp) / "storage"
        )
        seconds: list[float] = []
        previous = None
        for _ in range(args.snapshots):
            start = time.perf_counter()
            snapshot = client.save_weights_and_get_sampling_client().result()
            seconds.append(time.perf_counter() - start)
            if previous is not None and args.close:
                previous.close()
            previous = snapshot  # dropping the one before hands its replica back
        client.close()
    print(
        f"first {seconds[0]:.3f} s, later ones median {statistics.median(seconds[1:]):.3f} s "
        f"({args.snapshots} snapshots, size={args.size}, lora_rank={args.lora_rank})"
    )


if __name__ == "__main__":
    main()
