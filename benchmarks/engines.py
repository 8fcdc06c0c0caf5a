"""Sampling engines side by side: posttrain's sampler (default engine) against the vLLM engine,
and the cost of one weight sync, on the `small` tiny model (29.8M parameters, fp32) or the
Qwen2.5-0.5B architecture (`--size qwen2.5-0.5b`, random weights, built locally).

Both engines sample the same batches, taking turns round after round in one run, EOS ignored
so every sequence has the full length; the ratio is vLLM / posttrain tokens per second
(higher favours vLLM). The sync is what follows every optimizer step with the vLLM engine:
trainable weights out of the trainer, merged into whole weights, written to /dev/shm, reloaded
by vLLM.

    OMP_NUM_THREADS=2 python benchmarks/engines.py --vllm-python .venv-vllm/bin/python \
        [--rounds 4] [--lora-rank 8] [--size small | --model DIR] [--dtype float32]

`--model DIR` runs any local model directory instead (a real one: `posttrain fetch-model
smollm2-135m-instruct` prints its directory).

`--dtype` is both engines' precision: the trainer's weights (with LoRA adapters in float32),
and so posttrain's sampler, and vLLM's `[inference] dtype`.

Thread settings: the trainer (and so the default engine) uses torch's thread count in this
process (OMP_NUM_THREADS); the vLLM worker gets the same count (`[inference] threads`). They
never sample at the same time here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import posttrain
from posttrain.engine.tiny import tiny_model_path
from posttrain.types import SamplingParams

WORKLOADS = {"64x1x64": (64, 1, 64), "8x8x16": (8, 8, 16)}


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Byte-token prompts of lengths 16..47 (as benchmarks/sampling_speed.py)."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 48, (count,), generator=rng).tolist()
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


async def tokens_per_s(sampler, prompts, samples: int, new: int) -> float:
    params = SamplingParams(max_tokens=new, stop=[], temperature=1.0)
    began = time.perf_counter()
    responses = await sampler.sample_many(prompts, samples, params)
    tokens = sum(len(s.tokens) for r in responses for s in r.sequences)
    return tokens / (time.perf_counter() - began)


async def main() -> None:
    parser = argparse.ArgumentParser(description="Sampling engines side by side")
    parser.add_argument("--vllm-python", default=os.environ.get("POSTTRAIN_VLLM_PYTHON"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--size", default="small", choices=["tiny", "mini", "small", "qwen2.5-0.5b"]
    )
    parser.add_argument("--model", help="a local model directory (instead of --size)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model_dir = args.model or tiny_model_path(size=args.size)
    threads = torch.get_num_threads()
    load = os.getloadavg()[0]
    shown = args.model or args.size
    print(f"model: {shown}, {args.dtype}, threads {threads}, load average {load:.1f}")
    root = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    backends, models, samplers = {}, {}, {}
    for name, inference in {
        "pytorch": None,
        "vllm": {
            "engine": "vllm",
            "python": args.vllm_python,
            "kv_cache_mb": 512,
            "threads": threads,
            "dtype": args.dtype,
        },
    }.items():
        backends[name] = posttrain.LocalBackend(root / name, inference=inference)
        models[name] = posttrain.TrainableModel(
            name="m",
            project="b",
            base_model=str(model_dir),
            lora_rank=args.lora_rank,
            dtype=args.dtype,
            seed=0,
        )
        began = time.perf_counter()
        await models[name].register(backends[name])
        print(f"{name}: registered (engine started) in {time.perf_counter() - began:.1f} s")
        samplers[name] = backends[name].sampling_client(models[name])
    try:
        for workload, (count, samples, new) in WORKLOADS.items():
            prompts = make_prompts(count)
            for sampler in samplers.values():  # warm-up, twice each
                for _ in range(2):
                    await tokens_per_s(sampler, prompts, samples, new)
            rates: dict[str, list[float]] = {name: [] for name in samplers}
            for round_index in range(args.rounds):
                order = list(samplers) if round_index % 2 == 0 else list(reversed(samplers))
                for name in order:
                    rates[name].append(await tokens_per_s(samplers[name], prompts, samples, new))
            ratios = [v / p for v, p in zip(rates["vllm"], rates["pytorch"], strict=True)]
            print(
                f"{workload}: pytorch {statistics.median(rates['pytorch']):.0f} tok/s, vllm "
                f"{statistics.median(rates['vllm']):.0f} tok/s, ratio (paired median) "
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
        session = backends["vllm"]._models.engine(models["vllm"])
        parts: dict[str, list[float]] = {}
        for version in range(1, 6):
            await session.sync(version)
            for key, seconds in session.last_sync.items():
                parts.setdefault(key, []).append(seconds)
        shown = ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in parts.items())
        print(
            f"vllm weight sync (LoRA r{args.lora_rank} merged, whole model), medians of 5: {shown}"
        )
    finally:
        for backend in backends.values():
            await backend.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
