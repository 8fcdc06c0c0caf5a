"""The thread torch computes on: one per device, running the calls given to it one at a time,
in the order its queue picks (`CallQueue`: submission order, or `posttrain serve`'s fair turns
between tenants, `server.fair_queue`)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclass(eq=False)  # compared by identity: args may hold tensors
class Call:
    fn: Callable[..., Any]
    args: tuple[object, ...]
    future: concurrent.futures.Future[Any]
    seq: int  # submission order: ties between tenants go to the earlier call


class CallQueue(Protocol):
    """The calls waiting for a `ComputeThread`, and the order it takes them in. Not thread-safe:
    the thread locks it. `SubmissionOrder` by default; `posttrain serve` passes a `FairQueue`
    (`server.fair_queue`), which shares the thread between tenants by the time they used."""

    @property
    def used(self) -> dict[Hashable, float]: ...

    def tenant_of(self, tenant: Hashable) -> Hashable:
        """The tenant of a call submitted now, on the submitting thread, with `tenant` (None:
        the queue's choice, such as the tenant the thread works for)."""
        ...

    def push(self, tenant: Hashable, call_fn: Callable[..., Any], *args: object) -> Call: ...

    def remove(self, tenant: Hashable, call: Call) -> None: ...

    def pop(self) -> tuple[Hashable, Call] | None: ...

    def charge(self, tenant: Hashable, seconds: float) -> None: ...

    def drain(self) -> list[Call]: ...


class SubmissionOrder:
    """Calls in the order they were submitted, whoever's tenant they are; `used` sums each
    tenant's compute seconds."""

    def __init__(self) -> None:
        self.waiting: collections.deque[tuple[Hashable, Call]] = collections.deque()
        self.used: dict[Hashable, float] = {}
        self._seq = itertools.count()

    def tenant_of(self, tenant: Hashable) -> Hashable:
        return tenant

    def push(self, tenant: Hashable, call_fn: Callable[..., Any], *args: object) -> Call:
        call = Call(call_fn, args, concurrent.futures.Future(), next(self._seq))
        self.waiting.append((tenant, call))
        return call

    def remove(self, tenant: Hashable, call: Call) -> None:
        with contextlib.suppress(ValueError):  # a `drain` may have taken it already
            self.waiting.remove((tenant, call))

    def pop(self) -> tuple[Hashable, Call] | None:
        return self.waiting.popleft() if self.waiting else None

    def charge(self, tenant: Hashable, seconds: float) -> None:
        self.used[tenant] = self.used.get(tenant, 0.0) + seconds

    def drain(self) -> list[Call]:
        calls = [call for _, call in self.waiting]
        self.waiting.clear()
        return calls


class ComputeThread:
    """One thread that runs the torch calls given to it one at a time, whoever submits them.

    Order. Each call belongs to a tenant (`submit(..., tenant=)`, else the queue's choice: the
    submitting thread's tenant for a `FairQueue`, else None) and is charged its wall time on
    this thread. `queue` picks the
    next call: submission order by default; `posttrain serve` passes its `FairQueue`, where one
    tenant's calls run in submission order and, between tenants with calls waiting, the one that
    has used the least compute time goes next, so a tenant that floods the queue gets its share
    and no more.

    A call submitted from this thread itself runs at once, inline (and is part of the calling
    call's time): queued behind the call that submits it, a caller waiting for it would deadlock
    the thread.
    """

    def __init__(
        self,
        name: str = "compute",
        clock: Callable[[], float] = time.perf_counter,
        queue: CallQueue | None = None,
    ) -> None:
        self.name = name
        # The pool hosts the thread (and its shutdown); each submission adds one turn to it, and
        # a turn runs whichever call the queue picks then.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queue: CallQueue = queue if queue is not None else SubmissionOrder()
        self._lock = threading.Lock()
        self._clock = clock
        self._ident: int | None = None  # known once the thread ran its first call

    def submit(
        self, fn: Callable[..., T], *args: object, tenant: Hashable = None
    ) -> concurrent.futures.Future[T]:
        """`fn(*args)` on this thread, after `tenant`'s calls submitted before it (and when
        fairness between tenants says). `tenant` None: the queue's choice (`CallQueue.tenant_of`).
        A tenant is any hashable key; `posttrain serve` uses the request's session id
        (`Runtime.tenant_of`)."""
        if self.is_current():
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the error belongs to whoever reads the future
                future.set_exception(exc)
            return future
        tenant = self._queue.tenant_of(tenant)
        with self._lock:
            call = self._queue.push(tenant, fn, *args)
        try:
            self._pool.submit(self._turn)
        except RuntimeError:  # closed
            with self._lock:
                self._queue.remove(tenant, call)
            raise
        return call.future

    def call(self, fn: Callable[..., T], *args: object, tenant: Hashable = None) -> T:
        """Run `fn(*args)` on this thread and return its result (from any thread)."""
        return self.submit(fn, *args, tenant=tenant).result()

    def is_current(self) -> bool:
        return self._ident == threading.get_ident()

    @property
    def ident(self) -> int | None:
        """`threading.get_ident()` of the thread (None before its first call)."""
        return self._ident

    def used(self) -> dict[Hashable, float]:
        """Compute seconds charged per tenant still tracked (idle tenants at the minimum are
        forgotten), for logs and tests."""
        with self._lock:
            return dict(self._queue.used)

    def close(self, wait: bool = True) -> None:
        """Stop after the calls already submitted (`wait`), or drop those not yet started."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        if not wait:
            with self._lock:
                dropped = self._queue.drain()
            for call in dropped:
                call.future.cancel()

    def _turn(self) -> None:
        with self._lock:
            picked = self._queue.pop()
        if picked is None:  # close(wait=False) dropped the call this turn was for
            return
        tenant, call = picked
        self._ident = threading.get_ident()
        start = self._clock()
        try:
            if call.future.set_running_or_notify_cancel():
                try:
                    result = call.fn(*call.args)
                except BaseException as exc:  # the error belongs to whoever reads the future
                    call.future.set_exception(exc)
                else:
                    call.future.set_result(result)
        finally:
            with self._lock:
                self._queue.charge(tenant, self._clock() - start)
