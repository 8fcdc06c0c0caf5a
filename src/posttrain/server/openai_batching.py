"""Concurrent OpenAI requests for one model, sampled together in batched calls.

An OpenAI-client rollout loop sends its requests at once (one per rollout, `asyncio.gather`).
Sampled one by one, 64 requests of 16 tokens cost 64 generate calls of 16 decoding steps each;
sampled together, one call of 16 batched steps, which on a small model costs little more than
one request alone. So requests are not sent to the sampler one by one: a request joins the
model's waiting list, and while a batch is being sampled, the requests that arrive wait for
the next one. Each round takes every waiting request, groups those with the same `n` and
sampling settings, and samples each group with one `sample_many` call (the calls of a round
are queued together on the compute thread, which runs them in order).

What a request gets is what it would get alone, but for the batch it ran in:
- a seeded request runs alone (its seed draws from (seed, prompt index, sample index), and a
  batch would move its prompt index);
- a batch that fails with a ValueError (a prompt the sampler refuses: too long, a token id out
  of range) is retried request by request, so only the bad request fails, with its own error.

State lives on the server's event loop: every method here runs there.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.inference.model_sampler import ModelSampler
from posttrain.types import SampleResponse, SamplingParams

# See SampleBatcher._let_arrivals_join: a lone request waits ARRIVAL_GAP_S more, a burst of
# requests up to ARRIVAL_WAIT_S for its last member, against a decode of tens of milliseconds.
ARRIVAL_GAP_S = 0.002
ARRIVAL_WAIT_S = 0.02


@dataclass
class _Request:
    sampler: ModelSampler
    prompt: list[int]
    n: int
    params: SamplingParams
    future: asyncio.Future[SampleResponse]


class SampleBatcher:
    """The waiting requests of one model; `sample` returns once its batch is sampled."""

    def __init__(self) -> None:
        self._waiting: list[_Request] = []
        self._draining = False

    async def sample(
        self, sampler: ModelSampler, prompt: list[int], n: int, params: SamplingParams
    ) -> SampleResponse:
        if params.seed is not None:
            return await sampler.sample(prompt, n, params)
        future: asyncio.Future[SampleResponse] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Request(sampler, prompt, n, params, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await self._let_arrivals_join()
                batch, self._waiting = self._waiting, []
                groups: dict[tuple[int, SamplingParams], list[_Request]] = {}
                for request in batch:
                    groups.setdefault((request.n, request.params), []).append(request)
                await asyncio.gather(*(self._run(group) for group in groups.values()))
        finally:
            self._draining = False

    async def _let_arrivals_join(self) -> None:
        """Wait while requests keep arriving (each within ARRIVAL_GAP_S of the last, for at
        most ARRIVAL_WAIT_S in all): the requests of one rollout loop arrive over a few
        milliseconds, and sampling the first alone would cost a whole decode of its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ARRIVAL_WAIT_S
        seen = 0
        while len(self._waiting) > seen and loop.time() < deadline:
            seen = len(self._waiting)
            await asyncio.sleep(ARRIVAL_GAP_S)

    async def _run(self, group: Sequence[_Request]) -> None:
        first = group[0]
        try:
            responses = await first.sampler.sample_many(
                [r.prompt for r in group], first.n, first.params
            )
        except ValueError as exc:
            if len(group) > 1:
                await asyncio.gather(*(self._run([r]) for r in group))
            else:
                _fail(group, exc)
            return
        except BaseException as exc:
            _fail(group, exc)
            raise
        for request, response in zip(group, responses, strict=True):
            if not request.future.done():  # done: its handler went away (a disconnect)
                request.future.set_result(response)


def _fail(group: Sequence[_Request], error: BaseException) -> None:
    for request in group:
        if not request.future.done():
            request.future.set_exception(error)


class Batchers:
    """One SampleBatcher per model (per training client), kept while the client lives."""

    def __init__(self) -> None:
        self._by_client: weakref.WeakKeyDictionary[object, SampleBatcher] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, sampler: ModelSampler) -> SampleBatcher:
        batcher = self._by_client.get(sampler.client)
        if batcher is None:
            batcher = self._by_client[sampler.client] = SampleBatcher()
        return batcher
