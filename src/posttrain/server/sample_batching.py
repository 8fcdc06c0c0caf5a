"""Concurrent Tinker sample requests, across samplers of the server's base model, sampled in
one batched compute job with a per-row adapter (`engine.decode.multi_lora`).

Tenants sampling at once (their LoRA snapshots, named sampler weights, the base model) would
otherwise each take a whole decode on the compute thread, one after the other; batched, the
rows of all of them decode together, which on a small model costs little more than one
request alone (`benchmarks/multi_lora.py`). So a request joins a waiting list, and while a
batch runs the requests that arrive wait for the next one (as `openai_batching` does for one
model's OpenAI requests). Each round:

- lets arrivals join for a few milliseconds;
- takes waiting requests round-robin across tenants (a tenant is the request's session, else
  its owner), one request per tenant per turn, until the batch holds `max_rows` rows: a tenant
  that floods the server gets one request per turn like everyone else, not every batch;
- groups them by num_samples and the sampling settings a batch shares (all but seed and
  max_tokens, which stay per request), and runs each group as one compute job.

What a request gets is what it gets alone (greedy tokens equal, logprobs to float32
rounding, seeded draws equal: `Sampler.sample_batched`), but:
- a sampler that cannot share a batch (other target modules than the host's,
  another worker layout) samples alone, in the same job;
- a batch that fails with a ValueError is retried request by request, so only the bad request
  fails, with its own error;
- a request for prompt logprobs (`compute_logprobs`) samples alone;
- a request whose sampler finds no room (`posttrain serve --max-resident-adapters`, every
  resident adapter busy) waits, off the compute thread, until an adapter may leave, and joins
  the next batch then; it fails only after the residency's wait (`Residency.room`).

`stats` counts the batches (GET /api/v1/sample_batching): how many jobs ran, how many requests
and samplers the largest held.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.decode.multi_lora import MultiLora, lora_layers
from posttrain.engine.decode.sampler import SampleRequest
from posttrain.engine.worker import Worker
from posttrain.server.lanes import Job, Outcome
from posttrain.server.proto import encode_sample_response, sample_response_to_json
from posttrain.server.residency import NoRoomError
from posttrain.server.store import SamplerRow
from posttrain.types import ModelInput, SampleResponse, SamplingParams

log = logging.getLogger(__name__)

# See SampleGatherer._let_arrivals_join (the values of openai_batching).
ARRIVAL_GAP_S = 0.002
ARRIVAL_WAIT_S = 0.02
# Rows (prompts x num_samples) per batch: enough to batch a few tenants' rollouts, few enough
# that one batch's decode stays short for the requests waiting behind it.
MAX_ROWS = 128


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


class SampleGatherer:
    """The waiting sample requests of all tenants; see the module docstring.

    `record(request_id, job)` records a request's outcome (`Runtime.run`); `sampler_of(row)`
    gives a row's sampling client; `submit(fn)` runs `fn` on the compute thread; `room(error,
    since)` waits for room after a NoRoomError (`Residency.room`). State lives on the server's
    event loop: `add`, the drain and the waits for room run there.
    """

    def __init__(
        self,
        record: Callable[[str, Job], None],
        sampler_of: Callable[[SamplerRow], LocalTrainingClient],
        submit: Callable[[Callable[[], None], str], asyncio.Future[None]],
        room: Callable[[NoRoomError, float], Awaitable[None]],
        max_rows: int = MAX_ROWS,
    ) -> None:
        self.record = record
        self.sampler_of = sampler_of
        self.submit = submit
        self.room = room
        self.max_rows = max_rows
        self.stats = BatchStats()
        self._waiting: OrderedDict[str, deque[PendingSample]] = OrderedDict()
        self._draining = False
        self._refused: list[tuple[PendingSample, NoRoomError]] = []  # by the last group
        self._waits: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references

    def add(self, pending: PendingSample) -> None:
        self._waiting.setdefault(pending.tenant, deque()).append(pending)
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await self._let_arrivals_join()
                groups: dict[tuple[int, SamplingParams, bool], list[PendingSample]] = {}
                for pending in self.take():
                    key = (pending.num_samples, _shared(pending.params), pending.prompt_logprobs)
                    groups.setdefault(key, []).append(pending)
                for group in groups.values():
                    try:
                        # In the turn of its first request's tenant: the round-robin filling
                        # rotates who that is, so sampling takes each tenant's turn in order.
                        await self.submit(
                            lambda group=group: self.run_group(group), group[0].tenant
                        )
                    except Exception:  # run_group records every outcome; this is a bug
                        log.exception("a sample batch failed outside its requests")
                    refused, self._refused = self._refused, []
                    for pending, error in refused:
                        wait = asyncio.get_running_loop().create_task(self._wait(pending, error))
                        self._waits.add(wait)
                        wait.add_done_callback(self._waits.discard)
        finally:
            self._draining = False

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

    def take(self) -> list[PendingSample]:
        """The next batch: one request per tenant per turn, tenants in turn order, until
        `max_rows` rows (a first request larger than that goes alone). A tenant whose request
        was taken moves to the back, so the next batch starts with the others."""
        batch: list[PendingSample] = []
        rows = 0
        while self._waiting:
            progressed = False
            for tenant in list(self._waiting):
                queue = self._waiting[tenant]
                size = queue[0].num_samples
                if batch and rows + size > self.max_rows:
                    continue
                batch.append(queue.popleft())
                rows += size
                progressed = True
                self._waiting.move_to_end(tenant)
                if not queue:
                    del self._waiting[tenant]
            if not progressed or rows >= self.max_rows:
                break
        return batch

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
        if group[0].prompt_logprobs:  # all of the group or none (`_drain` groups by it)
            for pending, client in ready:
                self._alone(pending, client)
            return
        try:
            batched, alone = _plan(ready)
        except Exception:  # planning must not leave requests without an outcome
            log.exception("planning a sample batch failed; its requests sample alone")
            batched, alone = None, list(ready)
        for pending, client in alone:
            self._alone(pending, client)
        if batched is not None:
            self._batched(*batched)

    def _batched(
        self,
        host: Worker,
        entries: list[tuple[PendingSample, LocalTrainingClient, int]],
        adapters: MultiLora | None,
    ) -> None:
        requests = [SampleRequest([p.prompt.to_ints()], p.params, slot) for p, _, slot in entries]
        try:
            responses = host.sampler().sample_batched(requests, entries[0][0].num_samples, adapters)
        except ValueError:  # retried one by one: only the bad request fails, with its error
            for pending, client, _ in entries:
                self._alone(pending, client)
            return
        except Exception as exc:
            for pending, _, _ in entries:
                self.record(pending.request_id, pending.wrap(_raise(exc)))
            return
        samplers = len({id(client) for _, client, _ in entries})
        self._count_job(len(entries), samplers)
        for (pending, _, _), (response,) in zip(entries, responses, strict=True):
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


def _plan(
    ready: Sequence[tuple[PendingSample, LocalTrainingClient]],
) -> tuple[
    tuple[Worker, list[tuple[PendingSample, LocalTrainingClient, int]], MultiLora | None] | None,
    list[tuple[PendingSample, LocalTrainingClient]],
]:
    """Which requests share one batch (with their slots), and which sample alone."""
    workers: dict[int, Worker] = {}
    alone: list[tuple[PendingSample, LocalTrainingClient]] = []
    usable: list[tuple[PendingSample, LocalTrainingClient]] = []
    for pending, client in ready:
        worker = workers.get(id(client)) or client.sampling_worker()
        if worker is None:
            alone.append((pending, client))
            continue
        workers[id(client)] = worker
        usable.append((pending, client))
    if not usable:
        return None, alone
    models: dict[int, nn.Module] = {id(c): workers[id(c)].model for _, c in usable}
    if len(models) == 1:  # one sampler: no adapters to gather
        return (workers[id(usable[0][1])], [(p, c, 0) for p, c in usable], None), alone
    host_id = _host(models)
    if host_id is None:
        return None, [*alone, *usable]
    fits = [key for key, model in models.items() if _fits(models[host_id], model)]
    slot_of = {key: slot for slot, key in enumerate(fits)}
    entries = [(p, c, slot_of[id(c)]) for p, c in usable if id(c) in slot_of]
    alone += [(p, c) for p, c in usable if id(c) not in slot_of]
    if len(fits) == 1:
        return (workers[host_id], entries, None), alone
    adapters = MultiLora(models[host_id], [models[key] for key in fits])
    return (workers[host_id], entries, adapters), alone


def _host(models: dict[int, nn.Module]) -> int | None:
    """A model with LoRA layers that can host a batch (the first in arrival order)."""
    for key, model in models.items():
        try:
            if lora_layers(model, "the host"):
                MultiLora(model, [model])
                return key
        except ValueError:
            continue
    return None


def _fits(host: nn.Module, model: nn.Module) -> bool:
    try:
        MultiLora(host, [model])
    except ValueError as exc:
        log.debug("a sampler samples alone: %s", exc)
        return False
    return True


def _shared(params: SamplingParams) -> SamplingParams:
    """What one batch's requests must share: all but seed and max_tokens."""
    return replace(params, seed=None, max_tokens=None)


def _outcome(response: SampleResponse) -> Outcome:
    return Outcome(sample_response_to_json(response), encode_sample_response(response))


def _raise(exc: Exception) -> Job:
    def job() -> Outcome:
        raise exc

    return job
