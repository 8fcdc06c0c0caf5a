"""Per-token advantages of one RL step, on the exact tokens the sampler produced.

For a token transform other than `none`, or for `reinforce_pp`: each completion's trainable
targets get an uncertainty (`algo.uncertainty`, a built-in kind or one named by dotted path),
planning tokens are found in their decoded text when the transform needs them
(`algo.planning`), the transform spreads the episode advantage over them
(`algo.token_transforms`), SEPA's lambda is resolved once for the step from the controller
state the earlier steps left (`algo.sepa`), and reinforce_pp whitens all of them over the batch.

The controller state comes in from, and goes back out to, the model's `run_state` under
`SEPA_STATE_KEY`: it is saved with each checkpoint, so a resumed run continues exactly.
Statistics (uncertainty of execution and planning tokens, lambda, the gate) cover every
completion of the step, trained or not: they describe the policy, not the kept groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from posttrain.algo.advantages import AdvantageConfig, AdvantageResult
from posttrain.algo.planning import parse_grams, planning_mask
from posttrain.algo.sepa import CORRECT_REWARD, SEPAState, sepa_lambda, sepa_observe
from posttrain.algo.token_transforms import NEEDS_PLANNING, GroupTokens, transform_group, whiten
from posttrain.algo.uncertainty import (
    KIND_NEEDS,
    UNCERTAINTY_KINDS,
    UncertaintyFn,
    token_uncertainty,
)
from posttrain.data.trajectories import JSONScalar, Trajectory, TrajectoryGroup
from posttrain.finder import Kind, load

UNCERTAINTY = Kind(
    "uncertainty_kind",
    dict[str, object](UNCERTAINTY_KINDS.items()),  # keyed by str: a custom kind is any name
    example="mypkg.kinds:my_kind",
    plural="uncertainty kinds",
)
# The run_state key of the SEPA controller's state (keys the trainer owns in run_state).
SEPA_STATE_KEY = "sepa_controller"
TRAINER_RUN_STATE_KEYS = frozenset({SEPA_STATE_KEY})


def uses_token_path(config: AdvantageConfig) -> bool:
    """Whether the step computes advantages per token (else one per completion)."""
    return config.tokens.token_transform != "none" or config.advantage_estimator == "reinforce_pp"


def resolve_kind(kind: str) -> UncertaintyFn:
    """The function of an uncertainty kind: a built-in, or a callable named 'pkg.mod:fn'."""
    fn = load(kind, UNCERTAINTY)
    if not callable(fn):
        raise ValueError(
            f"uncertainty_kind={kind!r} is a {type(fn).__name__}, not a function "
            "(logprobs, entropies) -> one uncertainty per token"
        )
    return fn  # pyright: ignore[reportReturnType]


def kind_needs_entropies(kind: str) -> bool:
    """Whether a kind reads per-token entropies: `shannon_entropy`, or a custom kind whose
    function sets `needs_entropies = True`."""
    if kind in KIND_NEEDS:
        return KIND_NEEDS[kind] == "entropies"
    return bool(getattr(resolve_kind(kind), "needs_entropies", False))


def reads_entropies(config: AdvantageConfig) -> bool:
    """Whether the step reads per-token entropies: a token transform with such a kind."""
    return config.tokens.token_transform != "none" and kind_needs_entropies(
        config.tokens.uncertainty_kind
    )


@dataclass(frozen=True)
class Targets:
    """A trajectory's trainable targets in order (position i of a datum predicts token i+1)."""

    logprobs: list[float]  # NaN where the sampler gave none
    entropies: list[float] | None  # None unless every trainable segment has them
    plan: list[int] | None  # planning flags, when the transform needs them


def targets(
    trajectory: Trajectory, decode: Callable[[int], str] | None, grams: Sequence[str]
) -> Targets:
    """The per-target data token transforms read, shifted as `datums.trajectory_arrays`."""
    trainable: list[bool] = []
    logprobs: list[float] = []
    entropies: list[float] = []
    has_entropies = True
    plan: list[int] = []
    for segment in trajectory.segments:
        n = len(segment.tokens)
        trainable += [segment.trainable] * n
        logprobs += list(segment.logprobs) if segment.logprobs is not None else [math.nan] * n
        if segment.entropies is None:
            has_entropies = has_entropies and not segment.trainable
            entropies += [math.nan] * n
        else:
            entropies += list(segment.entropies)
        if decode is not None:
            texts = [decode(t) for t in segment.tokens] if segment.trainable else []
            plan += planning_mask(texts, grams) if segment.trainable else [0] * n
    keep = [p for p in range(1, len(trainable)) if trainable[p]]
    return Targets(
        logprobs=[logprobs[p] for p in keep],
        entropies=[entropies[p] for p in keep] if has_entropies else None,
        plan=[plan[p] for p in keep] if decode is not None else None,
    )


def _decoder(tokenizer: Callable[[], object] | None) -> Callable[[int], str]:
    """Each token decoded alone (cached: a vocabulary's worth at most)."""
    if tokenizer is None:
        raise ValueError(
            "the token transform finds planning tokens in the decoded text, and this step "
            "was given no tokenizer"
        )
    loaded = tokenizer()
    # Only `decode` is read here: a decode-only tokenizer (the preflight probe's) is enough.
    if not callable(getattr(loaded, "decode", None)):
        raise TypeError(f"the tokenizer for planning tokens has no decode(): {loaded!r}")
    decode_ids: Callable[[list[int]], str | list[str]] = loaded.decode  # pyright: ignore[reportAttributeAccessIssue]
    cache: dict[int, str] = {}

    def decode(token: int) -> str:
        if token not in cache:
            text = decode_ids([token])
            cache[token] = text if isinstance(text, str) else "".join(text)
        return cache[token]

    return decode


@dataclass
class TokenAdvantages:
    """Per-token advantages over each trajectory's trainable targets (None: group dropped),
    the step's statistics, and the run_state entries to save after the step."""

    per_trajectory: list[list[torch.Tensor | None]]
    metrics: dict[str, float] = field(default_factory=dict[str, float])
    run_state: dict[str, dict[str, JSONScalar]] = field(
        default_factory=dict[str, dict[str, JSONScalar]]
    )


def _uncertainties(
    config: AdvantageConfig, all_targets: list[list[Targets]]
) -> list[list[torch.Tensor]]:
    """u [T] of each completion by the configured kind, errors naming the trajectory."""
    kind = config.tokens.uncertainty_kind
    fn = resolve_kind(kind)
    reads_logprobs = KIND_NEEDS.get(kind) == "logprobs"  # pyright: ignore[reportArgumentType]
    reads_entropies = kind_needs_entropies(kind)
    out: list[list[torch.Tensor]] = []
    for g, row in enumerate(all_targets):
        out.append([])
        for t, found in enumerate(row):
            if reads_logprobs and any(math.isnan(lp) for lp in found.logprobs):
                raise ValueError(
                    f"group {g} trajectory {t}: uncertainty_kind={kind!r} reads the sampler's "
                    "logprobs, and a trainable segment has none; sample with logprobs"
                )
            if reads_entropies and found.entropies is None:
                raise ValueError(
                    f"group {g} trajectory {t}: uncertainty_kind={kind!r} reads per-token "
                    "entropies, and a trainable segment has none: sample it with "
                    "SamplingParams(entropies=True), on a backend whose sampler computes them "
                    "(provides_token_entropies in `posttrain backends`)"
                )
            try:
                out[-1].append(token_uncertainty(kind, fn, found.logprobs, found.entropies))
            except ValueError as exc:
                raise ValueError(f"group {g} trajectory {t}: {exc}") from exc
    return out


def token_advantages(
    groups: Sequence[TrajectoryGroup],
    episode: AdvantageResult,
    config: AdvantageConfig,
    *,
    run_state: Mapping[str, object] | None = None,
    tokenizer: Callable[[], object] | None = None,
) -> TokenAdvantages:
    """The step's per-token advantages (see the module docstring)."""
    transform = config.tokens.token_transform
    decode = _decoder(tokenizer) if transform in NEEDS_PLANNING else None
    grams = parse_grams(config.tokens.strategic_grams)
    all_targets = [[targets(t, decode, grams) for t in g.trajectories] for g in groups]
    if transform == "none":
        u = [
            [torch.zeros(len(t.logprobs), dtype=torch.float64) for t in row] for row in all_targets
        ]
    else:
        u = _uncertainties(config, all_targets)
    plans = [
        [
            torch.tensor(
                t.plan if t.plan is not None else [0] * len(t.logprobs), dtype=torch.float64
            )
            for t in row
        ]
        for row in all_targets
    ]
    out = TokenAdvantages(per_trajectory=[])
    lam = 0.0
    state: SEPAState | None = None
    if transform == "gtpo_sepa":
        saved = (run_state or {}).get(SEPA_STATE_KEY)
        state = (
            SEPAState.from_state_dict(saved)
            if isinstance(saved, Mapping)
            else SEPAState.initial(config.sepa)
        )
        lam = sepa_lambda(config.sepa, state)
        out.metrics.update(sepa_lambda=lam, sepa_gate_open=float(state.gate_open))
    masked = total = 0
    for g, adv_G in enumerate(episode.advantages):
        if not episode.kept[g]:
            out.per_trajectory.append([None] * len(adv_G))
            continue
        tokens = GroupTokens(adv_G.tolist(), u[g], plans[g])
        advs, zeroed = transform_group(
            tokens,
            transform,
            beta=config.tokens.gtpo_beta,
            alpha=config.tokens.hicra_alpha,
            lam=lam,
            rho=config.tokens.entropy_mask_rho,
        )
        out.per_trajectory.append(list(advs))
        masked, total = masked + zeroed, total + sum(a.numel() for a in advs)
    if config.advantage_estimator == "reinforce_pp":
        _whiten_in_place(out.per_trajectory)
    if transform != "none":
        out.metrics.update(_uncertainty_stats(u, plans))
    if transform == "entropy_mask":
        out.metrics["entropy_mask_fraction"] = masked / total if total else 0.0
    if state is not None:
        rewards = [r for g in groups for r in g.rewards]
        correct = sum(r > CORRECT_REWARD for r in rewards) / len(rewards) if rewards else 0.0
        exec_u = _pooled(u, plans, planning=False)
        after = sepa_observe(config.sepa, state, correct, exec_u)
        out.run_state[SEPA_STATE_KEY] = after.state_dict()
    return out


def _whiten_in_place(per_trajectory: list[list[torch.Tensor | None]]) -> None:
    """reinforce_pp: whiten every kept completion token's advantage over the whole batch."""
    kept = [a for row in per_trajectory for a in row if a is not None]
    if not kept:
        return
    flat = whiten(torch.cat(kept))
    offset = 0
    for row in per_trajectory:
        for i, a in enumerate(row):
            if a is not None:
                row[i] = flat[offset : offset + a.numel()]
                offset += a.numel()


def _pooled(
    u: list[list[torch.Tensor]], plans: list[list[torch.Tensor]], *, planning: bool
) -> torch.Tensor:
    parts = [
        u_T[(p_T > 0) == planning]
        for u_row, p_row in zip(u, plans, strict=True)
        for u_T, p_T in zip(u_row, p_row, strict=True)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _uncertainty_stats(
    u: list[list[torch.Tensor]], plans: list[list[torch.Tensor]]
) -> dict[str, float]:
    """Mean and (population) variance of the execution and planning tokens' uncertainty."""
    stats: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name, planning in (("exec", False), ("plan", True)):
        values = _pooled(u, plans, planning=planning)
        sizes[name] = values.numel()
        stats[f"{name}_uncertainty_mean"] = float(values.mean()) if values.numel() else 0.0
        stats[f"{name}_uncertainty_var"] = (
            float(values.var(correction=0)) if values.numel() else 0.0
        )
    total = sizes["exec"] + sizes["plan"]
    stats["plan_token_fraction"] = sizes["plan"] / total if total else 0.0
    return stats
