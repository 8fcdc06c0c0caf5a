"""What the GPU tests share: batches, error measures and the report gpu-check prints."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from posttrain.types import Datum, ModelInput

# Where gpu-check collects the figures the tests measure (one JSON object a line), so the
# table in docs/gpu.md shows measured gaps, not only pass/fail. Unset: nothing is written.
REPORT_ENV = "POSTTRAIN_GPU_REPORT"


def report(name: str, **figures: object) -> None:
    """Record a measured figure for gpu-check's report (and print it for `pytest -s`)."""
    line = json.dumps({"check": name, **figures}, default=float)
    print(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        with Path(path).open("a") as out:
            out.write(line + "\n")


def rl_datums(seed: int = 0, count: int = 6) -> list[Datum]:
    """Token-level RL datums of mixed lengths with behaviour logprobs near a 260-token
    vocabulary's uniform value (log(1/260) = -5.6), so ratios sit near 1 and some clip."""
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 6 + 5 * i
        tokens = torch.randint(3, 250, (length + 1,), generator=gen)
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": -5.6 + 0.3 * torch.randn(length, generator=gen),
            "advantages": torch.randn(length, generator=gen),
            "mask": (torch.rand(length, generator=gen) > 0.2).float(),
        }
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def sft_datums(seed: int = 0, count: int = 6) -> list[Datum]:
    """Cross-entropy datums with per-token weights (a token mean over the batch)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [6 + 5 * i for i in range(count)]
    total = sum(lengths)
    datums = []
    for length in lengths:
        tokens = torch.randint(3, 250, (length + 1,), generator=gen)
        inputs = {"target_tokens": tokens[1:], "weights": torch.full((length,), 1.0 / total)}
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def rel_error(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over every tensor together, in float64 on the CPU."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = sum(float((a[k].double().cpu() - b[k].double().cpu()).norm() ** 2) for k in a)
    den = sum(float(a[k].double().cpu().norm() ** 2) for k in a)
    return (num / den) ** 0.5


def bitwise_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in dtype, shape or any bit (empty: all identical)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [
        k
        for k in a
        if a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(_bytes(a[k]), _bytes(b[k]))
    ]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
