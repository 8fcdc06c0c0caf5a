"""Sampling tokens/s through `posttrain serve`'s /v1/completions against in-process sampling.

The same base model (`small`, 30M) answers the same requests (one prompt, n samples, the same
seed, so both sides generate the same tokens) once through the openai SDK and the server, and
once through a LocalTrainingClient in this process. Requests run one at a time and alternate
between the two sides in one run (the machine may be shared); each side's torch uses the same
number of threads. Prints tokens/s of each and their ratio (server / in-process, higher is
better; the server pays HTTP, JSON and a thread hop per request).

    python benchmarks/serve_sampling.py [--samples 8] [--new-tokens 64] [--requests 4]
        [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import openai
import torch
from host import host_line
from serve_process import KEY, serve

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.models.tiny import tiny_model_path
from posttrain.types import ModelInput, SamplingParams


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (24,), generator=gen).tolist() for _ in range(count)]


async def served(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], args: argparse.Namespace
) -> int:
    out = await client.completions.create(
        model=model, prompt=prompt, n=args.samples, max_tokens=args.new_tokens, seed=1
    )
    assert out.usage is not None
    return out.usage.completion_tokens


def in_process(local: LocalTrainingClient, prompt: list[int], args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.new_tokens, seed=1)
    response = local.sample(ModelInput.from_ints(prompt), args.samples, params).result()
    return sum(len(s.tokens) for s in response.sequences)


async def run(args: argparse.Namespace, url: str, base_model: Path) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    model = str(base_model)  # the served name of the base model
    local = create_training_client(base_model, lora_rank=None)
    batch = prompts(args.requests)
    await served(client, model, batch[0], args)  # warm-up: the server loads its sampler
    in_process(local, batch[0], args)
    rates: dict[str, list[float]] = {"server": [], "in-process": []}
    for _ in range(args.rounds):
        start, tokens = time.perf_counter(), 0
        for prompt in batch:
            tokens += await served(client, model, prompt, args)
        rates["server"].append(tokens / (time.perf_counter() - start))
        start, local_tokens = time.perf_counter(), 0
        for prompt in batch:
            local_tokens += in_process(local, prompt, args)
        rates["in-process"].append(local_tokens / (time.perf_counter() - start))
        assert tokens == local_tokens, (tokens, local_tokens)  # the same seeds, the same work
    local.close()

    print(
        f"{args.size} model, fp32, {args.threads} torch threads per side; {args.requests} "
        f"requests per round of 1 prompt (24 tokens) x {args.samples} samples x up to "
        f"{args.new_tokens} new tokens; {args.rounds} alternating rounds, medians"
    )
    server_rate, local_rate = (statistics.median(rates[k]) for k in ("server", "in-process"))
    print(f"tokens/s: /v1/completions {server_rate:.0f} | in-process {local_rate:.0f}")
    print(f"ratio server / in-process: {server_rate / local_rate:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="/v1/completions vs in-process sampling.")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--size", default="small", choices=["tiny", "mini", "small"], help="the tiny model's size"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    base_model = tiny_model_path(size=args.size)
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        storage = Path(tmp) / "storage"
        storage.mkdir()
        with serve(base_model, storage, args.threads) as url:
            asyncio.run(run(args, url, base_model))


if __name__ == "__main__":
    main()
