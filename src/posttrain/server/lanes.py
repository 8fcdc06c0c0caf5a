"""A model's request lane: requests run in `seq_id` order, one at a time, on the lane's thread.

Each live model has a lane: requests wait there until every smaller `seq_id` has been handed
on, then run one at a time on the lane's thread (torch work never runs on the event loop). A
gap in `seq_id` waits `seq_gap_timeout` seconds, then the waiting requests fail with a user
error naming the missing id. What a request runs is a `Job`; its result is an `Outcome`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class LaneOwner(Protocol):
    """What a lane needs from the server runtime that owns it (`server.runtime.Runtime`)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def seq_gap_timeout(self) -> float: ...

    def run(self, request_id: str, job: Job) -> None: ...

    def fail(self, request_id: str, error: str, category: str = "user") -> None: ...


class UserError(ValueError):
    """A request the caller got wrong: its future fails with category "user"."""


@dataclass(frozen=True)
class Outcome:
    """A finished request: its JSON form, and its protobuf form where the protocol has one.

    `json=None` (forward passes): the JSON form is decoded from `proto` if a client asks for it.
    """

    json: dict[str, object] | None
    proto: bytes | None = None


Job = Callable[[], Outcome]


def category_of(exc: BaseException) -> str:
    # The engine reports bad input (token ids, shapes, loss names, configs) as ValueError.
    return "user" if isinstance(exc, ValueError | LookupError | TypeError) else "server"


@dataclass
class _Waiting:
    request_id: str
    job: Job


class Lane:
    """One model's requests, run in `seq_id` order (from 1) on one thread.

    Every `seq_id` the client sends takes its turn, refused or not: a request refused before it
    was queued (a 4xx) is `skip`ped in its turn, so the requests after it never wait for it.
    """

    def __init__(self, runtime: LaneOwner, model_id: str) -> None:
        self.runtime = runtime
        self.model_id = model_id
        self.next_seq = 1
        self.waiting: dict[int, _Waiting | None] = {}  # None: a refused request's turn
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lane")
        self.timer: asyncio.TimerHandle | None = None

    def submit(self, seq_id: int, request_id: str, job: Job) -> None:
        """Called on the event loop."""
        if seq_id < self.next_seq:
            self.runtime.fail(
                request_id,
                f"seq_id {seq_id} arrived after model {self.model_id} moved past it "
                f"(next expected seq_id is {self.next_seq})",
            )
            return
        if seq_id in self.waiting:  # the store lets one request per seq_id through: a refused one
            self.runtime.fail(
                request_id,
                f"seq_id {seq_id} of model {self.model_id} was taken by a request the server "
                "refused; send each request with a new seq_id",
            )
            return
        self.waiting[seq_id] = _Waiting(request_id, job)
        self._drain()

    def skip(self, seq_id: int) -> None:
        """Called on the event loop for a request refused before it was queued: its turn
        passes without running anything (a no-op if `seq_id` already has its turn)."""
        if seq_id >= self.next_seq and seq_id not in self.waiting:
            self.waiting[seq_id] = None
            self._drain()

    def _drain(self) -> None:
        while self.next_seq in self.waiting:
            item = self.waiting.pop(self.next_seq)
            if item is not None:
                self.thread.submit(self.runtime.run, item.request_id, item.job)
            self.next_seq += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.waiting:
            loop = self.runtime.loop
            self.timer = loop.call_later(self.runtime.seq_gap_timeout, self._gap_expired)

    def _gap_expired(self) -> None:
        self.timer = None
        missing = self.next_seq
        for seq_id, item in sorted(self.waiting.items()):
            if item is None:
                continue
            self.runtime.fail(
                item.request_id,
                f"model {self.model_id}: seq_id {missing} never arrived within "
                f"{self.runtime.seq_gap_timeout:g} s, so seq_id {seq_id} cannot run "
                "(requests of a model run in seq_id order)",
            )
        self.next_seq = max(self.waiting) + 1
        self.waiting.clear()

    def close(self, reason: str) -> None:
        """Fail the requests still waiting for their turn; those already handed on run (and
        fail, as the model is gone)."""
        if self.timer is not None:
            self.timer.cancel()
        for item in self.waiting.values():
            if item is not None:
                self.runtime.fail(item.request_id, reason)
        self.waiting.clear()
        self.thread.shutdown(wait=False)
