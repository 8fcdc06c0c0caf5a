"""Plain data shared by every layer: model inputs, datums, sampling and optimizer settings,
trajectories and results.

The first five mirror the `tinker` SDK's names and constructors (`ModelInput.from_ints`,
`Datum(model_input=..., loss_fn_inputs=...)`, `SamplingParams`, `AdamParams`), so code moves
between Tinker and posttrain by changing imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import torch

JSONScalar: TypeAlias = str | int | float | bool | None
TensorLike: TypeAlias = torch.Tensor | np.ndarray | Sequence[float] | Sequence[int]

# Keys whose values are token ids; every other loss_fn_input is float32 (as in the tinker SDK).
INT_KEYS = frozenset({"target_tokens"})


def _check_finite_number(name: str, value: float, *, low: float | None = None) -> None:
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids."""

    tokens: tuple[int, ...]
    type: Literal["encoded_text"] = "encoded_text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    """What the model reads: a list of chunks (only token chunks on posttrain today)."""

    chunks: tuple[EncodedTextChunk, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):  # pyright: ignore[reportUnnecessaryIsInstance]
                raise ValueError(
                    f"ModelInput.chunks accepts EncodedTextChunk only, got {type(chunk).__name__}"
                )

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=(EncodedTextChunk(tokens=tuple(tokens)),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=())

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append_int(self, token: int) -> ModelInput:
        return ModelInput.from_ints([*self.to_ints(), token])


def to_tensor(key: str, value: TensorLike) -> torch.Tensor:
    """Coerce a loss_fn_input to torch: int64 for token ids, float32 for everything else."""
    dtype = torch.int64 if key in INT_KEYS else torch.float32
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=dtype)
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value.tolist(), dtype=dtype)
    return torch.tensor(list(value), dtype=dtype)


@dataclass(frozen=True)
class Datum:
    """One training example: `model_input` plus per-token `loss_fn_inputs`.

    Position i of `model_input` predicts `target_tokens[i]`; every per-token input has the same
    leading length as `model_input`. Lists, numpy arrays and tensors are accepted and stored as
    CPU tensors (int64 for `target_tokens`, float32 otherwise).
    """

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, torch.Tensor]

    def __init__(self, model_input: ModelInput, loss_fn_inputs: Mapping[str, TensorLike]) -> None:
        tensors = {key: to_tensor(key, value) for key, value in loss_fn_inputs.items()}
        length = model_input.length
        if length == 0:
            raise ValueError("Datum.model_input is empty: a datum needs at least one token")
        for key, tensor in tensors.items():
            if tensor.dim() == 0 or tensor.shape[0] != length:
                raise ValueError(
                    f"Datum.loss_fn_inputs[{key!r}] has shape {tuple(tensor.shape)}; "
                    f"its first dimension must equal model_input.length={length}"
                )
        object.__setattr__(self, "model_input", model_input)
        object.__setattr__(self, "loss_fn_inputs", tensors)

    @property
    def length(self) -> int:
        return self.model_input.length


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `stop=None` stops at EOS; `stop=[]` never stops early."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        _check_finite_number("SamplingParams.temperature", self.temperature, low=0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if isinstance(self.stop, list | tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
            kinds = {type(s) for s in self.stop}
            if len(kinds) > 1:
                raise ValueError("SamplingParams.stop must be all strings or all token ids")

    def stop_strings(self) -> tuple[str, ...]:
        if isinstance(self.stop, str):
            return (self.stop,)
        if isinstance(self.stop, tuple):
            return tuple(s for s in self.stop if isinstance(s, str))
        return ()

    def stop_tokens(self) -> tuple[int, ...]:
        if isinstance(self.stop, tuple):
            return tuple(s for s in self.stop if isinstance(s, int))
        return ()


@dataclass(frozen=True)
class AdamParams:
    """AdamW settings sent with each `optim_step` (defaults as the tinker SDK)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 turns clipping off

    def __post_init__(self) -> None:
        _check_finite_number("AdamParams.learning_rate", self.learning_rate, low=0.0)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"AdamParams.{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"AdamParams.eps must be > 0, got {self.eps}")
        _check_finite_number("AdamParams.weight_decay", self.weight_decay, low=0.0)
        _check_finite_number("AdamParams.grad_clip_norm", self.grad_clip_norm, low=0.0)


StopReason: TypeAlias = Literal["stop", "length"]


@dataclass(frozen=True)
class SampledSequence:
    """One completion: token ids, the sampling distribution's logprob of each, why it stopped."""

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per-datum outputs (`logprobs`, ...) and metrics keyed `name:reduction` (`loss:sum`)."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class TokenSegment:
    """A run of tokens in a trajectory. Sampled runs are trainable and carry sampler logprobs."""

    tokens: tuple[int, ...]
    trainable: bool = False
    logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
            if len(self.logprobs) != len(self.tokens):
                raise ValueError(
                    f"TokenSegment.logprobs has {len(self.logprobs)} values for "
                    f"{len(self.tokens)} tokens; give one logprob per token"
                )


@dataclass(frozen=True)
class Trajectory:
    """One episode: token segments in order, a scalar reward, metrics, metadata, and the chat
    messages for display (never used to rebuild tokens)."""

    segments: tuple[TokenSegment, ...]
    reward: float
    metrics: Mapping[str, float] = field(default_factory=lambda: dict[str, float]())
    metadata: Mapping[str, JSONScalar] = field(default_factory=lambda: dict[str, JSONScalar]())
    messages: tuple[Mapping[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "messages", tuple(self.messages))
        if not self.segments:
            raise ValueError("Trajectory.segments is empty: a trajectory needs tokens")
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory.reward must be a finite number, got {self.reward!r}")

    @property
    def tokens(self) -> list[int]:
        return [t for seg in self.segments for t in seg.tokens]

    @property
    def num_trainable_tokens(self) -> int:
        return sum(len(seg.tokens) for seg in self.segments if seg.trainable)


@dataclass(frozen=True)
class TrajectoryGroup:
    """Trajectories sampled for the same prompt; advantages are computed within a group."""

    trajectories: tuple[Trajectory, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectories", tuple(self.trajectories))
        if not self.trajectories:
            raise ValueError("TrajectoryGroup.trajectories is empty: a group needs trajectories")

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class TrainResult:
    """What `backend.train` and `backend.train_sft` return."""

    step: int
    metrics: Mapping[str, float]
    checkpoint_path: str | None = None
