"""Metrics of one train() call, aggregated token-weighted across its mini-batches."""

from __future__ import annotations

import operator
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from posttrain.algo.agreement import AgreementSums, agreement_metrics

# How the updates of a step combine a metric reported with each reduction other than mean.
_COMBINE: dict[str, Callable[[float, float], float]] = {
    "sum": operator.add,
    "min": min,
    "max": max,
}


@dataclass
class StepMetrics:
    """Counts and token-weighted means for one `train()` call."""

    reward: float = 0.0
    reward_std: float = 0.0
    num_groups: int = 0
    num_zero_variance_groups: int = 0
    num_dropped_groups: int = 0
    num_trajectories: int = 0
    num_updates: int = 0
    num_skipped_updates: int = 0
    num_tokens: int = 0
    nothing_to_train: bool = False
    flow: dict[str, float] = field(default_factory=dict[str, float])  # the advantage flow's stats
    # Sampler vs trainer logprobs over the step's trainable tokens (`algo.agreement`).
    sample_train: AgreementSums = field(default_factory=AgreementSums)
    _sums: defaultdict[str, float] = field(default_factory=lambda: defaultdict[str, float](float))
    _combined: dict[str, float] = field(default_factory=dict[str, float])  # :sum, :min, :max
    _unreduced: dict[str, list[float]] = field(default_factory=dict[str, list[float]])

    @classmethod
    def for_batch(
        cls,
        rewards: Sequence[float],
        num_groups: int,
        num_zero_variance_groups: int,
        num_dropped_groups: int,
    ) -> StepMetrics:
        return cls(
            reward=statistics.fmean(rewards) if rewards else 0.0,
            reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            num_groups=num_groups,
            num_zero_variance_groups=num_zero_variance_groups,
            num_dropped_groups=num_dropped_groups,
        )

    def nothing_trainable(self) -> StepMetrics:
        self.nothing_to_train = True
        return self

    def add_update(
        self,
        forward: Mapping[str, float],
        optim: Mapping[str, float],
        *,
        num_tokens: int,
        new_tokens: bool = True,
    ) -> None:
        """Fold in one mini-batch: `<name>:mean` token-weighted, `<name>:sum` summed, `:min`
        and `:max` the least and greatest over the step's updates, each reported as `<name>`.
        A key with no such reduction (a custom loss's `"my_metric"`) is averaged over the
        updates under its own name. `loss:sum` is averaged over the updates (`loss`), and
        `tokens:sum` is the step's `num_trainable_tokens`: the mini-batch's `num_tokens` count
        once (`new_tokens=False` for a later PPO epoch over the same tokens).

        `forward` must report `loss:sum` (every TrainingClient does). The optimizer's metrics
        are optional: a remote service may report none, and then none is aggregated.
        """
        if "loss:sum" not in forward:
            raise ValueError(
                f"forward_backward reported no 'loss:sum' (got {sorted(forward)}); the "
                "TrainingClient must report the summed loss"
            )
        self.num_updates += 1
        self.num_tokens += num_tokens if new_tokens else 0
        self._add("loss", forward["loss:sum"], 1.0)
        for key, value in forward.items():
            name, _, reduction = key.partition(":")
            if key in ("loss:sum", "tokens:sum"):
                continue
            if reduction == "mean":
                self._add(name, value, float(num_tokens))
            elif reduction in _COMBINE:
                before = self._combined.get(name)
                self._combined[name] = (
                    value if before is None else _COMBINE[reduction](before, value)
                )
            else:
                self._unreduced.setdefault(key, []).append(value)
        if "skipped:sum" in optim:
            self.num_skipped_updates += int(optim["skipped:sum"])
        # Plain means over the updates: one gradient norm and one learning rate per update.
        for name in ("grad_norm", "learning_rate"):
            if f"{name}:mean" in optim:
                self._add(name, optim[f"{name}:mean"], 1.0)

    def add_critic_update(
        self, forward: Mapping[str, float], optim: Mapping[str, float], *, num_tokens: int
    ) -> None:
        """Fold in the critic's update beside a policy mini-batch, as `critic/<name>`: its
        value loss (summed, averaged over updates), per-token means and gradient norm."""
        self._add("critic/value_loss", forward.get("loss:sum", 0.0), 1.0)
        for key, value in forward.items():
            name, _, reduction = key.partition(":")
            if reduction == "mean":
                self._add(f"critic/{name}", value, float(num_tokens))
        if "grad_norm:mean" in optim:
            self._add("critic/grad_norm", optim["grad_norm:mean"], 1.0)

    def _add(self, name: str, value: float, weight: float) -> None:
        self._sums[name] += value * weight
        self._sums[f"{name}.weight"] += weight

    def as_dict(self) -> dict[str, float]:
        out = {
            "reward": self.reward,
            "reward_std": self.reward_std,
            "num_groups": float(self.num_groups),
            "num_zero_variance_groups": float(self.num_zero_variance_groups),
            "num_dropped_groups": float(self.num_dropped_groups),
            "num_trajectories": float(self.num_trajectories),
            "num_updates": float(self.num_updates),
            "num_skipped_updates": float(self.num_skipped_updates),
            "num_trainable_tokens": float(self.num_tokens),
            "nothing_to_train": float(self.nothing_to_train),
            **self.flow,
            **agreement_metrics(self.sample_train),
        }
        for key, total in self._sums.items():
            if not key.endswith(".weight"):
                weight = self._sums[f"{key}.weight"]
                out[key] = total / weight if weight else 0.0
        # Never over what the trainer computes itself (DPO's per-pair means, in `flow`).
        for key, value in self._combined.items():
            out.setdefault(key, value)
        for key, values in self._unreduced.items():
            out.setdefault(key, statistics.fmean(values))
        return out
