"""The parity probe: right after a sync, a few tokens from the engine, scored by the trainer.

A step whose rollouts hold no on-policy tokens (async RL trains on rollouts one or more
versions old) cannot judge the engine from its data, so the engine is asked directly: 8 tokens
of one of the step's prompts at temperature 1, then one `client.forward` of that one sequence.
Its cost is one sampling call of 8 tokens and one forward pass of prompt + 8 tokens a step,
next to a step's whole batch of both.
"""

from __future__ import annotations

import torch

from posttrain.algo.agreement import sample_train_agreement
from posttrain.algo.losses import LossConfig
from posttrain.clients.protocol import TrainingClient
from posttrain.inference.protocol import SamplingEngine
from posttrain.trainer.parity import ParityCheck
from posttrain.types import Datum, ModelInput, SamplingParams

PROBE_TOKENS = 8


async def probe_engine(
    engine: SamplingEngine, client: TrainingClient, check: ParityCheck, version: int
) -> None:
    """Judge the engine, just synced to model step `version`, against `client` (which holds
    that step's weights) on `PROBE_TOKENS` tokens of `check.probe_prompt`."""
    prompt = list(check.probe_prompt or ())
    if not prompt:
        return
    params = SamplingParams(max_tokens=PROBE_TOKENS, seed=version, stop=[], temperature=1.0)
    response = (await engine.sample_many([prompt], 1, params))[0]
    sequence = response.sequences[0]
    if sequence.logprobs is None or not sequence.tokens:
        return  # nothing to compare: the engine returns no logprobs
    tokens = [*prompt, *sequence.tokens]
    count = len(tokens) - 1  # targets: position i predicts token i+1
    mask_T = torch.zeros(count)
    mask_T[-len(sequence.tokens) :] = 1.0
    sampler_T = torch.zeros(count)
    sampler_T[-len(sequence.tokens) :] = torch.tensor(sequence.logprobs)
    datum = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {
            "target_tokens": torch.tensor(tokens[1:]),
            "logprobs": sampler_T,
            "advantages": torch.zeros(count),
            "mask": mask_T,
        },
    )
    scored = await client.forward([datum], "importance_sampling", LossConfig())
    trainer_T = scored.loss_fn_outputs[0]["logprobs"].reshape(-1).cpu()
    check.judge(
        sample_train_agreement(sampler_T, trainer_T, mask_T),
        served=response.policy_version,
        expected=version,
        what=f"a probe of {len(sequence.tokens)} tokens after its sync",
        before_update=False,
    )
