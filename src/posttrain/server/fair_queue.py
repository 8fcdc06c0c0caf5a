"""Fair turns between `posttrain serve`'s tenants on its one compute thread: the queue its
`ComputeThread` takes calls from, and the tenant each call belongs to (`current_tenant`,
`as_tenant`)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from posttrain.engine.compute_thread import Call

# The tenant on whose behalf the calling thread works (None: no tenant). `posttrain serve` sets it
# around each request (`server.runtime.Runtime.run`), so the client calls that request makes
# submit to the compute thread under its tenant without any parameter passed down.
current_tenant: contextvars.ContextVar[Hashable] = contextvars.ContextVar(
    "current_tenant", default=None
)


@contextlib.contextmanager
def as_tenant(tenant: Hashable) -> Iterator[None]:
    """Calls submitted by this thread inside the block are `tenant`'s (see `FairQueue`)."""
    token = current_tenant.set(tenant)
    try:
        yield
    finally:
        current_tenant.reset(token)


_IDLE = object()  # `FairQueue.running` when no call runs (None is a tenant)


class FairQueue:
    """Waiting calls, per tenant in submission order; `pop` gives the next call of the tenant
    that has used the least compute time (start-time fair queueing).

    Each tenant has `used` seconds, its virtual time: `charge` adds each call's wall time. A
    tenant that becomes active (a call arrives while none of its calls waits or runs) starts at
    `max(used, vtime)`, where `vtime` is the `used` of the tenant whose call started last (the
    smallest among the waiting ones then): time spent idle banks no credit, and a tenant that
    just had more than its share keeps its excess. Not thread-safe: `ComputeThread` locks it.
    """

    def __init__(self) -> None:
        self.waiting: dict[Hashable, collections.deque[Call]] = {}
        self.used: dict[Hashable, float] = {}
        self.vtime = 0.0
        self.running: Hashable = _IDLE
        self._seq = itertools.count()

    def tenant_of(self, tenant: Hashable) -> Hashable:
        """`tenant`, else the submitting thread's (`as_tenant`; None when it set none)."""
        return current_tenant.get() if tenant is None else tenant

    def push(self, tenant: Hashable, call_fn: Callable[..., Any], *args: object) -> Call:
        call = Call(call_fn, args, concurrent.futures.Future(), next(self._seq))
        queue = self.waiting.get(tenant)
        if queue is None:
            queue = self.waiting[tenant] = collections.deque()
            if tenant != self.running:  # becomes active
                self.used[tenant] = max(self.used.get(tenant, self.vtime), self.vtime)
        queue.append(call)
        return call

    def remove(self, tenant: Hashable, call: Call) -> None:
        """Take back `call` if it still waits (a `drain` may have taken it already)."""
        queue = self.waiting.get(tenant)
        if queue is not None and call in queue:
            queue.remove(call)
            if not queue:
                del self.waiting[tenant]

    def pop(self) -> tuple[Hashable, Call] | None:
        """The next call and its tenant, now running (None: nothing waits)."""
        if not self.waiting:
            return None
        tenant = min(self.waiting, key=lambda t: (self.used[t], self.waiting[t][0].seq))
        queue = self.waiting[tenant]
        call = queue.popleft()
        if not queue:
            del self.waiting[tenant]
        self.vtime = max(self.vtime, self.used[tenant])
        self.running = tenant
        return tenant, call

    def charge(self, tenant: Hashable, seconds: float) -> None:
        """`tenant`'s call that `pop` returned took `seconds`; it no longer runs."""
        self.used[tenant] += seconds
        self.running = _IDLE
        # A tenant neither waiting nor ahead of vtime would restart at vtime: forget it, so
        # that a server's finished sessions do not pile up here.
        for t in [t for t, u in self.used.items() if u <= self.vtime and t not in self.waiting]:
            del self.used[t]

    def drain(self) -> list[Call]:
        """Every waiting call, removed."""
        calls = [call for queue in self.waiting.values() for call in queue]
        self.waiting.clear()
        return calls
