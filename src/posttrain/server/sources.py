"""What the OpenAI-compatible endpoints need from whoever hosts the models.

The Tinker server (its registry of base model and sampler checkpoints) and LocalBackend (the
latest weights of its registered models) both implement `SamplerSource`, so one router serves
both.
"""

from __future__ import annotations

from typing import Protocol

from posttrain.inference.model_sampler import ModelSampler


class UnknownModelError(LookupError):
    """The requested model name is not served (to this caller)."""


class SourceBusyError(Exception):
    """The model cannot be loaded now (posttrain serve's --max-resident-adapters are busy)."""


class SamplerSource(Protocol):
    def model_names(self, owner: str | None) -> list[str]:
        """Names the caller may sample from: the base model first, then checkpoints."""
        ...

    def sampler(self, name: str, owner: str | None) -> ModelSampler:
        """A sampling client (with `.tokenizer`) for `name`; UnknownModelError if not served,
        SourceBusyError if it cannot be loaded now.

        `owner` is the caller's API key identity (None when the server runs without keys);
        a name owned by another key must raise UnknownModelError, exactly as an absent one.
        """
        ...
