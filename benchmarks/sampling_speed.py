"""Sampling throughput: posttrain's Sampler against plain `model.generate` on the `small` tiny model.

Both decode the same batch (prompts x samples) for the same number of new tokens at the same
temperature, with EOS ignored so every sequence has the full length. Runs alternate in one
process; the script prints tokens/s of each and their ratio (Sampler / generate, higher is better).

    python benchmarks/sampling_speed.py [--prompts 8] [--samples 8] [--new-tokens 64] [--rounds 3]
        [--size small] [--arch qwen2]

`--arch qwen3_5` measures the hybrid decoder (GatedDeltaNet layers' convolution and recurrent
state repeated per sample and compacted beside the KV cache).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from host import host_line
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from posttrain.engine.decode.sampler import Sampler
from posttrain.models.tiny import tiny_model_path
from posttrain.types import SamplingParams


def make_prompts(num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Byte-token prompts of different lengths (16..47), so both paths handle left padding."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 48, (num_prompts,), generator=rng).tolist()
    return [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]


def run_sampler(sampler: Sampler, prompts: list[list[int]], samples: int, new: int) -> int:
    params = SamplingParams(max_tokens=new, seed=None, stop=[], temperature=1.0)
    responses = sampler.sample(prompts, samples, params)
    return sum(len(s.tokens) for r in responses for s in r.sequences)


def run_generate(
    model: torch.nn.Module, prompts: list[list[int]], samples: int, new: int, pad_id: int
) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new,
        min_new_tokens=new,
        num_return_sequences=samples,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # pyright: ignore[reportCallIssue]
    return (out.shape[1] - width) * out.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description="Sampler vs model.generate throughput.")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--size", default="small", choices=["tiny", "mini", "small"], help="the tiny model's size"
    )
    parser.add_argument(
        "--arch",
        default="qwen2",
        choices=["qwen2", "llama", "qwen3", "qwen3_5", "gemma3", "olmo3"],
        help="the tiny model's family",
    )
    args = parser.parse_args()
    print(host_line(), flush=True)

    path = tiny_model_path(arch=args.arch, size=args.size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampler = Sampler(model, tokenizer)
    prompts = make_prompts(args.prompts)
    pad_id = int(tokenizer.pad_token_id)

    runs = {
        "sampler": lambda: run_sampler(sampler, prompts, args.samples, args.new_tokens),
        "generate": lambda: run_generate(model, prompts, args.samples, args.new_tokens, pad_id),
    }
    for run in runs.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - start))
    batch = args.prompts * args.samples
    print(
        f"{args.arch} {args.size} model, {batch} sequences x {args.new_tokens} new tokens, temperature 1.0, "
        f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds"
    )
    for name, values in rates.items():
        runs_text = ", ".join(f"{v:.0f}" for v in values)
        print(f"{name:>9}: median {statistics.median(values):.0f} tokens/s ({runs_text})")
    ratio = statistics.median(rates["sampler"]) / statistics.median(rates["generate"])
    print(f"ratio sampler/generate: {ratio:.2f}")


if __name__ == "__main__":
    main()
