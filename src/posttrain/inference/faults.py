"""`FaultyEngine`: a sampling engine that claims the versions it is given but serves other
weights, as the engines of peers' bug reports do (the base model, a stale adapter, a dropped
sync). For testing and measuring the parity check (`trainer.parity`); never used in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from posttrain.inference.protocol import SamplingEngine
from posttrain.types import SampleResponse, SamplingParams

Fault = Literal["base", "previous", "drop", "none"]


class FaultyEngine:
    """Wraps `inner` and claims every version it is given while it serves what `fault` says:
    "base" never applies an update, "previous" applies each snapshot one update late, "drop"
    skips the update to version `dropped` only, "none" is correct. Generic over the snapshot:
    it only holds on to what `update_weights` was given and passes it on later."""

    def __init__(self, inner: SamplingEngine, fault: Fault, dropped: int = 2) -> None:
        self.inner = inner
        self.fault: Fault = fault
        self.dropped = dropped
        self.name = inner.name
        self.capabilities = inner.capabilities
        self._claimed = inner.version
        self._previous: tuple[object, int] | None = None

    @property
    def version(self) -> int:
        return self._claimed

    async def sample_many(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        responses = await self.inner.sample_many(prompts, num_samples, params)
        return [replace(r, policy_version=self._claimed) for r in responses]

    async def update_weights(self, snapshot: object, version: int) -> None:
        self._claimed = version
        if self.fault == "none" or (self.fault == "drop" and version != self.dropped):
            await self.inner.update_weights(snapshot, version)  # pyright: ignore[reportArgumentType]
        elif self.fault == "previous":
            if self._previous is not None:
                await self.inner.update_weights(*self._previous)  # pyright: ignore[reportArgumentType]
            self._previous = (snapshot, version)

    async def close(self) -> None:
        await self.inner.close()
