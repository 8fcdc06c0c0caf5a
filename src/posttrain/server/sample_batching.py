"""Concurrent sample requests, gathered into batches: the Tinker endpoints' across the
samplers of the server's base model (`SampleGatherer`), the OpenAI endpoints' per model
(`SampleBatcher`).

Requests sampled one by one cost a whole decode each (64 requests of 16 tokens: 64 decodes of
16 steps); batched, one decode of 16 batched steps, which on a small model costs little more
than one request alone (`benchmarks/multi_lora.py`). So a request joins a waiting list, and
while a batch runs the requests that arrive wait for the next one. Each round (`Gathering`):

- lets arrivals join for a few milliseconds;
- takes waiting requests round-robin across tenants (a Tinker request's session, else its
  owner), one request per tenant per turn, until the batch holds `max_rows` rows: a tenant
  that floods the server gets one request per turn like everyone else, not every batch;
- groups them by num_samples and the sampling settings a batch shares, and runs each group
  as one call.

What a request gets is what it gets alone, but for the batch it ran in:
- Tinker requests share all settings but seed and max_tokens, and decode together across
  samplers with a per-row adapter (`clients.shared_decode`: greedy tokens equal, logprobs to
  float32 rounding, seeded draws equal); a sampler that cannot share a batch (other target
  modules than the host's, another worker layout) samples alone, in the same job; a request
  for prompt logprobs samples alone; a request whose sampler finds no room (`posttrain serve
  --max-resident-adapters`, every resident adapter busy) waits, off the compute thread, until
  an adapter may leave, and joins the next batch then (`Residency.room`);
- an OpenAI request is batched with those of its model with the same settings, in one
  `sample_many` call; a seeded one runs alone (its seed draws from (seed, prompt index, sample
  index), and a batch would move its prompt index);
- a batch that fails with a ValueError (a prompt the sampler refuses: too long, a token id out
  of range) is retried request by request, so only the bad request fails, with its own error.

`SampleGatherer.stats` counts the batches (GET /api/v1/sample_batching): how many jobs ran, how
many requests and samplers the largest held. State lives on the server's event loop: `add`,
the drain and the waits for room run there.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from posttrain.clients import shared_decode
from posttrain.clients.local import LocalTrainingClient
from posttrain.inference.model_sampler import ModelSampler
from posttrain.server.lanes import Job, Outcome
from posttrain.server.proto import encode_sample_response, sample_response_to_json
from posttrain.server.residency import NoRoomError
from posttrain.server.store import SamplerRow
from posttrain.types import ModelInput, SampleResponse, SamplingParams

log = logging.getLogger(__name__)

# See Gathering._let_arrivals_join: a lone request waits ARRIVAL_GAP_S more, a burst of
# requests up to ARRIVAL_WAIT_S for its last member, against a decode of tens of milliseconds.
ARRIVAL_GAP_S = 0.002
ARRIVAL_WAIT_S = 0.02
# Rows (prompts x num_samples) per Tinker batch: enough to batch a few tenants' rollouts, few
# enough that one batch's decode stays short for the requests waiting behind it.
MAX_ROWS = 128

R = TypeVar("R")


class Gathering(Generic[R]):
    """Waiting requests, per tenant in arrival order, drained in rounds (`_round`) while any
    wait; see the module docstring. `rows(request)`: the rows it adds to a batch."""

    def __init__(self, rows: Callable[[R], int], max_rows: int | None) -> None:
        self.rows = rows
        self.max_rows = max_rows
        self._waiting: OrderedDict[Hashable, deque[R]] = OrderedDict()
        self._draining = False

    def gather(self, tenant: Hashable, request: R) -> None:
        self._waiting.setdefault(tenant, deque()).append(request)
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())

    async def _round(self, batch: list[R]) -> None:
        raise NotImplementedError

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await self._let_arrivals_join()
                await self._round(self.take())
        finally:
            self._draining = False

    def _count(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def _let_arrivals_join(self) -> None:
        """Wait while requests keep arriving (each within ARRIVAL_GAP_S of the last, for at
        most ARRIVAL_WAIT_S in all): concurrent clients' requests arrive over a few
        milliseconds, and sampling the first alone would cost a whole decode of its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ARRIVAL_WAIT_S
        seen = 0
        while self._count() > seen and loop.time() < deadline:
            seen = self._count()
            await asyncio.sleep(ARRIVAL_GAP_S)

    def take(self) -> list[R]:
        """The next batch: one request per tenant per turn, tenants in turn order, until
        `max_rows` rows (a first request larger than that goes alone). A tenant whose request
        was taken moves to the back, so the next batch starts with the others."""
        batch: list[R] = []
        rows = 0
        limit = self.max_rows
        while self._waiting:
            progressed = False
            for tenant in list(self._waiting):
                queue = self._waiting[tenant]
                size = self.rows(queue[0])
                if batch and limit is not None and rows + size > limit:
                    continue
                batch.append(queue.popleft())
                rows += size
                progressed = True
                self._waiting.move_to_end(tenant)
                if not queue:
                    del self._waiting[tenant]
            if not progressed or (limit is not None and rows >= limit):
                break
        return batch


# Tinker's asample requests, across samplers
@dataclass
class PendingSample:
    """One accepted asample request, waiting for its batch."""

    request_id: str
    tenant: str
    row: SamplerRow
    prompt: ModelInput
    num_samples: int
    params: SamplingParams
    # Wraps a job so that its failure names what the client named (`in_client_terms`).
    wrap: Callable[[Job], Job] = field(default=lambda job: job)
    prompt_logprobs: bool = False  # also the prompt's logprobs (it then samples alone)
    refused_at: float | None = None  # loop time its sampler first found no room


@dataclass
class BatchStats:
    jobs: int = 0  # compute jobs run
    requests: int = 0  # requests they sampled
    multi_sampler_jobs: int = 0  # jobs whose requests used more than one sampler
    largest_requests: int = 0
    largest_samplers: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(vars(self))


class SampleGatherer(Gathering[PendingSample]):
    """The waiting Tinker sample requests of all tenants; see the module docstring.

    `record(request_id, job)` records a request's outcome (`Runtime.run`); `sampler_of(row)`
    gives a row's sampling client; `submit(fn)` runs `fn` on the compute thread; `room(error,
    since)` waits for room after a NoRoomError (`Residency.room`).
    """

    def __init__(
        self,
        record: Callable[[str, Job], None],
        sampler_of: Callable[[SamplerRow], LocalTrainingClient],
        submit: Callable[[Callable[[], None], str], asyncio.Future[None]],
        room: Callable[[NoRoomError, float], Awaitable[None]],
        max_rows: int = MAX_ROWS,
    ) -> None:
        super().__init__(lambda pending: pending.num_samples, max_rows)
        self.record = record
        self.sampler_of = sampler_of
        self.submit = submit
        self.room = room
        self.stats = BatchStats()
        self._refused: list[tuple[PendingSample, NoRoomError]] = []  # by the last group
        self._waits: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references

    def add(self, pending: PendingSample) -> None:
        self.gather(pending.tenant, pending)

    async def _round(self, batch: list[PendingSample]) -> None:
        groups: dict[tuple[int, SamplingParams, bool], list[PendingSample]] = {}
        for pending in batch:
            key = (pending.num_samples, _shared(pending.params), pending.prompt_logprobs)
            groups.setdefault(key, []).append(pending)
        for group in groups.values():
            try:
                # In the turn of its first request's tenant: the round-robin filling rotates
                # who that is, so sampling takes each tenant's turn in order.
                await self.submit(lambda group=group: self.run_group(group), group[0].tenant)
            except Exception:  # run_group records every outcome; this is a bug
                log.exception("a sample batch failed outside its requests")
            refused, self._refused = self._refused, []
            for pending, error in refused:
                wait = asyncio.get_running_loop().create_task(self._wait(pending, error))
                self._waits.add(wait)
                wait.add_done_callback(self._waits.discard)

    async def _wait(self, pending: PendingSample, refused: NoRoomError) -> None:
        """A request whose sampler found no room: back in line once an adapter may leave, or
        failed once the wait for one is over."""
        if pending.refused_at is None:
            pending.refused_at = asyncio.get_running_loop().time()
        try:
            await self.room(refused, pending.refused_at)
        except NoRoomError as exc:
            self.record(pending.request_id, pending.wrap(_raise(exc)))
            return
        self.add(pending)

    # on the compute thread
    def run_group(self, group: Sequence[PendingSample]) -> None:
        """Sample `group` (one num_samples, one shared setting) and record every outcome."""
        ready: list[tuple[PendingSample, LocalTrainingClient]] = []
        for pending in group:
            try:
                ready.append((pending, self.sampler_of(pending.row)))
            except NoRoomError as exc:  # waits on the loop for room (`_wait`), then retries
                self._refused.append((pending, exc))
            except Exception as exc:
                self.record(pending.request_id, pending.wrap(_raise(exc)))
        if group[0].prompt_logprobs:  # all of the group or none (`_round` groups by it)
            for pending, client in ready:
                self._alone(pending, client)
            return
        try:
            decode, _ = shared_decode.plan([client for _, client in ready])
        except Exception:  # planning must not leave requests without an outcome
            log.exception("planning a sample batch failed; its requests sample alone")
            decode = None
        together = [(p, c) for p, c in ready if decode is not None and decode.serves(c)]
        for pending, client in ready:
            if decode is None or not decode.serves(client):
                self._alone(pending, client)
        if decode is not None and together:
            self._batched(decode, together)

    def _batched(
        self,
        decode: shared_decode.SharedDecode,
        entries: list[tuple[PendingSample, LocalTrainingClient]],
    ) -> None:
        requests = [(c, p.prompt.to_ints(), p.params) for p, c in entries]
        try:
            responses = decode.sample(requests, entries[0][0].num_samples)
        except ValueError:  # retried one by one: only the bad request fails, with its error
            for pending, client in entries:
                self._alone(pending, client)
            return
        except Exception as exc:
            for pending, _ in entries:
                self.record(pending.request_id, pending.wrap(_raise(exc)))
            return
        samplers = len({id(client) for _, client in entries})
        self._count_job(len(entries), samplers)
        for (pending, _), response in zip(entries, responses, strict=True):
            self.record(pending.request_id, pending.wrap(lambda r=response: _outcome(r)))

    def _alone(self, pending: PendingSample, client: LocalTrainingClient) -> None:
        def job() -> Outcome:
            response = client.sample(pending.prompt, pending.num_samples, pending.params).result()
            if pending.prompt_logprobs:
                logprobs = client.compute_logprobs(pending.prompt).result()
                response = SampleResponse(response.sequences, logprobs)
            return _outcome(response)

        self._count_job(1, 1)
        self.record(pending.request_id, pending.wrap(job))

    def _count_job(self, requests: int, samplers: int) -> None:
        stats = self.stats
        stats.jobs += 1
        stats.requests += requests
        stats.multi_sampler_jobs += samplers > 1
        stats.largest_requests = max(stats.largest_requests, requests)
        stats.largest_samplers = max(stats.largest_samplers, samplers)
        if samplers > 1:
            log.debug("sampled %d requests of %d samplers in one batch", requests, samplers)


def _shared(params: SamplingParams) -> SamplingParams:
    """What one batch's requests must share: all but seed and max_tokens."""
    return replace(params, seed=None, max_tokens=None)


def _outcome(response: SampleResponse) -> Outcome:
    return Outcome(sample_response_to_json(response), encode_sample_response(response))


def _raise(exc: Exception) -> Job:
    def job() -> Outcome:
        raise exc

    return job


# The OpenAI endpoints' requests, per model
@dataclass
class _Request:
    sampler: ModelSampler
    prompt: list[int]
    n: int
    params: SamplingParams
    future: asyncio.Future[SampleResponse]


class SampleBatcher(Gathering[_Request]):
    """The waiting OpenAI requests of one model; `sample` returns once its batch is sampled.
    Each round takes every waiting request and samples each group with one `sample_many` call
    (the calls of a round are queued together on the model's compute thread, which runs them
    in order)."""

    def __init__(self) -> None:
        super().__init__(lambda request: request.n, max_rows=None)

    async def sample(
        self, sampler: ModelSampler, prompt: list[int], n: int, params: SamplingParams
    ) -> SampleResponse:
        if params.seed is not None:
            return await sampler.sample(prompt, n, params)
        future: asyncio.Future[SampleResponse] = asyncio.get_running_loop().create_future()
        self.gather(None, _Request(sampler, prompt, n, params, future))
        return await future

    async def _round(self, batch: list[_Request]) -> None:
        groups: dict[tuple[int, SamplingParams], list[_Request]] = {}
        for request in batch:
            groups.setdefault((request.n, request.params), []).append(request)
        await asyncio.gather(*(self._run(group) for group in groups.values()))

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
