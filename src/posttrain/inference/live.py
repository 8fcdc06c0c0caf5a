"""The default engine: posttrain's sampler on the training client's own weights.

Nothing is synced: the workers that train are the ones that sample, so a sample always uses
the weights of the latest optimizer step. The client runs calls in order, so sampling waits
for a training call in progress (and the other way round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from posttrain.clients.protocol import BatchSampler, TrainingClient
from posttrain.inference.engines import LIVE
from posttrain.inference.protocol import WeightSnapshot
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class LiveEngine:
    name = "pytorch"
    capabilities = LIVE

    def __init__(self, client: TrainingClient, *, version: int = 0) -> None:
        self.client = client
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    async def sample_many(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        version = self._version
        inputs = [ModelInput.from_ints(list(p)) for p in prompts]
        if isinstance(self.client, BatchSampler):
            responses = await self.client.sample_many(inputs, num_samples, params)
        else:
            responses = [await self.client.sample(p, num_samples, params) for p in inputs]
        return [_versioned(r, version) for r in responses]

    async def update_weights(self, snapshot: WeightSnapshot | None, version: int) -> None:
        self._version = version  # the client's weights are the new ones already

    async def close(self) -> None:
        return None


def _versioned(response: SampleResponse, version: int) -> SampleResponse:
    return replace(response, policy_version=version)
