"""Two Ray workers (data parallel, gloo) against one in-process worker on the `small` model.

Measures, on the same data: one training step (forward_backward on the whole batch, then
optim_step; the Ray step includes the gradient all-reduce), batched sampling, a one-datum
forward, and the per-call dispatch overhead: an empty round trip to both actors, and how many
round trips each client call makes (forward_backward carries its own input check, optim_step
its all-reduce). The in-process worker gets every core as torch threads; each Ray worker gets
its share. Results are medians over alternating rounds in one run (the machine may
be shared), printed with the ratio ray / local (below 1: Ray is faster).

    python benchmarks/ray_vs_local.py [--batch 16] [--tokens 128] [--rounds 3] [--lora-rank 8]
                                      [--sharding replicate|fsdp2] [--size small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from host import host_line

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.ray.executor import RayConfig
from posttrain.engine.ray.session import ray_session
from posttrain.models.tiny import tiny_model_path
from posttrain.types import AdamParams, Datum, ModelInput, SamplingParams


def make_datums(count: int, tokens: int, seed: int = 0) -> list[Datum]:
    """Cross-entropy datums of lengths spread over [tokens / 2, tokens]."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = tokens // 2 + (tokens // 2) * i // max(count - 1, 1)
        ids = torch.randint(3, 250, (length + 1,), generator=gen)
        weights = torch.full((length,), 1.0 / (count * tokens))
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1].tolist()),
                {"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def workloads(
    client: LocalTrainingClient | RayTrainingClient, args: argparse.Namespace
) -> dict[str, Callable[[], object]]:
    datums = make_datums(args.batch, args.tokens)
    prompts = [ModelInput.from_ints([5 + i, 6, 7, 8]) for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, seed=0, stop=[])
    adam = AdamParams(learning_rate=1e-5)

    def step() -> None:
        client.forward_backward(datums, "cross_entropy").result()
        client.optim_step(adam).result()

    return {
        "train step": step,
        "sample": lambda: client.sample_many(prompts, args.samples, params).result(),
        "1-datum forward": lambda: client.forward(datums[:1], "cross_entropy").result(),
    }


def round_trips(remote: RayTrainingClient, args: argparse.Namespace) -> dict[str, int]:
    """Actor round trips each client call makes (placement already settled)."""
    datums = make_datums(2, 16)
    prompts = [ModelInput.from_ints([5, 6]), ModelInput.from_ints([7, 8])]
    calls: dict[str, Callable[[], object]] = {
        "forward": lambda: remote.forward(datums, "cross_entropy").result(),
        "forward_backward": lambda: remote.forward_backward(datums, "cross_entropy").result(),
        "optim_step": lambda: remote.optim_step(AdamParams(learning_rate=1e-5)).result(),
        "sample": lambda: remote.sample_many(prompts, 1, SamplingParams(max_tokens=2)).result(),
    }
    out: dict[str, int] = {}
    for name, call in calls.items():
        call()  # settles placement (offload / reload moves are round trips of their own)
        before = remote.executor.round_trips
        call()
        out[name] = remote.executor.round_trips - before
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Two Ray workers vs one in-process worker.")
    parser.add_argument("--size", choices=["tiny", "mini", "small"], default="small")
    parser.add_argument("--batch", type=int, default=16, help="datums per training step")
    parser.add_argument("--tokens", type=int, default=128, help="longest datum")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pings", type=int, default=50)
    parser.add_argument("--lora-rank", type=int, default=None, help="default: full fine-tuning")
    parser.add_argument("--local-threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--sharding", choices=["replicate", "fsdp2"], default="replicate")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(host_line(), flush=True)
    cores = os.cpu_count() or 1
    torch.set_num_threads(args.local_threads or cores)
    path = tiny_model_path(size=args.size)
    start = time.perf_counter()
    with ray_session(num_cpus=cores):
        ray_start = time.perf_counter() - start
        local = create_training_client(path, lora_rank=args.lora_rank)
        start = time.perf_counter()
        ray_config = RayConfig(
            resources_per_worker={"CPU": max(1, cores // 2)}, sharding=args.sharding
        )
        remote = create_training_client(
            path, lora_rank=args.lora_rank, executor="ray", num_workers=2, ray_config=ray_config
        )
        group_start = time.perf_counter() - start
        jobs = {"local x1": workloads(local, args), "ray x2": workloads(remote, args)}
        for named_jobs in jobs.values():  # warm-up: first calls build samplers, AdamW state
            for job in named_jobs.values():
                job()
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, named_jobs in jobs.items():
                for job_name, job in named_jobs.items():
                    times.setdefault((name, job_name), []).append(timed(job))
        pings = [timed(remote.executor.ping) for _ in range(args.pings)]
        trips = round_trips(remote, args)
        remote.close()
        local.close()

    mode = "full fine-tuning" if args.lora_rank is None else f"LoRA rank {args.lora_rank}"
    print(
        f"{args.size} model, {mode}, fp32, {cores} cores, local on {torch.get_num_threads()} "
        f"threads, Ray sharding={args.sharding}; batch {args.batch} datums of "
        f"{args.tokens // 2}-{args.tokens} tokens; sampling {args.prompts} prompts x "
        f"{args.samples} x {args.new_tokens} tokens; medians of {args.rounds} alternating rounds"
    )
    print(f"local Ray start {ray_start:.1f} s; 2-actor group (models loaded) {group_start:.1f} s")
    for job_name in jobs["local x1"]:
        local_s = statistics.median(times[("local x1", job_name)])
        ray_s = statistics.median(times[("ray x2", job_name)])
        print(
            f"{job_name:>16}: local x1 {1000 * local_s:8.1f} ms | ray x2 {1000 * ray_s:8.1f} ms"
            f" | ray/local {ray_s / local_s:5.2f}"
        )
    ping_ms = 1000 * statistics.median(pings)
    print(f"empty round trip to both actors (per-call dispatch overhead): {ping_ms:.2f} ms")
    listed = ", ".join(f"{name} {count}" for name, count in trips.items())
    print(f"actor round trips per client call (placement settled): {listed}")


if __name__ == "__main__":
    main()
