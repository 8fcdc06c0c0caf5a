"""Batching across adapters (`engine.decode.multi_lora`): several LoRA clients of one base model in one
pass, against the same work one adapter at a time, on the tiny model or the Qwen2.5-0.5B
architecture (`--size qwen2.5-0.5b`, random weights, built locally).

The clients share one base model (the same Parameter objects, as `posttrain serve` shares
them) and each has its own adapter (ranks from `--ranks`, B random so the adapters matter).

(a) sampling: each client asks for `--samples` completions of its own prompt, `--new-tokens`
    tokens each (EOS ignored). Batched: one `Sampler.sample_batched` with per-row adapters;
    one at a time: each client's own `Sampler.sample`. Greedy tokens must agree (checked).
(b) forward: each client's batch of `--batch` sequences of `--seq-len` tokens, teacher-forced
    logprobs. Batched: one forward of all rows with per-row adapters; else one forward per
    client.
(c) forward_backward (`--fb`): the same, with a backward of each client's mean NLL; batched,
    the gradients reach each adapter through the gather (checked against the sequential ones).

The two ways alternate round after round in one process; the medians and their ratio
(one-at-a-time / batched, above 1 favours batching) are printed. Under a shared machine's
load the ratios are what to read, not the seconds.

    OMP_NUM_THREADS=2 python benchmarks/multi_lora.py [--size tiny | qwen2.5-0.5b] \
        [--clients 4] [--ranks 8,16,32,8] [--samples 4] [--new-tokens 32] [--batch 4] \
        [--seq-len 64] [--rounds 3] [--fb] [--dtype float32] [--device cpu] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from host import host_line
from torch import nn

from posttrain.engine.decode.multi_lora import MultiLora
from posttrain.engine.decode.sampler import Sampler, SampleRequest
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model, load_tokenizer
from posttrain.models.tiny import tiny_model_path
from posttrain.types import SamplingParams


def shared_base_loras(base: nn.Module, ranks: list[int]) -> list[nn.Module]:
    """One PEFT model per rank whose base Parameters are `base`'s own (a deep copy of the module
    tree that keeps every Parameter), each with a seeded random adapter (B != 0)."""
    models = []
    for i, rank in enumerate(ranks):
        memo: dict[int, object] = {id(p): p for p in base.parameters()}
        tree = copy.deepcopy(base, memo)
        model = apply_lora(tree, LoraSettings(rank), seed=i)  # pyright: ignore[reportArgumentType]
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
                    param.copy_(0.05 * noise.to(param.device))
        models.append(model.eval())
    return models


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began, out


def compare(
    name: str, rounds: int, one_by_one: Callable[[], object], batched: Callable[[], object]
):
    """Alternate the two ways `rounds` times; print the medians. The callers' agreement
    checks, which run each way once before, are the warm-up."""
    seq, bat = [], []
    for _ in range(rounds):
        seq.append(timed(one_by_one)[0])
        bat.append(timed(batched)[0])
    s, b = statistics.median(seq), statistics.median(bat)
    print(f"{name:<18} one at a time {s:8.3f} s   batched {b:8.3f} s   ratio {s / b:5.2f}x")


def nll(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """Per-row mean NLL of the next tokens."""
    logp = logits_BTV[:, :-1].float().log_softmax(-1)
    return -logp.gather(-1, ids_BT[:, 1:, None]).squeeze(-1).mean(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Batching across LoRA adapters")
    parser.add_argument("--size", default="tiny", choices=["tiny", "mini", "small", "qwen2.5-0.5b"])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ranks", default="8,16,32,8", help="adapter ranks, cycled over clients")
    parser.add_argument("--samples", type=int, default=4, help="completions per client")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="sequences per client, (b) and (c)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fb", action="store_true", help="also (c) forward_backward")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = parser.parse_args()
    print(host_line(), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = tiny_model_path(size=args.size)
    base = load_hf_model(path, dtype=args.dtype).to(args.device)
    for p in base.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(path)
    ranks = [int(r) for r in args.ranks.split(",")]
    models = shared_base_loras(base, [ranks[i % len(ranks)] for i in range(args.clients)])
    vocab = int(base.config.vocab_size)
    print(
        f"{args.size} {args.dtype} on {args.device}, {torch.get_num_threads()} threads: "
        f"{args.clients} clients, ranks {[ranks[i % len(ranks)] for i in range(args.clients)]}"
    )
    gen = torch.Generator().manual_seed(0)

    # (a) sampling
    prompts = [
        torch.randint(3, vocab - 10, (args.prompt_tokens,), generator=gen).tolist() for _ in models
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    samplers = [Sampler(m, tokenizer) for m in models]

    def sample_one_by_one() -> list[list[list[int]]]:
        return [
            [s.tokens for s in sampler.sample([prompt], args.samples, params)[0].sequences]
            for sampler, prompt in zip(samplers, prompts, strict=True)
        ]

    def sample_batched() -> list[list[list[int]]]:
        adapters = MultiLora(models[0], models)
        requests = [SampleRequest([p], params, slot) for slot, p in enumerate(prompts)]
        out = samplers[0].sample_batched(requests, args.samples, adapters)
        return [[s.tokens for s in r[0].sequences] for r in out]

    same = sample_one_by_one() == sample_batched()
    print(f"(a) greedy tokens batched == one at a time: {same}")
    compare("(a) sampling", args.rounds, sample_one_by_one, sample_batched)

    # (b) forward
    ids = [
        torch.randint(3, vocab - 10, (args.batch, args.seq_len), generator=gen).to(args.device)
        for _ in models
    ]
    all_ids = torch.cat(ids)
    slots = torch.arange(len(models)).repeat_interleave(args.batch)
    gathered = MultiLora(models[0], models)

    def forward_one_by_one() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat(
                [nll(m(input_ids=x).logits, x) for m, x in zip(models, ids, strict=True)]
            )

    def forward_batched() -> torch.Tensor:
        with torch.inference_mode(), gathered.patched():
            gathered.use(slots)
            return nll(models[0](input_ids=all_ids).logits, all_ids)

    gap = (forward_one_by_one() - forward_batched()).abs().max().item()
    print(f"(b) max |NLL batched - one at a time|: {gap:.2e}")
    compare("(b) forward", args.rounds, forward_one_by_one, forward_batched)
    if not args.fb:
        return

    # (c) forward_backward: each client's mean NLL, gradients into its own adapter
    def lora_grads() -> list[torch.Tensor]:
        grads = [p.grad for m in models for n, p in m.named_parameters() if "lora_" in n]
        for m in models:
            m.zero_grad(set_to_none=True)
        return [g for g in grads if g is not None]

    def fb_one_by_one() -> list[torch.Tensor]:
        for m, x in zip(models, ids, strict=True):
            nll(m(input_ids=x).logits, x).mean().backward()
        return lora_grads()

    def fb_batched() -> list[torch.Tensor]:
        with gathered.patched():
            gathered.use(slots)
            per_row = nll(models[0](input_ids=all_ids).logits, all_ids)
            per_row.view(len(models), args.batch).mean(-1).sum().backward()
        return lora_grads()

    worst = max(
        ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()
        for a, b in zip(fb_one_by_one(), fb_batched(), strict=True)
    )
    print(f"(c) max relative gradient gap batched vs one at a time: {worst:.2e}")
    compare("(c) fwd+bwd", args.rounds, fb_one_by_one, fb_batched)


if __name__ == "__main__":
    main()
