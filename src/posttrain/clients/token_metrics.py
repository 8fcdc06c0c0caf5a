"""A built-in loss's per-token metrics, computed on the client from the logprobs a server returned.

The Tinker protocol carries no mask: the RL datums sent hold `target_tokens`, `logprobs` and
`advantages` (the token weights folded in), so a server counts every token, the prompt's too.
The loss is unaffected (A = 0 there), its statistics are not: the prompt's sampler logprobs
are 0, so its ratios are exp(lp) ~ 0. The client knows the mask, so it recomputes them here
with the same loss code on the same fp32 logprobs, as LocalBackend's worker does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from posttrain.algo.loss_metrics import counted_values, summarize_values
from posttrain.algo.losses import LossBatch, LossConfig, LossOutput, get_loss
from posttrain.engine.batching import pad_datums
from posttrain.types import Datum, ForwardBackwardOutput

# Statistics over tokens: `<name>:mean`, percentiles `<name>_p<q>:max`, and the token count.
_PER_TOKEN = re.compile(r"[^:]+:mean|[^:]+_p\d+:max|tokens:sum")


def run_builtin(
    name: str,
    config: LossConfig,
    data: Sequence[Datum],
    logprobs: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor] | None = None,
) -> tuple[LossOutput, torch.Tensor]:
    """Loss `name` of `algo.losses` on the datums with these logprobs (one tensor per datum,
    the shape of its target_tokens), and the mask of the tokens it counts."""
    padded = pad_datums(list(data))
    logp_BT = torch.nn.utils.rnn.pad_sequence(list(logprobs), batch_first=True)
    entropy_BT = None
    if entropies is not None:
        entropy_BT = torch.nn.utils.rnn.pad_sequence(list(entropies), batch_first=True)
    out = get_loss(name)(LossBatch(logp_BT, padded.inputs, padded.pad_mask_BT, entropy_BT), config)
    mask_BT = out.mask_BT if out.mask_BT is not None else padded.pad_mask_BT
    return out, mask_BT != 0


def with_token_metrics(
    output: ForwardBackwardOutput, data: Sequence[Datum], name: str, config: LossConfig
) -> ForwardBackwardOutput:
    """`output` with its per-token statistics replaced by loss `name`'s on the datums' counted
    tokens, from the `logprobs` (and `entropy`, where the server returns it) it carries.

    Other metrics (`loss:sum`, a server's own) are kept. Without entropies there is no entropy
    metric: none is better than one over the wrong tokens.
    """
    outputs = output.loss_fn_outputs
    logprobs = [o["logprobs"].to(torch.float32) for o in outputs]
    entropies = None
    if outputs and all("entropy" in o for o in outputs):
        entropies = [o["entropy"].to(torch.float32) for o in outputs]
    with torch.no_grad():
        out, mask_BT = run_builtin(name, config, data, logprobs, entropies)
    metrics = {k: v for k, v in output.metrics.items() if not _PER_TOKEN.fullmatch(k)}
    metrics["tokens:sum"] = float(mask_BT.sum())
    metrics.update(summarize_values(counted_values(out, mask_BT)))
    return ForwardBackwardOutput(output.loss_fn_output_type, outputs, metrics)
