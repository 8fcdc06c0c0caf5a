"""The advantage-flow probe: run the configured flow on synthetic groups and look for tokens
of one sequence that end up with different advantages or loss weights.

A backend with `preserves_token_advantages=false` carries one value per sequence, so such a
flow would be silently averaged there; preflight refuses it when the probe finds one. The
synthetic groups exercise every part of a token transform: their tokens decode to a strategic
gram ("let me check": planning tokens), they carry sampler entropies, and the SEPA controller
is given a state with its gate open and lambda halfway up its ramp. A custom uncertainty kind
runs on them too, so one that returns the wrong number of values fails here, before any work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from posttrain.algo.loss_inputs import policy_tokens, shaped_advantages
from posttrain.algo.losses import LossBatch
from posttrain.algo.sepa import SEPAState
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.engine.batching import pad_datums
from posttrain.trainer.config import RLConfig
from posttrain.trainer.rl import prepare_batch, weighted
from posttrain.trainer.token_advantages import SEPA_STATE_KEY
from posttrain.types import Datum

# The probe's stand-in learner logprobs are q_t + 0.01*t and its reference ones lp_t - 0.02*t
# (t = 1, 2, ... along the sequence): every token differs, as with a real model.
PROBE_LEARNER_SHIFT = 0.01
PROBE_REFERENCE_SHIFT = 0.02
# A flow that keeps one value per sequence writes the same fp32 number on each of its tokens,
# so their spread is exactly 0; the shaping the probe looks for moves them by >= 1e-3.
PROBE_TOLERANCE = 1e-6


# What the probe's stand-in tokenizer decodes its sampled tokens 10, 11, ... to.
PROBE_WORDS = (" let", " me", " check", " the", " sum", " again")


class ProbeTokenizer:
    """Decodes the synthetic tokens (`PROBE_WORDS`): the token transforms only decode."""

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = False) -> str:
        return "".join(PROBE_WORDS[(t - 10) % len(PROBE_WORDS)] for t in token_ids)


def _sampled(n: int) -> TokenSegment:
    logprobs = tuple(-0.1 * (i + 1) for i in range(n))
    # Each sampling distribution's entropy as 0.8 x the sampled token's surprisal (retrain's).
    entropies = tuple(-0.8 * lp for lp in logprobs)
    return TokenSegment(tuple(range(10, 10 + n)), True, logprobs, entropies)


def probe_run_state(config: RLConfig) -> dict[str, object]:
    """A SEPA state with the gate open and lambda halfway up its linear ramp."""
    sepa = config.advantages.sepa
    steps = sepa.sepa_delay_steps + sepa.sepa_steps // 2
    return {SEPA_STATE_KEY: SEPAState(steps=steps, gate_open=True).state_dict()}


def synthetic_groups() -> list[TrajectoryGroup]:
    """Two small groups with distinct rewards, lengths and logprobs, to probe the flow."""

    def trajectory(n: int, reward: float) -> Trajectory:
        return Trajectory((TokenSegment((1, 2, 3)), _sampled(n)), reward)

    return [
        TrajectoryGroup((trajectory(3, 1.0), trajectory(5, 0.0), trajectory(4, 0.5))),
        TrajectoryGroup((trajectory(6, 0.2), trajectory(2, 0.9))),
    ]


@dataclass(frozen=True)
class ProbeFinding:
    """A synthetic sequence whose tokens got different advantages (or loss weights)."""

    sequence: int  # row of the probe batch: trajectories in order, dropped groups skipped
    quantity: Literal["advantages", "weights"]
    low: float
    high: float
    tokens: int

    def __str__(self) -> str:
        return (
            f"the advantage-flow probe gave the {self.tokens} tokens of synthetic sequence "
            f"{self.sequence} {self.quantity} from {self.low:.4g} to {self.high:.4g}"
        )


def _stand_in_batch(datums: Sequence[Datum]) -> LossBatch:
    """The probe's datums padded as the loss sees them, with stand-in learner and reference
    logprobs that differ from the sampler's on every token (as a model's would)."""
    padded = pad_datums(datums)
    q_BT = padded.inputs["logprobs"]
    t_BT = torch.arange(1, q_BT.shape[1] + 1, dtype=q_BT.dtype).expand_as(q_BT)
    logp_BT = q_BT + PROBE_LEARNER_SHIFT * t_BT
    inputs = {**padded.inputs, "ref_logprobs": logp_BT - PROBE_REFERENCE_SHIFT * t_BT}
    return LossBatch(logp_BT, inputs, padded.pad_mask_BT)


def probe_advantage_flow(config: RLConfig) -> ProbeFinding | None:
    """Run the trainer's advantage flow on synthetic groups (group advantages, token transform,
    reduction weights, then the loss's Kimi K2 tau correction and KL shaping, the same
    functions the trainer and loss run) and return the first sequence whose per-token
    advantages or weights are not all equal, or None."""
    batch = prepare_batch(
        synthetic_groups(), config, run_state=probe_run_state(config), tokenizer=ProbeTokenizer
    )
    if not batch.datums:
        return None
    loss_batch = _stand_in_batch(weighted(batch.datums, batch.masks, config))
    tokens = policy_tokens(loss_batch, config.loss_fn_config)
    adv_BT, _ = shaped_advantages(loss_batch, config.loss_fn_config, tokens)
    for row in range(adv_BT.shape[0]):
        mask_T = tokens.mask_BT[row]
        for quantity, values in (
            ("advantages", adv_BT[row][mask_T]),
            ("weights", tokens.weight_BT[row][mask_T]),
        ):
            if values.numel() and float(values.max() - values.min()) > PROBE_TOLERANCE:
                low, high = float(values.min()), float(values.max())
                return ProbeFinding(row, quantity, low, high, values.numel())  # pyright: ignore[reportArgumentType]
    return None
