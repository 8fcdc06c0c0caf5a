"""Plain data shared by every layer: model inputs, datums, sampling and optimizer settings,
and results. Trajectories live beside them, in `posttrain.data.trajectories`.

The first five mirror the `tinker` SDK's names and constructors (`ModelInput.from_ints`,
`Datum(model_input=..., loss_fn_inputs=...)`, `SamplingParams`, `AdamParams`), so code moves
between Tinker and posttrain by changing imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import torch

from posttrain.data.checks import is_instance, is_integer, is_name, is_number

__all__ = [
    "INT_KEYS",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "StopReason",
    "TensorLike",
    "TrainResult",
    "to_tensor",
]

TensorLike: TypeAlias = torch.Tensor | np.ndarray | Sequence[float] | Sequence[int]

# Keys whose values are token ids; every other loss_fn_input is float32 (as in the tinker SDK).
INT_KEYS = frozenset({"target_tokens"})


def _is_number(value: object) -> bool:
    # bool is an int subclass but never a setting's number; numpy scalars are accepted.
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _check_range(name: str, value: float, expected: str, ok: Callable[[float], bool]) -> None:
    """ValueError naming `name` unless `value` is a real number that passes `ok`.

    Range tests are written as `low <= v < math.inf`, so NaN (which fails every comparison) and
    infinity are refused with the same message as any value out of range.
    """
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_integer(name: str, value: int | None, expected: str, ok: Callable[[int], bool]) -> None:
    """ValueError naming `name` unless `value` (if not None) is an integer that passes `ok`."""
    if value is None:
        return
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _token_ids(name: str, tokens: Sequence[int]) -> tuple[int, ...]:
    """`tokens` as a tuple of Python ints; ValueError naming `name` for a non-integer or < 0."""
    ids: list[int] = []
    for i, token in enumerate(tokens):
        # bool is an int subclass but never a token id; numpy integers are accepted. Typed int,
        # but tokens also arrive from untyped JSON and numpy.
        if not is_integer(token):
            raise ValueError(f"{name}[{i}] is {token!r}; token ids must be integers >= 0")
        if token < 0:
            raise ValueError(f"{name}[{i}] is {token}; token ids must be integers >= 0")
        ids.append(int(token))
    return tuple(ids)


@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids (integers >= 0)."""

    tokens: tuple[int, ...]
    type: Literal["encoded_text"] = "encoded_text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _token_ids("EncodedTextChunk.tokens", self.tokens))
        if self.type != "encoded_text":
            raise ValueError(f"EncodedTextChunk.type must be 'encoded_text', got {self.type!r}")

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
            if not is_instance(chunk, EncodedTextChunk):
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

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=(*self.chunks, chunk))

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=(token,)))


def to_tensor(key: str, value: TensorLike) -> torch.Tensor:
    """Coerce a loss_fn_input to a CPU tensor: int64 for token ids, float32 for everything else.

    ValueError naming `key` if the value is not numeric, or if token ids are not integers.
    """
    try:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
        elif isinstance(value, np.ndarray):
            tensor = torch.as_tensor(value.tolist())
        else:
            tensor = torch.tensor(list(value))
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"Datum.loss_fn_inputs[{key!r}] must be numeric (a list, numpy array or tensor), "
            f"got {type(value).__name__}: {err}"
        ) from err
    if tensor.is_complex() or not (tensor.is_floating_point() or _is_integer_dtype(tensor)):
        raise ValueError(
            f"Datum.loss_fn_inputs[{key!r}] must hold real numbers, got dtype {tensor.dtype}"
        )
    if key in INT_KEYS:
        # A float token id is either an integer value or a bug: never truncate it silently.
        if tensor.is_floating_point() and not bool((tensor == tensor.round()).all()):
            raise ValueError(
                f"Datum.loss_fn_inputs[{key!r}] holds non-integer values; token ids are integers"
            )
        return tensor.to(torch.int64)
    return tensor.to(torch.float32)


def _is_integer_dtype(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


@dataclass(frozen=True, init=False)
class Datum:
    """One training example: `model_input` plus per-token `loss_fn_inputs`.

    Position i of `model_input` predicts `target_tokens[i]`; every per-token input has the same
    leading length as `model_input`. Lists, numpy arrays and tensors are accepted and stored as
    CPU tensors (int64 for `target_tokens`, float32 otherwise). Built as Tinker's
    `Datum(model_input=..., loss_fn_inputs=...)`; the constructor only converts the inputs to
    tensors, and `__post_init__` validates them (as the dataclasses of this module do).
    """

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, torch.Tensor]  # set by __init__ (None gives {})

    def __init__(
        self, model_input: ModelInput, loss_fn_inputs: Mapping[str, TensorLike] | None = None
    ) -> None:
        # A custom __init__ so that callers may pass lists and arrays while the field is typed
        # as tensors; the checks live in __post_init__, called last.
        if not is_instance(loss_fn_inputs, Mapping | None):
            raise ValueError(
                f"Datum.loss_fn_inputs must be a mapping of key -> per-token values, got "
                f"{type(loss_fn_inputs).__name__}"
            )
        values = dict(loss_fn_inputs or {})
        for key in values:
            if not is_name(key):
                raise ValueError(
                    f"Datum.loss_fn_inputs keys must be non-empty strings, got {key!r}"
                )
        tensors = {key: to_tensor(key, value) for key, value in values.items()}
        object.__setattr__(self, "model_input", model_input)
        object.__setattr__(self, "loss_fn_inputs", tensors)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not is_instance(self.model_input, ModelInput):
            raise ValueError(
                f"Datum.model_input must be a posttrain.types.ModelInput (e.g. "
                f"ModelInput.from_ints(tokens)), got {type(self.model_input).__name__}"
            )
        length = self.model_input.length
        if length == 0:
            raise ValueError("Datum.model_input is empty: a datum needs at least one token")
        for key, tensor in self.loss_fn_inputs.items():
            if tensor.dim() == 0 or tensor.shape[0] != length:
                raise ValueError(
                    f"Datum.loss_fn_inputs[{key!r}] has shape {tuple(tensor.shape)}; "
                    f"its first dimension must equal model_input.length={length} "
                    f"(one value per input position)"
                )
            if key in INT_KEYS and bool((tensor < 0).any()):
                token = int(tensor[tensor < 0][0])
                raise ValueError(
                    f"Datum.loss_fn_inputs[{key!r}] holds token id {token}; token ids are >= 0"
                )

    @property
    def length(self) -> int:
        return self.model_input.length


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `stop=None` stops at EOS; `stop=[]` never stops early.

    The fields mirror the tinker SDK's SamplingParams, plus vLLM's and OpenAI's `min_p` (drop
    tokens below min_p times the likeliest one's probability), `repetition_penalty` (every
    token already in the prompt or the output: a positive logit divided by it, a negative one
    multiplied), `presence_penalty` and `frequency_penalty` (subtracted from the logit of each
    token in the output, once or once per occurrence), and `entropies` (posttrain's: return
    each sampled token's entropy, `SampledSequence.entropies`). Logprobs and entropies stay
    those of log_softmax(logits / temperature), before truncation and penalties, as a
    teacher-forced pass computes them. An engine that cannot honour a field refuses it by name
    (`inference/engines.py`).
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    entropies: bool = False

    def __post_init__(self) -> None:
        _check_integer("SamplingParams.max_tokens", self.max_tokens, ">= 1", lambda v: v >= 1)
        # Any integer seeds the sampler: it hashes the seed with each sequence's position.
        _check_integer("SamplingParams.seed", self.seed, "an integer", lambda v: True)
        _check_range(
            "SamplingParams.temperature",
            self.temperature,
            "a finite number >= 0",
            lambda v: 0.0 <= v < math.inf,
        )
        _check_range("SamplingParams.top_p", self.top_p, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _check_range("SamplingParams.min_p", self.min_p, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        _check_range(
            "SamplingParams.repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0 (1: off)",
            lambda v: 0.0 < v < math.inf,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(
                f"SamplingParams.{name}", getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2
            )
        if not is_instance(self.entropies, bool):
            raise ValueError(
                f"SamplingParams.entropies must be true or false, got {self.entropies!r}"
            )
        _check_integer(
            "SamplingParams.top_k", self.top_k, "-1 (off) or >= 1", lambda v: v == -1 or v >= 1
        )
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
        # Infinity means nothing for any of these: an infinite learning rate turns every weight
        # into NaN in one step, and "no clipping" is spelled grad_clip_norm=0.
        finite = "a finite number >= 0"
        _check_range("AdamParams.learning_rate", self.learning_rate, finite, _finite_nonnegative)
        _check_range("AdamParams.beta1", self.beta1, "in [0, 1)", lambda v: 0.0 <= v < 1.0)
        _check_range("AdamParams.beta2", self.beta2, "in [0, 1)", lambda v: 0.0 <= v < 1.0)
        _check_range("AdamParams.eps", self.eps, "a finite number > 0", lambda v: 0 < v < math.inf)
        _check_range("AdamParams.weight_decay", self.weight_decay, finite, _finite_nonnegative)
        _check_range(
            "AdamParams.grad_clip_norm",
            self.grad_clip_norm,
            f"{finite} (0: off)",
            _finite_nonnegative,
        )


def _finite_nonnegative(value: float) -> bool:
    return 0.0 <= value < math.inf


StopReason: TypeAlias = Literal["stop", "length"]


@dataclass(frozen=True)
class SampledSequence:
    """One completion: token ids, the sampling distribution's logprob of each, why it stopped.

    `entropies` (when sampled with `SamplingParams.entropies`): the Shannon entropy in nats of
    the distribution each token was drawn from, under the logprobs' convention: softmax(logits /
    temperature) over the full vocabulary, before top-k / top-p truncation (softmax(logits) for
    greedy, temperature 0).
    """

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    entropies: list[float] | None = None


@dataclass(frozen=True)
class SampleResponse:
    """A prompt's completions; `policy_version` is the model step whose weights sampled them
    (set by posttrain's sampling engines; None where unknown)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    policy_version: int | None = None


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
class TrainResult:
    """What `backend.train` and `backend.train_sft` return.

    `metrics` values are real numbers but may be NaN or infinite: a step whose gradient was not
    finite is skipped by the optimizer (the weights stay as they were) and reported, with its
    `loss` and `grad_norm` carrying the NaN/inf that says why; rejecting them here would turn
    that report into an exception after the step already ran.
    """

    step: int
    metrics: Mapping[str, float]
    checkpoint_path: str | None = None
    # The weights published for inference by the step (TinkerBackend's deploy_checkpoint):
    # their name where the backend names them, else None; and whether the step published.
    artifact_name: str | None = None
    deployed: bool = False
    # The sampling engine's weight sync after the step (`EngineSession.last_sync`: "sync_s",
    # and where the engine says, "sync_bytes", "sync_version"); empty where none is reported.
    sync: Mapping[str, float] = field(default_factory=dict[str, float])

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not is_instance(self.step, int):
            raise ValueError(f"TrainResult.step must be an int >= 0, got {self.step!r}")
        if not is_instance(self.deployed, bool):
            raise ValueError(f"TrainResult.deployed must be a bool, got {self.deployed!r}")
        if self.artifact_name is not None and not self.artifact_name:
            raise ValueError("TrainResult.artifact_name must be None or a non-empty name")
        if self.step < 0:
            raise ValueError(f"TrainResult.step must be an int >= 0, got {self.step}")
        metrics: dict[str, float] = {}
        for key, value in self.metrics.items():
            if not is_name(key):
                raise ValueError(f"TrainResult.metrics keys must be non-empty strings, got {key!r}")
            if not is_number(value):
                raise ValueError(
                    f"TrainResult.metrics[{key!r}] must be a number (NaN/inf allowed), got "
                    f"{value!r}"
                )
            metrics[key] = float(value)
        object.__setattr__(self, "metrics", metrics)
        if self.checkpoint_path is not None and not self.checkpoint_path:
            raise ValueError("TrainResult.checkpoint_path must be None or a non-empty path")
