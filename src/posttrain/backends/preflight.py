"""Preflight: refuse, before any work, a configuration a backend would silently degrade.

Checks options against the backend's capabilities, conflicting options, options the chosen loss
or token transform would ignore, whether the backend provides the per-token data the configured
uncertainty kind reads, and whether the configured advantage flow produces token-varying
advantages (found statically and by probing it on synthetic groups) for a backend that cannot
carry them; and, before `register` loads anything, that the model's base model can be had here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from posttrain.algo.loss_checks import unused_options
from posttrain.algo.losses import check_config
from posttrain.algo.sepa import SEPAConfig
from posttrain.algo.token_transforms import NEEDS_PLANNING, TOKEN_TRANSFORMS, TokenTransform
from posttrain.backends.capabilities import Capabilities
from posttrain.backends.plugins.schema import OptionSchema
from posttrain.backends.probe import probe_advantage_flow
from posttrain.clients.custom_loss import custom_loss, is_custom_loss, is_pair_loss
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.trainer.config import (
    DPOConfig,
    RLConfig,
    SFTConfig,
    from_options,
    option_defaults,
    option_fields,
    option_values,
)
from posttrain.trainer.datums import missing_logprobs
from posttrain.trainer.token_advantages import kind_needs_entropies, uses_token_path

_RL_DEFAULTS = option_defaults(RLConfig)
_SFT_DEFAULTS = option_defaults(SFTConfig)
_DPO_DEFAULTS = option_defaults(DPOConfig)
_WRITTEN = object()  # equal to no value: what a written option's default is taken to be

# Options known to give the tokens of one sequence different advantages (the static check).
TOKEN_VARYING_OPTIONS: tuple[tuple[str, Callable[[RLConfig], bool], str], ...] = (
    (
        "kimi_k2_tau",
        lambda c: bool(c.loss_fn_config.kimi_k2_tau),
        "kimi_k2_tau shifts each token's advantage by its log-ratio",
    ),
    (
        "kl_mode",
        lambda c: c.loss_fn_config.kl_penalty_coef > 0 and c.loss_fn_config.kl_mode == "advantage",
        "kl_mode='advantage' shapes each token's advantage by its KL",
    ),
    (
        "teacher",
        lambda c: c.distill.teacher is not None,
        "a teacher gives each token its own advantage (teacher - student logprob)",
    ),
)


_GTPO_FAMILY = frozenset(TOKEN_TRANSFORMS) - {"none"}
# The token transforms that read each option of the token flow.
FLOW_READERS: dict[str, frozenset[TokenTransform]] = {
    "uncertainty_kind": _GTPO_FAMILY,
    "gtpo_beta": _GTPO_FAMILY,
    "hicra_alpha": frozenset({"gtpo_hicra"}),
    "entropy_mask_rho": frozenset({"entropy_mask"}),
    "strategic_grams": NEEDS_PLANNING,
    **{key: frozenset({"gtpo_sepa"}) for key in option_fields(SEPAConfig)},
}


@dataclass(frozen=True)
class PreflightProblem:
    """One reason preflight refuses: the option at fault, and what is wrong with it."""

    option: str
    message: str


class PreflightError(ValueError):
    """Every problem preflight found, each naming the option, the backend and the fix."""

    def __init__(self, backend: str, problems: Sequence[PreflightProblem]) -> None:
        self.problems = list(problems)
        lines = [f"  - {p.option}: {p.message}" for p in problems]
        super().__init__(f"{backend} refuses this configuration:\n" + "\n".join(lines))


def _changed(config: RLConfig, name: str) -> bool:
    return option_values(config)[name] != _RL_DEFAULTS[name]


def conflicts(config: RLConfig) -> list[PreflightProblem]:
    """Options that contradict each other or would have no effect (each option's own range is
    its field's check, already passed)."""
    problems: list[PreflightProblem] = []
    loss, advantages = config.loss_fn_config, config.advantages
    if loss.truncated_importance_sampling is not None and not config.precalculate_logprobs:
        problems.append(
            PreflightProblem(
                "truncated_importance_sampling",
                "needs precalculate_logprobs=True: "
                "the trainer/sampler ratio needs the trainer's own logprobs",
            )
        )
    if loss.kl_penalty_coef == 0:
        for name in ("kl_estimator", "kl_mode"):
            if _changed(config, name):
                problems.append(
                    PreflightProblem(
                        name,
                        "has no effect with kl_penalty_coef=0; set kl_penalty_coef > 0 or drop it",
                    )
                )
    if advantages.loss_reduction_constant is not None and advantages.loss_reduction != "constant":
        problems.append(
            PreflightProblem("loss_reduction_constant", "only applies to loss_reduction='constant'")
        )
    if not advantages.scale_rewards and advantages.advantage_estimator != "grpo":
        problems.append(
            PreflightProblem(
                "scale_rewards",
                f"only applies to advantage_estimator='grpo'; "
                f"{advantages.advantage_estimator!r} never scales by the std",
            )
        )
    problems += token_flow_conflicts(config)
    problems += distill_conflicts(config)
    if is_custom_loss(config.loss_fn):
        return problems + custom_loss_problems(config)
    unused = unused_options(config.loss_fn, loss)
    for name, applies in unused:
        readers = " or ".join(f"loss={reader!r}" for reader in applies)
        problems.append(
            PreflightProblem(name, f"only applies to {readers}, not loss={config.loss_fn!r}")
        )
    try:
        if not unused:  # each was reported above, by name
            check_config(config.loss_fn, loss)
    except ValueError as exc:
        problems.append(PreflightProblem("loss", str(exc)))
    return problems


def custom_loss_problems(config: RLConfig) -> list[PreflightProblem]:
    """A custom loss must load (an entry point, a dotted path's import) and reads none of the
    loss options: each set is refused, by name."""
    problems = [
        PreflightProblem(name, f"has no effect on the custom loss {config.loss_fn!r}")
        for name, value in option_values(config.loss_fn_config).items()
        if name != "allow_training_without_logprobs" and value != _RL_DEFAULTS[name]
    ]
    try:
        custom_loss(config.loss_fn)
    except (ImportError, ValueError, TypeError) as exc:  # its import, or not a function
        problems.append(PreflightProblem("loss", str(exc)))
    return problems


def token_flow_conflicts(config: RLConfig) -> list[PreflightProblem]:
    """Token-flow options the configured transform would ignore, and a SEPA that never pools."""
    transform = config.advantages.tokens.token_transform
    problems: list[PreflightProblem] = []
    for name, readers in FLOW_READERS.items():
        if transform not in readers and _changed(config, name):
            wanted = " or ".join(repr(r) for r in sorted(readers))
            problems.append(
                PreflightProblem(
                    name,
                    f"only applies to token_transform={wanted}, not {transform!r}; drop it or "
                    "choose a transform that reads it",
                )
            )
    sepa = config.advantages.sepa
    if transform == "gtpo_sepa" and sepa.sepa_schedule == "linear" and sepa.sepa_steps == 0:
        problems.append(
            PreflightProblem(
                "sepa_steps",
                "is 0 with sepa_schedule='linear', so lambda stays 0 and gtpo_sepa is plain "
                "gtpo; set sepa_steps > 0, sepa_schedule='auto', or token_transform='gtpo'",
            )
        )
    return problems


def distill_conflicts(config: RLConfig) -> list[PreflightProblem]:
    """Distillation options without a teacher, and options a teacher's advantages exclude."""
    advantages = config.advantages
    if config.distill.teacher is None:
        if _changed(config, "distill_reward_coef"):
            return [
                PreflightProblem(
                    "distill_reward_coef",
                    "has no effect without a teacher; pass teacher=Teacher(...) or drop it",
                )
            ]
        return []
    problems: list[PreflightProblem] = []
    transform, estimator = advantages.tokens.token_transform, advantages.advantage_estimator
    if transform != "none" or estimator in ("reinforce_pp", "gae"):
        name = "token_transform" if transform != "none" else "advantage_estimator"
        value = transform if name == "token_transform" else estimator
        problems.append(
            PreflightProblem(
                name,
                f"{name}={value!r} computes its own per-token advantages, which a teacher's "
                "(teacher - student logprob) would replace; drop it, or drop teacher",
            )
        )
    if config.loss_fn_config.allow_training_without_logprobs:
        problems.append(
            PreflightProblem(
                "allow_training_without_logprobs",
                "a teacher's advantages are teacher - student logprob, so every trainable token "
                "needs the student's sampler logprob; sample with logprobs and drop this option",
            )
        )
    return problems


def backends_with(flag: str) -> list[str]:
    """The built-in backends whose capabilities set `flag` (for error messages)."""
    from posttrain.backends.plugins import registry  # here: the registry imports the backends

    names: list[str] = []
    for name in registry.BUILTINS:
        try:
            info = registry.describe(name)
        except Exception:  # an uninstalled extra: it cannot be offered anyway
            continue
        if getattr(info.capabilities, flag, False):
            names.append(info.label)
    return names


def token_data_problem(
    backend: str, capabilities: Capabilities, config: RLConfig
) -> PreflightProblem | None:
    """The configured uncertainty kind reads per-token data the backend does not provide."""
    advantages = config.advantages
    if advantages.tokens.token_transform == "none" or capabilities.provides_token_entropies:
        return None
    kind = advantages.tokens.uncertainty_kind
    try:
        needs = kind_needs_entropies(kind)
    except ValueError as exc:  # a custom kind that does not import
        return PreflightProblem("uncertainty_kind", str(exc))
    if not needs:
        return None
    having = ", ".join(backends_with("provides_token_entropies")) or "none installed here"
    return PreflightProblem(
        "uncertainty_kind",
        f"uncertainty_kind={kind!r} reads per-token entropies (the Shannon entropy of each "
        f"sampled token's distribution), which {backend} does not provide "
        f"(provides_token_entropies=false); use a backend that does ({having}), or "
        "uncertainty_kind='surprisal' or 'predictive_variance', which read the sampled tokens' "
        "logprobs every backend returns",
    )


def token_advantage_problem(
    backend: str, config: RLConfig, *, preserves: bool = False
) -> PreflightProblem | None:
    """The probe failing on synthetic groups; else, for a backend that keeps one advantage per
    sequence (`preserves` False), token-varying advantages: found from the options (static)
    and by the probe, which also catches flows no static rule names."""
    static = [(name, why) for name, applies, why in TOKEN_VARYING_OPTIONS if applies(config)]
    transform = config.advantages.tokens.token_transform
    if transform != "none":
        mode = config.advantages.algorithm_mode
        name = "algorithm_mode" if mode is not None else "token_transform"
        value = mode if mode is not None else transform
        static.append((name, f"{name}={value!r} gives each token its own advantage"))
    try:
        finding = probe_advantage_flow(config)
    except ValueError as exc:
        return PreflightProblem(
            "advantages", f"the advantage-flow probe failed on synthetic groups: {exc}"
        )
    if preserves or (not static and finding is None):
        return None
    reasons = [why for _, why in static] + ([str(finding)] if finding else [])
    return PreflightProblem(
        static[0][0] if static else "advantages",
        f"{'; '.join(reasons)}; but {backend} does not preserve token-level advantages "
        "(preserves_token_advantages=false), so it would carry one value per sequence; "
        "drop the option or use a backend that preserves them",
    )


def unsupported_options(
    backend: str,
    call: str,
    values: Mapping[str, object],
    defaults: Mapping[str, object],
    schema: Sequence[OptionSchema],
) -> list[PreflightProblem]:
    """Options `backend` does not declare, set away from their default, and values outside
    the choices it declares (a remote backend may offer fewer losses than the local one)."""
    declared = {o.name: o for o in schema}
    problems: list[PreflightProblem] = []
    for name, value in values.items():
        if name not in declared:
            if value != defaults[name]:
                supported = ", ".join(sorted(declared)) or "none declared"
                problems.append(
                    PreflightProblem(
                        name,
                        f"{backend}.{call}() does not take this option (set to {value!r}); "
                        f"remove it or use a backend that has it ({backend} takes: {supported})",
                    )
                )
        elif (
            declared[name].choices is not None
            and value not in declared[name].choices  # pyright: ignore[reportOperatorIssue]
            and value != defaults[name]  # None for an optional Literal: not among its choices
            and not takes_custom_loss(declared[name], value)
        ):
            problems.append(
                PreflightProblem(
                    name,
                    f"{value!r} is not one of the choices {backend}.{call}() declares "
                    f"{list(declared[name].choices or ())}; pick one of those or another backend",
                )
            )
    return problems


def takes_custom_loss(option: OptionSchema, value: object) -> bool:
    """A custom policy loss (registered, an entry point, a dotted path) given to an option
    whose type admits a `LossName`: it runs through forward_backward_custom on any backend,
    so the option's choices (its built-in losses) do not bound it."""
    admits = "LossName" in option.type.split(" | ")
    return admits and is_custom_loss(value) and not is_pair_loss(value)


def implied_defaults(config: RLConfig) -> dict[str, object]:
    """Each option's default, what the loss and `algorithm_mode` imply counting as one (ART's
    clip range, the mode's estimator and transform): an option is judged set only if set."""
    aliases = {"loss": config.loss_fn, "algorithm_mode": config.advantages.algorithm_mode}
    own = option_defaults(type(config))
    implied = option_values(from_options(type(config), aliases))
    return implied | {key: own[key] for key in ("loss", "ppo", "algorithm_mode")}


def missing_logprobs_problem(
    config: RLConfig, groups: Sequence[TrajectoryGroup]
) -> list[PreflightProblem]:
    """The trainer's rule (`trainer.datums.missing_logprobs`), reported with the options'."""
    allowed = config.loss_fn_config.allow_training_without_logprobs
    found = missing_logprobs(groups, allowed=allowed)
    return [] if found is None else [PreflightProblem("allow_training_without_logprobs", found)]


def preflight_rl(
    backend: str,
    capabilities: Capabilities,
    config: RLConfig,
    groups: Sequence[TrajectoryGroup] = (),
    *,
    options: Sequence[OptionSchema] | None = None,
) -> None:
    """Raise PreflightError listing every problem; return quietly when there is none.

    `options` is the backend's declared `train()` schema: when given, options it lacks (set
    away from their default) and values outside its choices are refused too.
    """
    problems = conflicts(config)
    critic: list[PreflightProblem] = []
    if config.advantages.advantage_estimator == "gae" and not capabilities.supports_critic:
        critic.append(
            PreflightProblem(
                "advantage_estimator",
                f"'gae' needs a learned critic (a value model trained beside the policy), which "
                f"{backend} does not have (supports_critic=false); use LocalBackend or "
                "RayBackend, or a group estimator such as 'grpo'",
            )
        )
    if options is not None:
        # `loss` is judged by the loss the call runs (`ppo=False` means cispo), not its field;
        # a backend that takes `loss` gets `ppo` folded into it, so `ppo` is not judged again.
        values = option_values(config)
        defaults = implied_defaults(config)
        if any(o.name == "loss" for o in options):
            del values["ppo"], defaults["ppo"]
        unsupported = unsupported_options(backend, "train", values, defaults, options)
        # 'gae' outside the declared choices: the critic's problem says why, once.
        problems += [p for p in unsupported if not (critic and p.option == "advantage_estimator")]
    if config.loss_fn_config.kl_penalty_coef > 0 and not capabilities.supports_kl_reference:
        problems.append(
            PreflightProblem(
                "kl_penalty_coef",
                f"{backend} cannot score tokens under a reference model; "
                "set kl_penalty_coef=0 or use a backend with supports_kl_reference",
            )
        )
    problems += critic
    problem = token_data_problem(backend, capabilities, config)
    if problem is not None:
        problems.append(problem)
    preserves = capabilities.preserves_token_advantages
    # A preserving backend is probed too when advantages go per token: a custom uncertainty
    # kind or a bad flow then fails here rather than in the middle of train().
    if not preserves or uses_token_path(config.advantages):
        problem = token_advantage_problem(backend, config, preserves=preserves)
        if problem is not None:
            problems.append(problem)
    problems += missing_logprobs_problem(config, groups)
    if problems:
        raise PreflightError(backend, problems)


def precision_mismatch(train_dtype: str, sample_dtype: str | None, config: RLConfig) -> str | None:
    """Why this RL step should correct for sampler/trainer mismatch with TIS, or None.

    In half precision the sampler's cached decode and the trainer's full pass round
    differently: on the 30M `small` model in bf16 their logprobs of the same tokens differ by
    up to 1.5e-2 (mean 3e-3), against 1.4e-6 in fp32, and by 3.1e-2 at 0.5B (benchmarks.md).
    An engine sampling in another dtype than the trainer's differs by as much. `sample_dtype`
    None: the engine samples the training weights themselves, in the trainer's dtype.
    """
    sampled_by = sample_dtype or train_dtype
    if train_dtype == sampled_by == "float32":
        return None
    if (
        config.precalculate_logprobs
        and config.loss_fn_config.truncated_importance_sampling is not None
    ):
        return None
    return (
        f"the trainer runs in {train_dtype} and the sampler in {sampled_by}: their logprobs "
        "differ by 1e-2 to 3e-2 per token at most; set precalculate_logprobs=True and "
        "truncated_importance_sampling (e.g. 2.0) so the loss corrects for it (TIS)"
    )


def preflight_sft(
    backend: str,
    capabilities: Capabilities,
    config: SFTConfig,
    *,
    options: Sequence[OptionSchema] | None = None,
) -> None:
    """Raise PreflightError listing every problem of an SFT call; `options` as in preflight_rl."""
    problems: list[PreflightProblem] = []
    if not capabilities.supports_sft:
        problems.append(
            PreflightProblem("train_sft", f"{backend} does not support SFT (supports_sft=false)")
        )
    if options is not None:
        problems += unsupported_options(
            backend, "train_sft", option_values(config), _SFT_DEFAULTS, options
        )
    if config.warmup_steps and config.lr_schedule == "constant" and config.min_lr_ratio != 0.0:
        problems.append(
            PreflightProblem("min_lr_ratio", "has no effect with lr_schedule='constant'")
        )
    if problems:
        raise PreflightError(backend, problems)


def preflight_dpo(
    backend: str,
    config: DPOConfig,
    *,
    options: Sequence[OptionSchema] | None = None,
    written: Collection[str] = (),
) -> None:
    """Raise PreflightError for `train_dpo` options `backend` does not declare (set away from
    their default, or `written` by the caller at any value) or values outside its choices, as
    preflight_sft does for SFT."""
    problems: list[PreflightProblem] = []
    if options is not None:
        # A value the user wrote counts as set: a backend that lacks the option would run its
        # own value, which need not be the default (TinkerBackend's reference is 'initial').
        defaults = {**_DPO_DEFAULTS, **{key: _WRITTEN for key in written}}
        problems += unsupported_options(
            backend, "train_dpo", option_values(config), defaults, options
        )
    if problems:
        raise PreflightError(backend, problems)
