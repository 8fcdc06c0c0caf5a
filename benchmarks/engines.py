"""Sampling engines side by side: posttrain's sampler (default engine) against the vLLM engine,
and the cost of one weight sync, on the `small` tiny model (29.8M parameters, fp32) or the
Qwen2.5-0.5B architecture (`--size qwen2.5-0.5b`, random weights, built locally).

Both engines sample the same batches, taking turns round after round in one run, EOS ignored
so every sequence has the full length; the ratio is vLLM / posttrain tokens per second
(higher favours vLLM).

The sync is what follows every optimizer step with the vLLM engine, measured both ways in one
run: the old way (`whole_sync`: the trainable weights merged into whole weights, written to
/dev/shm, reloaded by vLLM) and the new one (`EngineSession.sync`: only what changed, for both
LoRA routes, "adapter" and "merge"), seconds and bytes. `--rl-steps N` also times N full RL
steps (sample, train, sync) per workload with each engine, side by side.

    OMP_NUM_THREADS=2 python benchmarks/engines.py --vllm-python .venv-vllm/bin/python \
        [--rounds 4] [--lora-rank 8] [--size small | --model DIR] [--dtype float32] \
        [--rl-steps 0] [--skip-sampling]

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
from host import host_line

import posttrain
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.inference.session import EngineSession
from posttrain.inference.weights import WeightExporter
from posttrain.models.tiny import tiny_model_path
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


async def whole_sync(session: EngineSession, exporter: WeightExporter, version: int) -> dict:
    """The sync before issue 27: whole LoRA-merged weights written and reloaded."""
    assert session.source is not None
    began = time.perf_counter()
    weights = await session.source.trainable_weights()
    snapshot = await asyncio.to_thread(exporter.export, weights, version)
    await session.engine.update_weights(snapshot, version)
    size = sum(f.stat().st_size for f in snapshot.path.rglob("*") if f.is_file())
    return {"sync_s": time.perf_counter() - began, "sync_bytes": float(size)}


async def rl_step(backend, model, sampler, prompts, samples: int, new: int) -> float:
    """One RL step's seconds: sample, train on the groups (reward: the share of even token
    ids, any signal will do), sync the engine."""
    began = time.perf_counter()
    params = SamplingParams(max_tokens=new, stop=[], temperature=1.0)
    responses = await sampler.sample_many(prompts, samples, params)
    groups = []
    for prompt, response in zip(prompts, responses, strict=True):
        group = [
            Trajectory(
                (
                    TokenSegment(tuple(prompt)),
                    TokenSegment(tuple(s.tokens), True, tuple(s.logprobs or ())),
                ),
                sum(t % 2 == 0 for t in s.tokens) / new,
            )
            for s in response.sequences
        ]
        groups.append(TrajectoryGroup(tuple(group)))
    await backend.train(model, groups, learning_rate=1e-4, save_checkpoint=False)
    return time.perf_counter() - began


def _medians(rows: list[dict]) -> str:
    keys = rows[0].keys()
    shown = []
    for key in keys:
        value = statistics.median(r[key] for r in rows)
        shown.append(f"{key} {value / 2**20:.1f} MiB" if "bytes" in key else f"{key} {value:.3f}")
    return ", ".join(shown)


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
    parser.add_argument("--rl-steps", type=int, default=0, help="timed RL steps per workload")
    parser.add_argument("--skip-sampling", action="store_true", help="no sampling rounds")
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per way")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls per engine")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="PROMPTSxSAMPLESxTOKENS, comma-separated (default: %(default)s)",
    )
    args = parser.parse_args()
    print(host_line(), flush=True)
    workloads = {w: tuple(map(int, w.split("x"))) for w in args.workloads.split(",")}
    model_dir = args.model or tiny_model_path(size=args.size)
    threads = torch.get_num_threads()
    load = os.getloadavg()[0]
    shown = args.model or args.size
    print(f"model: {shown}, {args.dtype}, threads {threads}, load average {load:.1f}")
    root = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    backends, models, samplers = {}, {}, {}
    vllm = {
        "engine": "vllm",
        "python": args.vllm_python,
        "kv_cache_mb": 512,
        "threads": threads,
        "dtype": args.dtype,
    }
    for name, inference in {
        "pytorch": None,
        "vllm-merge": vllm | {"lora_sync": "merge"},
        "vllm-adapter": vllm | {"lora_sync": "adapter"},
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
        for workload, (count, samples, new) in workloads.items():
            if args.skip_sampling:
                break
            prompts = make_prompts(count)
            for sampler in samplers.values():
                for _ in range(args.warmup):
                    await tokens_per_s(sampler, prompts, samples, new)
            rates: dict[str, list[float]] = {name: [] for name in samplers}
            for round_index in range(args.rounds):
                order = list(samplers) if round_index % 2 == 0 else list(reversed(samplers))
                for name in order:
                    rates[name].append(await tokens_per_s(samplers[name], prompts, samples, new))
            line = [f"{workload}: pytorch {statistics.median(rates['pytorch']):.0f} tok/s"]
            for name in samplers:
                if name == "pytorch":
                    continue
                ratios = [v / p for v, p in zip(rates[name], rates["pytorch"], strict=True)]
                line.append(
                    f"{name} {statistics.median(rates[name]):.0f} tok/s, ratio (paired median) "
                    f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                )
            print("; ".join(line))
        for workload, (count, samples, new) in workloads.items():
            if not args.rl_steps:
                break
            prompts = make_prompts(count)
            steps: dict[str, list[float]] = {name: [] for name in samplers}
            for round_index in range(args.rl_steps + 1):  # the first round warms up
                order = list(samplers) if round_index % 2 == 0 else list(reversed(samplers))
                for name in order:
                    seconds = await rl_step(
                        backends[name], models[name], samplers[name], prompts, samples, new
                    )
                    if round_index:
                        steps[name].append(seconds)
            shown = ", ".join(
                f"{name} {statistics.median(v):.2f} s (pytorch/{name} "
                f"{statistics.median(steps['pytorch']) / statistics.median(v):.2f}x)"
                for name, v in steps.items()
            )
            print(
                f"RL step {workload} (sample + train + sync), medians of {args.rl_steps}: {shown}"
            )
        for name in ("vllm-merge", "vllm-adapter"):
            session = backends[name]._models.engine(models[name])
            version = models[name].step
            rows = []
            for _ in range(args.syncs):
                version += 1
                await session.sync(version)
                rows.append(session.last_sync)
            print(
                f"{name} sync, new (only what changed), medians of {args.syncs}: {_medians(rows)}"
            )
            # The old way last: a whole reload replaces the engine's base weights.
            exporter = WeightExporter(
                model_dir,
                Path(tempfile.mkdtemp(prefix="posttrain-whole-", dir="/dev/shm")),
                lora=models[name].lora,
            )
            try:
                rows = []
                for _ in range(args.syncs):
                    version += 1
                    rows.append(await whole_sync(session, exporter, version))
            finally:
                exporter.close()
            print(
                f"{name} sync, old (whole merged model), medians of {args.syncs}: {_medians(rows)}"
            )
    finally:
        for backend in backends.values():
            await backend.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
