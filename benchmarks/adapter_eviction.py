"""The eviction round trip of `posttrain serve --max-resident-adapters`: how long a LoRA
training client takes to leave memory (spill: adapter, AdamW moments and step, gradients, to
disk) and to come back (rebuild the client, load the spill), on the tiny model or the
Qwen2.5-0.5B architecture (`--size qwen2.5-0.5b`, random weights, built locally).

    OMP_NUM_THREADS=2 python benchmarks/adapter_eviction.py --size qwen2.5-0.5b --rank 32

The client has taken one optimizer step and holds the gradients of a second forward_backward:
everything a spill writes is there. Reported per round, median over `--rounds`:
- `spill`: `LocalTrainingClient.spill` (a checkpoint with the optimizer, and the gradients), to disk;
- `restore`: `LocalTrainingClient.restore` into a client already built;
- `build`: a fresh client of the same LoRA settings (`create_training_client`) on the base
  model the clients share, as the server builds them (`models.shared_base`): the adapter, not
  the model;
- `round trip`: `Residency` evicting one client for another and bringing it back, as the
  server does (spill of the other, build, restore), one direction.
Every restore is checked bit-exact against the state before the spill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from host import host_line

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.compute_thread import ComputeThread
from posttrain.engine.executor import InProcessExecutor
from posttrain.engine.worker import Worker
from posttrain.models.shared_base import SharedBases
from posttrain.models.tiny import tiny_model_path
from posttrain.server.residency import Residency
from posttrain.types import AdamParams, Datum, ModelInput

T = TypeVar("T")


def datums(tokens: int) -> list[Datum]:
    ids = [(7 * i + 3) % 256 for i in range(tokens + 1)]
    return [
        Datum(
            model_input=ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens},
        )
    ]


def worker_of(client: LocalTrainingClient) -> Worker:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    return executor.workers[0]


def tensors(client: LocalTrainingClient) -> list[torch.Tensor]:
    """The trainable weights, their gradients and AdamW state, in one order."""
    worker = worker_of(client)
    out: list[torch.Tensor] = []
    for param in worker.trainable_parameters().values():
        out.append(param.detach())
        assert param.grad is not None
        out.append(param.grad)
        out += [v for v in worker.optimizer.state[param].values() if isinstance(v, torch.Tensor)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def timed(fn: Callable[..., T], *args: object) -> tuple[float, T]:
    """Seconds `fn(*args)` took, and its result."""
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description="Adapter eviction round trip")
    parser.add_argument("--size", default="tiny", choices=["tiny", "mini", "small", "qwen2.5-0.5b"])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="tokens of the training datum")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(host_line(), flush=True)
    model_dir = str(tiny_model_path(size=args.size))
    load = os.getloadavg()[0]
    print(
        f"model: {args.size}, LoRA rank {args.rank}, threads {torch.get_num_threads()}, "
        f"load average {load:.1f} (indicative under load)"
    )
    root = Path(tempfile.mkdtemp(prefix="posttrain-eviction-"))
    compute = ComputeThread("bench-compute")
    bases = SharedBases()  # as posttrain serve builds its clients: on one shared base

    def build() -> LocalTrainingClient:
        return create_training_client(
            model_dir,
            lora_rank=args.rank,
            seed=0,
            storage_dir=root / "runs",
            compute_thread=compute,
            shared_base=bases,
        )

    def train(client: LocalTrainingClient) -> LocalTrainingClient:
        client.forward_backward(datums(args.tokens), "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-3)).result()
        client.forward_backward(datums(args.tokens), "cross_entropy").result()
        return client

    try:
        client = train(compute.call(build))
        before = tensors(client)
        path = root / "spill"
        rows: dict[str, list[float]] = {"spill": [], "restore": [], "build": [], "round trip": []}
        size = 0
        for _ in range(args.rounds):
            rows["spill"].append(compute.call(timed, client.spill, path)[0])
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            seconds, fresh = compute.call(timed, build)
            rows["build"].append(seconds)
            rows["restore"].append(compute.call(timed, fresh.restore, path)[0])
            assert same(tensors(fresh), before), "the restored client differs"
            fresh.close()
            shutil.rmtree(path)

        client.close()
        residency = Residency(1, root / "residency", compute)
        for name in ("a", "b"):  # a leaves for b
            train(residency.create(name, build))
            residency.release(name)
        for _ in range(args.rounds):
            with residency.using("a"):  # b leaves for a: spill b, build a, restore a
                rows["round trip"].append(timed(residency.client, "a")[0])
            with residency.using("b"):
                residency.client("b")
        trainable = sum(p.numel() for p in worker_of(client).trainable_parameters().values())
        print(f"spill: {size / 2**20:.1f} MiB on disk ({trainable:,} trainable parameters)")
        for name, values in rows.items():
            print(
                f"{name}: median {statistics.median(values):.3f} s "
                f"(min {min(values):.3f}, max {max(values):.3f}, {len(values)} rounds)"
            )
        print(f"spills {residency.spills}, reloads {residency.reloads}; restores bit-exact: yes")
    finally:
        compute.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
