"""Shared by the loss tests: padded batches from per-row lists, random rows, column helpers.

Rows are dicts of per-token lists ({"lp": [...], "advantages": [...], ...}); `lp` is the
learner's logprob, the other keys are loss_fn_inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from posttrain.algo.losses import LossBatch, LossConfig, LossOutput, get_loss

Row = dict[str, list[float]]
LN2 = math.log(2.0)
NAN = float("nan")
# Defaults pinned by the spec (Tinker for ppo/cispo, the GSPO paper for gspo), written out here
# so that a change of DEFAULT_THRESHOLDS fails a test instead of passing silently.
SPEC_THRESHOLDS = {
    "importance_sampling": (0.8, 1.2),
    "ppo": (0.8, 1.2),
    "cispo": (0.0, 4.0),
    "gspo": (1 - 3e-4, 1 + 4e-4),
}


def make_batch(
    rows: Sequence[Row],
    keys: Sequence[str],
    dtype: torch.dtype = torch.float64,
    extra_pad: int = 0,
    pad_fill: float = 0.0,
) -> tuple[LossBatch, torch.Tensor]:
    """Pad rows (each {"lp": [...], key: [...]}) to a LossBatch; returns it and the lp leaf."""
    width = max(len(row["lp"]) for row in rows) + extra_pad
    logp = torch.full((len(rows), width), -3.0, dtype=dtype)  # the learner's value on padding
    pad = torch.zeros(len(rows), width)
    inputs = {key: torch.full((len(rows), width), pad_fill, dtype=dtype) for key in keys}
    for b, row in enumerate(rows):
        n = len(row["lp"])
        logp[b, :n] = torch.tensor(row["lp"], dtype=dtype)
        pad[b, :n] = 1.0
        for key in keys:
            inputs[key][b, :n] = torch.tensor(row[key], dtype=dtype)
    inputs["target_tokens"] = torch.zeros(len(rows), width, dtype=torch.long)
    logp.requires_grad_(True)
    return LossBatch(logp, inputs, pad), logp


def run(
    name: str, rows: Sequence[Row], keys: Sequence[str], config: LossConfig | None = None
) -> tuple[float, torch.Tensor, LossOutput]:
    """(loss, d loss / d lp, output) of loss `name` on float64 rows."""
    batch, logp = make_batch(rows, keys)
    out = get_loss(name)(batch, config or LossConfig())
    out.loss.backward()
    assert logp.grad is not None
    return out.loss.item(), logp.grad, out


def f32(x: np.ndarray) -> list[float]:
    """Values rounded to float32, so the fp32 and fp64 runs and the reference see the same inputs."""
    return [float(v) for v in x.astype(np.float32)]


_COLUMNS = ("lp", "dq", "missing", "adv", "w", "mask", "seq_mask", "ds", "dref", "lo", "hi")


@st.composite
def row_lists(draw: st.DrawFn, max_rows: int = 3, max_len: int = 5) -> list[Row]:
    """1-3 rows of 1-5 tokens: logprobs in [-4, 0), ratios in e^±0.6 (across the clip bounds),
    some zero weights, masked-out tokens and NaN holes. One uniform array is drawn and mapped to
    each column's range (drawing column by column is ~7x slower in hypothesis).
    """
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_rows))
    shape = (len(_COLUMNS), len(lengths), max(lengths))
    return rows_from_uniform(lengths, draw(hnp.arrays(np.float64, shape, elements=st.floats(0, 1))))


def rows_from_uniform(lengths: Sequence[int], u: np.ndarray) -> list[Row]:
    """Rows from uniform [0, 1] draws u[column, row, token], mapped to each column's range."""
    rows: list[Row] = []
    for b, n in enumerate(lengths):
        c = {name: u[i, b, :n] for i, name in enumerate(_COLUMNS)}
        lp = np.array(f32(-4.0 + 3.99 * c["lp"]))
        q = np.array(f32(lp + 1.2 * c["dq"] - 0.6))
        rows.append(
            {
                "lp": f32(lp),
                "logprobs": f32(q),
                "q_with_nan": f32(np.where(c["missing"] < 0.3, np.nan, q)),
                "advantages": f32(4.0 * c["adv"] - 2.0),
                "weights": f32(np.where(c["w"] < 0.2, 0.0, 0.1 + 1.9 * c["w"])),
                "mask": f32(c["mask"] < 0.7),
                "sequence_ratio_mask": f32(c["seq_mask"] < 0.7),
                "sampler_logprobs": f32(q + c["ds"] - 0.5),
                "ref_logprobs": f32(lp + 2.0 * c["dref"] - 1.0),
                "clip_low_threshold": f32(0.5 + 0.45 * c["lo"]),
                "clip_high_threshold": f32(1.05 + 0.45 * c["hi"]),
            }
        )
    return rows


def seeded_rows(seed: int, lengths: Sequence[int] = (4, 1, 6)) -> list[Row]:
    """Rows as `row_lists` draws them, from numpy's generator with `seed`."""
    rng = np.random.default_rng(seed)
    return rows_from_uniform(lengths, rng.random((len(_COLUMNS), len(lengths), max(lengths))))


POLICY = ["logprobs", "advantages"]
W = [*POLICY, "weights"]


def column(rows: Sequence[Row], key: str, width: int) -> torch.Tensor:
    """rows[b][key] as a float64 [B, width] tensor, zero-padded."""
    return torch.tensor(
        [row[key] + [0.0] * (width - len(row[key])) for row in rows], dtype=torch.float64
    )


def on_policy(rows: list[Row]) -> list[Row]:
    """The rows with behaviour logprobs equal to the learner's: every ratio is exactly 1."""
    return [{**row, "logprobs": list(row["lp"])} for row in rows]
