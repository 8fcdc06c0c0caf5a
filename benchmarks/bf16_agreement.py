"""How far bf16 moves logprobs: the trainer's in bf16 against fp32 on the same tokens, and the
sampler's against the trainer's within one precision (the mismatch TIS corrects).

One LoRA-8 client per dtype on the same model (`make-tiny-model --size`; random weights, so
logits are near uniform). Trainer: `forward` on R random rows of L tokens. Sampler: P samples
of T tokens from one prompt at temperature 1, then the trainer's `forward` on those tokens.

    OMP_NUM_THREADS=2 python benchmarks/bf16_agreement.py [--size small] [--samples 8] [--tokens 32]
"""

from __future__ import annotations

import argparse

import torch
from host import host_line

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.models.tiny import tiny_model_path
from posttrain.types import SamplingParams


def rows(count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (length + 1,), generator=gen).tolist() for _ in range(count)]


def trainer_logprobs(client: LocalTrainingClient, ids: list[list[int]], start: int) -> torch.Tensor:
    """The trainer's logprobs of each row's targets from position `start` on, concatenated."""
    datums = [
        Datum(
            ModelInput.from_ints(r[:-1]),
            {"target_tokens": torch.tensor(r[1:]), "weights": torch.ones(len(r) - 1)},
        )
        for r in ids
    ]
    out = client.forward(datums, "cross_entropy").result()
    return torch.cat([o["logprobs"][start:] for o in out.loss_fn_outputs])


def sampler_gap(client: LocalTrainingClient, samples: int, tokens: int) -> torch.Tensor:
    prompt = list(range(40, 72))
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, stop=[])
    response = client.sample(ModelInput.from_ints(prompt), samples, params).result()
    sampled = torch.cat([torch.tensor(s.logprobs or []) for s in response.sequences])
    ids = [prompt + s.tokens for s in response.sequences]
    return trainer_logprobs(client, ids, len(prompt) - 1) - sampled


def describe(label: str, diff: torch.Tensor, reference: torch.Tensor | None = None) -> None:
    text = f"{label}: |diff| max {diff.abs().max():.2e}, mean {diff.abs().mean():.2e}"
    if reference is not None:
        text += f", max relative {(diff.abs() / reference.abs()).max():.2%}"
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="small")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(host_line(), flush=True)
    path = tiny_model_path(size=args.size)
    ids = rows(4, 64)
    logprobs, gaps = {}, {}
    for dtype in ("float32", "bfloat16"):
        client = create_training_client(path, lora_rank=8, dtype=dtype, device="cpu")
        logprobs[dtype] = trainer_logprobs(client, ids, 0)
        gaps[dtype] = sampler_gap(client, args.samples, args.tokens)
        client.close()
    print(f"{args.size}, LoRA 8, torch threads {torch.get_num_threads()}")
    describe("trainer bf16 vs fp32, 4 x 64 tokens", logprobs["bfloat16"] - logprobs["float32"], logprobs["float32"])  # fmt: skip
    for dtype, gap in gaps.items():
        describe(f"trainer vs sampler in {dtype}, {args.samples} x {args.tokens} tokens", gap)


if __name__ == "__main__":
    main()
