"""The parts of a trajectory every data module shares, importing nothing from posttrain: token
segments, chat messages, OpenAI choices as the `openai` SDK gives them, and JSON scalars.
`trajectories` and `openai_choices` both build on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

if TYPE_CHECKING:  # the openai SDK is optional: its types name what the messages are
    from openai.types.chat import ChatCompletionMessageParam

JSONScalar: TypeAlias = str | int | float | bool | None


class ChoiceLike(Protocol):
    """An OpenAI choice (chat or text completion) as the `openai` SDK gives it; posttrain's and
    vLLM's servers add `token_ids` and `prompt_token_ids` to it."""

    @property
    def index(self) -> int: ...


# A chat message (a dict with a "role") or a choice; a choice may also be a plain dict (JSON).
MessageOrChoice: TypeAlias = Mapping[str, object] | ChoiceLike


@dataclass(frozen=True)
class TokenSegment:
    """A run of tokens in a trajectory. Sampled runs are trainable and carry sampler logprobs,
    and, when sampled with entropies, each token's sampling-distribution entropy (nats; see
    `SampledSequence.entropies`), which `uncertainty_kind='shannon_entropy'` reads."""

    tokens: tuple[int, ...]
    trainable: bool = False
    logprobs: tuple[float, ...] | None = None
    entropies: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        for name, one in (("logprobs", "logprob"), ("entropies", "entropy")):
            given: Sequence[float] | None = getattr(self, name)
            if given is None:
                continue
            values = tuple(float(x) for x in given)
            object.__setattr__(self, name, values)
            if len(values) != len(self.tokens):
                raise ValueError(
                    f"TokenSegment.{name} has {len(values)} values for "
                    f"{len(self.tokens)} tokens; give one {one} per token"
                )


class Messages(tuple[Mapping[str, object], ...]):
    """A trajectory's chat messages: a tuple, and callable as ART's `trajectory.messages()`,
    which gives them as a list of dicts (to send as the next request's `messages`)."""

    def __call__(self) -> list[ChatCompletionMessageParam]:
        return [cast("ChatCompletionMessageParam", dict(m)) for m in self]
