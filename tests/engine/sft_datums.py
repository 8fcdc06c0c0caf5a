"""Small random SFT datums for engine tests: three rows of 9, 12 and 7 tokens, weights summing
to about 1 (1/25 a token), from `seed`."""

from __future__ import annotations

import torch

from posttrain import Datum, ModelInput


def random_datums(seed: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in (9, 12, 7):
        ids = torch.randint(0, 256, (length,), generator=generator).tolist()
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1]),
                {"target_tokens": ids[1:], "weights": [1.0 / 25] * (length - 1)},
            )
        )
    return out
