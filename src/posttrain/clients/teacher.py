"""`Teacher`: a model that scores the student's sampled tokens, for on-policy distillation.

It wraps any sampling client that computes prompt logprobs (`compute_logprobs`): a
`LocalSamplingClient` of another model or checkpoint, `backend.sampling_client(model)` of a
model registered anywhere, or (through `Teacher.from_tinker`) the tinker SDK's SamplingClient
on the Tinker service or a `posttrain serve`. It scores a trajectory's exact tokens, prompt and
completion, in one call; the trainer sends every trajectory's call at once.

Distillation compares the two models' logprobs token by token, so both must read the same token
ids as the same text: `check_vocabulary` refuses a teacher whose vocabulary differs from the
student's, naming both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from posttrain.tokenizer import Tokenizer, as_tokenizer
from posttrain.types import ModelInput

__all__ = ["LogprobScorer", "Teacher", "VocabularyMismatch", "vocabulary_difference"]

# Probe text encoded by both tokenizers when either has no `get_vocab()` to compare.
_PROBE_TEXT = "The quick brown fox: 12 + 30 = 42. reverse abc -> cba\n<|im_start|>é中"


@runtime_checkable
class LogprobScorer(Protocol):
    """A client that gives log p(token_t | tokens_<t) of each token of a prompt (None for the
    first): posttrain's sampling and training clients, and `ModelSampler`."""

    def compute_logprobs(self, prompt: ModelInput) -> Awaitable[list[float | None]]: ...


class _TinkerScorer:
    """The tinker SDK's SamplingClient as a LogprobScorer (its ModelInput is the SDK's own).

    `create_sampling_client` returns a future of the client, which the SDK lets stand in for
    the client with a deprecation warning on every call: it is resolved here instead, once,
    on first use (awaited when scoring, so the event loop is never blocked there)."""

    def __init__(self, sampling_client: object) -> None:
        if not callable(getattr(type(sampling_client), "compute_logprobs_async", None)):
            raise TypeError(
                f"Teacher.from_tinker needs a tinker SamplingClient (with "
                f"compute_logprobs_async), got a {type(sampling_client).__name__}"
            )
        # A future of the client has result_async(); the client itself has none.
        self.pending: Any = sampling_client
        self.resolved: Any = None if _is_future(sampling_client) else sampling_client

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        from posttrain.clients.tinker import import_tinker

        tinker = import_tinker()
        if self.resolved is None:
            self.resolved = await self.pending.result_async()
        # compute_logprobs returns an APIFuture, awaitable (compute_logprobs_async is deprecated).
        scored = self.resolved.compute_logprobs(tinker.ModelInput.from_ints(prompt.to_ints()))
        return list(await scored)

    def get_tokenizer(self) -> Tokenizer:
        """The client's tokenizer (a pending client is waited for here, the one blocking call)."""
        if self.resolved is None:
            self.resolved = self.pending.future().result()
        return as_tokenizer(self.resolved.get_tokenizer())


def _is_future(value: object) -> bool:
    return callable(getattr(type(value), "result_async", None))


def _tokenizer_of(client: object) -> Tokenizer | None:
    """The client's tokenizer: `get_tokenizer()` (clients), else `.tokenizer` (ModelSampler)."""
    get = getattr(client, "get_tokenizer", None)
    if callable(get):
        return as_tokenizer(get())
    found = getattr(client, "tokenizer", None)
    return as_tokenizer(found) if found is not None else None


def _name_of(client: object) -> str:
    for attribute in ("model_path", "base_model"):
        value = getattr(client, attribute, None)
        if isinstance(value, str) and value:
            return value
    return f"a {type(client).__name__}"


def _vocab(tokenizer: Tokenizer) -> Mapping[str, int] | None:
    get = getattr(tokenizer, "get_vocab", None)
    found = get() if callable(get) else None
    return found if isinstance(found, Mapping) else None


def vocabulary_difference(teacher: Tokenizer, student: Tokenizer) -> str | None:
    """Why the two tokenizers do not map the same token ids to the same tokens, or None.

    Compares the full vocabularies (`get_vocab()`, added tokens included) where both have one,
    else the ids each gives a probe text.
    """
    if teacher is student:
        return None
    teacher_vocab, student_vocab = _vocab(teacher), _vocab(student)
    if teacher_vocab is not None and student_vocab is not None:
        if teacher_vocab == student_vocab:
            return None
        if len(teacher_vocab) != len(student_vocab):
            return f"the teacher's vocabulary has {len(teacher_vocab)} tokens, the student's {len(student_vocab)}"
        differs = sorted((i, t) for t, i in teacher_vocab.items() if student_vocab.get(t) != i)
        token_id, token = differs[0]
        return (
            f"{len(differs)} of their {len(teacher_vocab)} token ids differ (the teacher's id "
            f"{token_id} is {token!r})"
        )
    teacher_ids = teacher.encode(_PROBE_TEXT, add_special_tokens=False)
    student_ids = student.encode(_PROBE_TEXT, add_special_tokens=False)
    if teacher_ids != student_ids:
        return f"they encode the text {_PROBE_TEXT!r} to different token ids"
    return None


class VocabularyMismatch(ValueError):
    """A teacher whose vocabulary is not the student's: refused before any step."""


class Teacher:
    """The model whose logprobs of the student's tokens become its per-token advantages.

    `client` computes prompt logprobs (`LogprobScorer`); `tokenizer` is the teacher's, by
    default the client's own (`get_tokenizer()` or `.tokenizer`); `name` names the teacher in
    messages, by default the client's model path or base model.
    """

    def __init__(
        self,
        client: LogprobScorer,
        *,
        tokenizer: Tokenizer | None = None,
        name: str | None = None,
    ) -> None:
        if not callable(getattr(client, "compute_logprobs", None)):
            raise TypeError(
                f"a Teacher needs a client with compute_logprobs(ModelInput), got a "
                f"{type(client).__name__}; for a tinker SDK SamplingClient use Teacher.from_tinker"
            )
        self.client = client
        self.name = name or _name_of(client)
        self._tokenizer = tokenizer
        self._checked: list[Tokenizer] = []  # student tokenizers already compared

    @classmethod
    def from_tinker(
        cls, sampling_client: object, *, tokenizer: Tokenizer | None = None, name: str | None = None
    ) -> Teacher:
        """A teacher behind the tinker SDK's SamplingClient (the Tinker service or a `posttrain
        serve`). Give `tokenizer` when the SDK cannot load it (a model not on the hub)."""
        scorer = _TinkerScorer(sampling_client)
        if name is None:  # a pending client's attributes are not read: the SDK would warn
            name = (
                "a tinker SamplingClient" if scorer.resolved is None else _name_of(scorer.resolved)
            )
        # Without `tokenizer`, the scorer's get_tokenizer() gives it on first use.
        return cls(scorer, tokenizer=tokenizer, name=name)

    def __repr__(self) -> str:
        return f"Teacher({self.name!r})"

    def tokenizer(self) -> Tokenizer:
        """The teacher's tokenizer (loaded from the client on first use)."""
        if self._tokenizer is None:
            found = _tokenizer_of(self.client)
            if found is None:
                raise ValueError(
                    f"teacher {self.name!r}: its client has no tokenizer (no get_tokenizer() "
                    "or .tokenizer); pass Teacher(..., tokenizer=...)"
                )
            self._tokenizer = found
        return self._tokenizer

    def check_vocabulary(self, student: Tokenizer, student_name: str) -> None:
        """Raise VocabularyMismatch unless the student's tokenizer has the teacher's vocabulary."""
        if any(student is seen for seen in self._checked):
            return
        why = vocabulary_difference(self.tokenizer(), student)
        if why is not None:
            raise VocabularyMismatch(
                f"teacher {self.name!r} and student {student_name} do not share a vocabulary: "
                f"{why}. Distillation scores the student's token ids with the teacher, so both "
                "need the same tokenizer; pick a teacher from the student's model family"
            )
        self._checked.append(student)

    async def logprobs(self, tokens: Sequence[int]) -> list[float | None]:
        """log π_T(token_t | tokens_<t) of each token (None for the first), in one call."""
        scored = list(await self.client.compute_logprobs(ModelInput.from_ints(list(tokens))))
        if len(scored) != len(tokens):
            raise ValueError(
                f"teacher {self.name!r} returned {len(scored)} logprobs for {len(tokens)} tokens; "
                "its client's compute_logprobs must give one per prompt token"
            )
        return scored
