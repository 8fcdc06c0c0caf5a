"""The two sampling interfaces: `Sampler`, what callers (rollouts, evaluation, jobs, the server)
sample with, and `SamplingEngine`, what every sampling engine implements, with what each can do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from posttrain.tokenizer import Tokenizer
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class Sampler(Protocol):
    """What callers sample with: `backend.sampling_client(model)` returns one (`ModelSampler`),
    and rollouts, evaluation, environments and the server take one."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def policy_version(self) -> int | None:
        """The model step whose weights the next sample uses (None: not known)."""
        ...

    async def sample_many(
        self,
        prompts: Sequence[ModelInput | Sequence[int]],
        num_samples: int,
        params: SamplingParams,
    ) -> list[SampleResponse]:
        """`num_samples` completions of each prompt, in one batched call where it can."""
        ...


WeightSync = Literal["live", "full", "none"]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does; `posttrain backends` and `doctor` print it, preflight reads it.

    `weight_sync`: "live" samples the training weights themselves (nothing to sync), "full"
    holds its own copy of the weights and takes what training changed after every optimizer
    step, "none" cannot be updated, so it samples a fixed policy and training on its samples
    goes off-policy.
    """

    returns_token_ids: bool
    returns_logprobs: bool
    weight_sync: WeightSync
    own_process: bool  # samples apart from training, so rollouts can overlap a training step
    provides_token_entropies: bool


SnapshotKind = Literal["model", "update"]


@dataclass(frozen=True)
class WeightSnapshot:
    """The weights of model step `version`, as files in `path`.

    kind "model": the whole weights, `model.safetensors` (Hugging Face names, LoRA merged into
    the base weights) with the config, an engine reloads them. kind "update": only what
    training changes, laid over the base model the engine started on: `adapter`, a PEFT
    adapter directory the engine loads as a LoRA, and/or `tensors`, a safetensors file of
    trainable tensors (client names) the engine writes into its weights in place, merging any
    LoRA factor among them against the base weight (`lora_scale` = alpha / rank). `bytes`:
    the bytes of the files written for the engine.
    """

    path: Path
    version: int
    kind: SnapshotKind = "model"
    adapter: Path | None = None
    tensors: Path | None = None
    lora_scale: float | None = None
    bytes: int = 0


@runtime_checkable
class SamplingEngine(Protocol):
    """Samples token ids with their logprobs from the weights of policy `version`."""

    name: str
    capabilities: EngineCapabilities

    @property
    def version(self) -> int:
        """The model step whose weights the next sample uses."""
        ...

    async def sample_many(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        """`num_samples` completions of each prompt; seeded per (seed, prompt index, sample)."""
        ...

    async def update_weights(self, snapshot: WeightSnapshot | None, version: int) -> None:
        """Sample from now on with the weights of model step `version` (`snapshot`: their
        files; None for a live engine, which samples the training weights already)."""
        ...

    async def close(self) -> None: ...
