"""Two clients computing at once on `posttrain serve`: does torch oversubscribe the cores?

Client A trains a LoRA (forward_backward + optim_step on a fixed SFT batch); client B samples
from the base model and scores prompts (`compute_logprobs`), both through the official tinker
SDK against a `posttrain serve` subprocess. Prints:

1. the latency of B's first sample and first prompt-logprobs request after the server started,
   while A trains (goal: under 2 s each);
2. tokens/s of A alone, B alone, and both at once (phases alternate, `--rounds` times, medians:
   the machine may be shared). Together, each client gets a fraction of its rate alone. The sum
   of the two fractions is the figure to compare: 1.0 when the cores are shared without loss,
   less when the two fight over them, more when each alone left the cores idle part of the
   time (HTTP, Python).

The server's torch gets `--threads` threads (OMP_NUM_THREADS, default: the usable cores).

    python benchmarks/serve_threads.py [--size mini] [--seconds 5] [--rounds 3] [--threads N]
        [--samples 4] [--new-tokens 32] [--batch 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tinker
from host import host_line
from serve_process import KEY, serve
from tinker import types

from posttrain.engine.threads import usable_cores
from posttrain.models.tiny import tiny_model_path

PROMPT = [10, *range(65, 65 + 23)]  # 24 tokens


def sft_batch(args: argparse.Namespace) -> list[types.Datum]:
    data = []
    for i in range(args.batch):
        tokens = [3 + (7 * i + 13 * j) % 250 for j in range(args.seq_len + 1)]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
                    "weights": types.TensorData.from_numpy(np.ones(args.seq_len, np.float32)),
                },
            )
        )
    return data


class Trainer:
    """Client A: one training client; `step()` is one forward_backward + optim_step."""

    def __init__(self, url: str, base_model: str, args: argparse.Namespace) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.client = self.service.create_lora_training_client(
            base_model=base_model, rank=8
        ).result()
        self.data = sft_batch(args)
        self.tokens = args.batch * args.seq_len

    def step(self) -> int:
        fb = self.client.forward_backward(self.data, "cross_entropy")
        opt = self.client.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        return self.tokens


class Sampler:
    """Client B: samples from the base model; `request()` is one sample of `samples` x up to
    `new_tokens` tokens, `score()` one prompt-logprobs request."""

    def __init__(self, url: str, base_model: str, args: argparse.Namespace) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.client = self.service.create_sampling_client(base_model=base_model).result()
        self.args = args
        self.prompt = types.ModelInput.from_ints(PROMPT)

    def request(self) -> int:
        params = types.SamplingParams(max_tokens=self.args.new_tokens, seed=1)
        out = self.client.sample(self.prompt, self.args.samples, params).result()
        return sum(len(s.tokens) for s in out.sequences)

    def score(self) -> int:
        self.client.compute_logprobs(self.prompt).result()
        return len(PROMPT)


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def rate(work: Callable[[], int], seconds: float, stop: threading.Event | None = None) -> float:
    """Tokens/s of `work` called back to back for about `seconds` (whole calls only)."""
    start, tokens = time.perf_counter(), 0
    while time.perf_counter() - start < seconds and not (stop and stop.is_set()):
        tokens += work()
    return tokens / (time.perf_counter() - start)


def together(jobs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Run each job on its own thread at once; their results by name."""
    results: dict[str, float] = {}
    threads = [
        threading.Thread(target=lambda n=name, j=job: results.__setitem__(n, j()))
        for name, job in jobs.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def first_requests(url: str, base_model: str, args: argparse.Namespace) -> dict[str, float]:
    """On the fresh server, A creates its model and trains; as soon as its model exists, B's
    first sample and first prompt-logprobs are timed while A keeps training."""
    stop, ready = threading.Event(), threading.Event()

    def train() -> None:
        trainer = Trainer(url, base_model, args)
        ready.set()
        rate(trainer.step, 1e9, stop)

    background = threading.Thread(target=train)
    background.start()
    try:
        ready.wait()
        sampler = Sampler(url, base_model, args)
        first = {"sample": timed(sampler.request), "logprobs": timed(sampler.score)}
        first["later samples (median of 5)"] = statistics.median(
            timed(sampler.request) for _ in range(5)
        )
    finally:
        stop.set()
        background.join()
    return first


def throughput(trainer: Trainer, sampler: Sampler, args: argparse.Namespace) -> dict[str, list]:
    """Tokens/s of A alone, B alone and both at once, `--rounds` alternating rounds."""
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, work in (("A train", trainer.step), ("B sample", sampler.request)):
            rates.setdefault(f"{name} alone", []).append(rate(work, args.seconds))
        both = together(
            {
                "A train": lambda: rate(trainer.step, args.seconds),
                "B sample": lambda: rate(sampler.request, args.seconds),
            }
        )
        for name, value in both.items():
            rates.setdefault(f"{name} both", []).append(value)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description="Concurrent training + sampling on the server.")
    parser.add_argument("--size", default="mini", choices=("tiny", "mini", "small"))
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    print(host_line(), flush=True)
    base_model = tiny_model_path(size=args.size)
    print(
        f"qwen2 {args.size} model, LoRA rank 8, fp32; server torch threads: OMP_NUM_THREADS="
        f"{args.threads} on {usable_cores()} usable core(s), load average "
        f"{os.getloadavg()[0]:.1f} at start"
    )
    print(
        f"A: forward_backward + optim_step on {args.batch} x {args.seq_len} tokens; B: sample "
        f"1 prompt (24 tokens) x {args.samples} x up to {args.new_tokens} new tokens"
    )
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        storage = Path(tmp) / "storage"
        storage.mkdir()
        with serve(base_model, storage, args.threads) as url:
            first = first_requests(url, str(base_model), args)
            for name, seconds in first.items():
                print(f"B's first request while A trains, {name}: {seconds:.2f} s")
            trainer = Trainer(url, str(base_model), args)
            sampler = Sampler(url, str(base_model), args)
            trainer.step()  # warm-up
            sampler.request()
            rates = throughput(trainer, sampler, args)
        logged = (Path(tmp) / "server.log").read_text().splitlines()
    for line in logged:
        if "threads: " in line:  # the server's own report of its settings
            print("server log:", line.split("threads: ", 1)[1])
    share = 0.0
    for name in ("A train", "B sample"):
        alone, both = (statistics.median(rates[f"{name} {k}"]) for k in ("alone", "both"))
        share += both / alone
        print(
            f"{name}: alone {alone:.0f} tokens/s | with the other client {both:.0f} tokens/s "
            f"({both / alone:.2f} of alone)"
        )
    print(f"sum of the fractions (1.0: the cores are shared without loss): {share:.2f}")


if __name__ == "__main__":
    main()
