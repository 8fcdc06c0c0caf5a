"""Peak RSS per phase of one RL step at a real size: sampling, forward_backward, optim_step.

The model is `make-tiny-model --size qwen2.5-0.5b` (the published Qwen2.5-0.5B architecture,
151936-token vocabulary, random weights), trained with LoRA. One step: sample P prompts x G
completions of exactly T tokens (`stop=[]`), then one forward_backward of the PPO loss on all
P x G datums (the worker's micro-batches, chunked logprobs, shared prompt prefixes), then one
optim_step. Before each phase the kernel's high-water mark is reset (`/proc/self/clear_refs`),
so each phase reports the largest resident set the process reached during it: what an
out-of-memory killer sees, memory the allocator kept from earlier phases included.

    OMP_NUM_THREADS=2 python benchmarks/rl_step_memory.py [--dtype bfloat16] [--lora 16]
        [--prompts 8] [--group 8] [--tokens 256] [--micro-batch-tokens 8192]
        [--gradient-checkpointing] [--size qwen2.5-0.5b]
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from host import host_line

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.models.tiny import tiny_model_path
from posttrain.types import AdamParams, SampleResponse, SamplingParams

R = TypeVar("R")
GIB = 2**30


def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def phase(name: str, run: Callable[[], R]) -> R:
    """Run one phase; print its time, peak RSS and the RSS it leaves."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    print(
        f"  {name:<17} peak RSS {_status_bytes('VmHWM') / GIB:5.2f} GiB, "
        f"after {_status_bytes('VmRSS') / GIB:5.2f} GiB, {seconds:6.1f} s",
        flush=True,
    )
    return out


def rl_datums(prompts: list[list[int]], responses: list[SampleResponse]) -> list[Datum]:
    """PPO datums on the sampled tokens, with group-centred random rewards as advantages."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        rewards = torch.rand(len(response.sequences), generator=gen)
        for sequence, advantage in zip(response.sequences, rewards - rewards.mean(), strict=True):
            ids = prompt + sequence.tokens
            own = len(prompt) - 1  # targets before the completion are the prompt's
            logprobs = torch.zeros(len(ids) - 1)
            logprobs[own:] = torch.tensor(sequence.logprobs or [0.0] * len(sequence.tokens))
            advantages = torch.zeros(len(ids) - 1)
            advantages[own:] = float(advantage) / len(sequence.tokens)
            out.append(
                Datum(
                    ModelInput.from_ints(ids[:-1]),
                    {
                        "target_tokens": torch.tensor(ids[1:]),
                        "logprobs": logprobs,
                        "advantages": advantages,
                    },
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--lora", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    print(host_line(), flush=True)
    path = tiny_model_path(size=args.size)
    print(f"{args.size} LoRA {args.lora}, {args.dtype}, {args.prompts} prompts x {args.group} "
          f"x {args.tokens} tokens, micro-batches of {args.micro_batch_tokens} tokens, gradient "
          f"checkpointing {args.gradient_checkpointing}; torch threads {torch.get_num_threads()}, "
          f"1-min load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    client = phase(
        "load",
        lambda: create_training_client(
            path,
            lora_rank=args.lora,
            dtype=args.dtype,
            device="cpu",
            micro_batch_tokens=args.micro_batch_tokens,
            gradient_checkpointing=args.gradient_checkpointing,
        ),
    )
    tokenizer = client.get_tokenizer()
    prompts = [
        tokenizer.encode(f"Reverse the word number {i}: abcdefghij"[: 24 + i]) for i in range(args.prompts)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, stop=[])
    responses = phase(
        "sampling",
        lambda: client.sample_many(
            [ModelInput.from_ints(p) for p in prompts], args.group, params
        ).result(),
    )
    datums = rl_datums(prompts, responses)
    phase("forward_backward", lambda: client.forward_backward(datums, "ppo").result())
    phase("optim_step", lambda: client.optim_step(AdamParams(learning_rate=1e-5)).result())
    print(f"1-min load average {os.getloadavg()[0]:.2f} after")
    client.close()


if __name__ == "__main__":
    main()
