"""The threads torch computes on: how many (from the cores this process may use), and which one.

The threading model: one thread runs torch compute per device. A training client runs its calls
on a `ComputeThread` of its own; `posttrain serve` gives every model and sampler the same one,
so the server computes on exactly one thread, taking its calls fairly between tenants (a
client's session: see `ComputeThread`, `FairQueue`). That thread's intra-op pool gets one OpenMP
thread per usable core. Two Python threads computing at once would each start a full pool and
fight over the cores: OpenMP threads wait at their barriers for a thread that is descheduled.

"Usable" is the smallest of: the CPUs in this process's affinity mask (`taskset`, a container's
cpuset), the CPU quota of its cgroup (`docker --cpus`), and `os.cpu_count()`. torch's own
default ignores the quota. An explicit `POSTTRAIN_NUM_THREADS` or `OMP_NUM_THREADS` wins.
Waiting OpenMP threads must not spin on cores that other processes need: see
`park_openmp_pool`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ENV_OVERRIDE = "POSTTRAIN_NUM_THREADS"
T = TypeVar("T")


CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on: affinity mask, cgroup quota and cpu_count, the smallest.

    A fractional quota rounds down (1.5 cores: 1 thread), since a second thread would be
    throttled for part of every period."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        counts.append(max(1, math.floor(quota)))
    return max(1, min(counts))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup v2 (`cpu.max`) or v1 (`cpu/cpu.cfs_quota_us`) CPU quota in cores; None if
    there is none (no file, "max", or a v1 quota of -1)."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        pass
    else:
        try:
            return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
        except ValueError:
            return None
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def requested_threads() -> tuple[int | None, str]:
    """The thread count the environment asks for, and the variable that asks (None, "": none).

    OMP_NUM_THREADS may list one count per nesting level ("4,2"): the first is torch's.
    """
    for name in (ENV_OVERRIDE, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        try:
            count = int(value.split(",")[0])
        except ValueError:
            raise ValueError(
                f"{name}={value!r} is not a whole number of threads: set it to one, e.g. "
                f"{name}={usable_cores()}, or unset it to use every usable core"
            ) from None
        if count < 1:
            raise ValueError(
                f"{name}={value!r} must be at least 1: set it to e.g. {name}={usable_cores()}, "
                "or unset it to use every usable core"
            )
        return count, name
    return None, ""


# A model narrower than this computes on one thread unless the environment asks for more:
# each of its matmuls is too small for a second OpenMP thread to pay for waking it. On the
# tiny model (hidden size 64) served to 8 clients at once, one thread did 1.46x the operations
# of two (benchmarks/serve_mixed.py), and sampled 2.9x as fast while other processes kept the
# cores busy: with one thread there is no OpenMP pool to wait on descheduled threads.
ONE_THREAD_BELOW_HIDDEN = 128


def chosen_threads(hidden_size: int | None = None) -> int:
    """What `configure_torch_threads` sets: an explicit request, else 1 for a model whose
    `hidden_size` is below `ONE_THREAD_BELOW_HIDDEN`, else the usable cores."""
    count, _ = requested_threads()
    if count:
        return count
    if hidden_size is not None and hidden_size < ONE_THREAD_BELOW_HIDDEN:
        return 1
    return usable_cores()


def configure_torch_threads(hidden_size: int | None = None) -> int:
    """Set torch's intra-op thread count to `chosen_threads(hidden_size)` and return it.

    The command line calls it before any work (not at import: importing posttrain changes
    nothing); `posttrain serve` gives the hidden size of the model it serves. Threads started
    later inherit the count. Library users who start their own compute threads can call it,
    or `torch.set_num_threads`, themselves.
    """
    import torch

    count = chosen_threads(hidden_size)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    if count > 1:
        park_openmp_pool()
    return count


def park_openmp_pool() -> None:
    """Start the calling thread's OpenMP pool with one parallel op and leave it parked.

    Why: GNU OpenMP (torch's on Linux) makes a waiting thread spin for about 3 ms before it
    sleeps, unless it manages more threads than there are CPUs; then it spins 100 times. With
    one compute thread it manages exactly as many as the cores, so it spins: harmless on idle
    cores, ruinous when other processes need them (on 2 cores kept busy by other work, the
    server's sampling ran 15x slower). A second pool, started here and never used again, tips
    it into short spins, which is what OMP_WAIT_POLICY=PASSIVE would do; that variable is read
    once, when torch loads, so posttrain cannot set it. Other OpenMP runtimes ignore this.
    (libgomp's manual, GOMP_SPINCOUNT: "If there are more OpenMP threads than available CPUs,
    1000 and 100 spins are used for OMP_WAIT_POLICY being ACTIVE or undefined, respectively".)
    """
    import torch

    torch.ones(1 << 20).add_(1.0)  # 1M elements: far above ATen's grain for a parallel loop


# The tenant on whose behalf the calling thread works (None: no tenant). `posttrain serve` sets it
# around each request (`server.runtime.Runtime.run`), so the client calls that request makes
# submit to the compute thread under its tenant without any parameter passed down.
current_tenant: contextvars.ContextVar[Hashable] = contextvars.ContextVar(
    "current_tenant", default=None
)


@contextlib.contextmanager
def as_tenant(tenant: Hashable) -> Iterator[None]:
    """Calls submitted by this thread inside the block are `tenant`'s (see `ComputeThread`)."""
    token = current_tenant.set(tenant)
    try:
        yield
    finally:
        current_tenant.reset(token)


@dataclass(eq=False)  # compared by identity: args may hold tensors
class _Call:
    fn: Callable[..., Any]
    args: tuple[object, ...]
    future: concurrent.futures.Future[Any]
    seq: int  # submission order: ties between tenants go to the earlier call


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
        self.waiting: dict[Hashable, collections.deque[_Call]] = {}
        self.used: dict[Hashable, float] = {}
        self.vtime = 0.0
        self.running: Hashable = _IDLE
        self._seq = itertools.count()

    def push(self, tenant: Hashable, call_fn: Callable[..., Any], *args: object) -> _Call:
        call = _Call(call_fn, args, concurrent.futures.Future(), next(self._seq))
        queue = self.waiting.get(tenant)
        if queue is None:
            queue = self.waiting[tenant] = collections.deque()
            if tenant != self.running:  # becomes active
                self.used[tenant] = max(self.used.get(tenant, self.vtime), self.vtime)
        queue.append(call)
        return call

    def remove(self, tenant: Hashable, call: _Call) -> None:
        """Take back `call` if it still waits (a `drain` may have taken it already)."""
        queue = self.waiting.get(tenant)
        if queue is not None and call in queue:
            queue.remove(call)
            if not queue:
                del self.waiting[tenant]

    def pop(self) -> tuple[Hashable, _Call] | None:
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

    def drain(self) -> list[_Call]:
        """Every waiting call, removed."""
        calls = [call for queue in self.waiting.values() for call in queue]
        self.waiting.clear()
        return calls


_IDLE = object()  # `FairQueue.running` when no call runs (None is a tenant)


class ComputeThread:
    """One thread that runs the torch calls given to it one at a time, whoever submits them.

    Order. Each call belongs to a tenant (`submit(..., tenant=)`, else the submitting thread's
    `current_tenant`, else None). One tenant's calls run in submission order. Between tenants
    with calls waiting, the one that has used the least compute time goes next (`FairQueue`):
    each call is charged its wall time on this thread, so a tenant that floods the queue gets
    its share and no more. With a single tenant (None, for every user but `posttrain serve`)
    this is plain submission order.

    A call submitted from this thread itself runs at once, inline (and is part of the calling
    call's time): queued behind the call that submits it, a caller waiting for it would deadlock
    the thread.
    """

    def __init__(
        self, name: str = "compute", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.name = name
        # The pool hosts the thread (and its shutdown); each submission adds one turn to it, and
        # a turn runs whichever call `FairQueue` picks then.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queue = FairQueue()
        self._lock = threading.Lock()
        self._clock = clock
        self._ident: int | None = None  # known once the thread ran its first call

    def submit(
        self, fn: Callable[..., T], *args: object, tenant: Hashable = None
    ) -> concurrent.futures.Future[T]:
        """`fn(*args)` on this thread, after `tenant`'s calls submitted before it (and when
        fairness between tenants says). `tenant` None: the submitting thread's
        `current_tenant` (None unless set with `as_tenant`). A tenant is any hashable key;
        `posttrain serve` uses the request's session id (`Runtime.tenant_of`)."""
        if self.is_current():
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the error belongs to whoever reads the future
                future.set_exception(exc)
            return future
        if tenant is None:
            tenant = current_tenant.get()
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


@dataclass(frozen=True)
class ThreadReport:
    """torch's thread settings in this process, and what competes for the cores."""

    torch_threads: int  # torch's count now (its default unless something configured it)
    chosen: int | None  # what posttrain's commands set; None if the environment is invalid
    usable: int
    requested: int | None
    source: str  # the variable that asked for `requested`, or ""
    load_1min: float | None  # the machine's 1-minute load average, where known
    error: str = ""  # why the environment's request is invalid
    wait_policy: str = ""  # OMP_WAIT_POLICY as torch's OpenMP read it at load ("": default)

    def warnings(self) -> list[str]:
        """What makes compute slow: more threads than cores, or cores already busy."""
        found = [self.error] if self.error else []
        if self.requested is not None and self.requested > self.usable:
            found.append(
                f"{self.source}={self.requested} asks for more threads than the {self.usable} "
                f"usable core(s): OpenMP threads will wait on each other; set "
                f"{self.source}={self.usable} or unset it"
            )
        elif self.torch_threads > self.usable:
            found.append(
                f"torch defaults to {self.torch_threads} threads on {self.usable} usable "
                "core(s): posttrain's commands set the count themselves, but code that calls "
                f"torch directly oversubscribes; set OMP_NUM_THREADS={self.usable}"
            )
        # One thread has no OpenMP barrier to wait at: busy cores only share its time.
        if self.load_1min is not None and self.load_1min > self.usable and self.torch_threads > 1:
            fix = "stop that work, or lower OMP_NUM_THREADS to the cores left free"
            if self.wait_policy.upper() != "PASSIVE":
                # libgomp reads it once, when torch loads: too late to set from Python.
                fix += (
                    ", or start with OMP_WAIT_POLICY=PASSIVE in the environment (waiting "
                    "OpenMP threads then sleep instead of spinning on the busy cores)"
                )
            found.append(
                f"the 1-minute load average is {self.load_1min:.1f} on {self.usable} usable "
                "core(s): other work shares the cores, so OpenMP threads wait on each other "
                f"and compute runs several times slower; {fix}"
            )
        return found

    def describe(self) -> str:
        chosen = "?" if self.chosen is None else str(self.chosen)
        asked = f" ({self.source}={self.requested})" if self.requested is not None else ""
        load = f"; load average {self.load_1min:.1f}" if self.load_1min is not None else ""
        policy = f"OMP_WAIT_POLICY={self.wait_policy}" if self.wait_policy else "default"
        return (
            f"posttrain computes with {chosen} torch thread(s){asked} on {self.usable} usable "
            f"core(s) of {os.cpu_count()}; torch in this process: {self.torch_threads}; "
            f"OpenMP waits: {policy}{load}"
        )


def thread_report(hidden_size: int | None = None) -> ThreadReport:
    """The thread settings of this process, for `posttrain doctor` and server logs (which give
    the `hidden_size` of the model they serve, as to `configure_torch_threads`)."""
    import torch

    try:
        requested, source = requested_threads()
        chosen: int | None = chosen_threads(hidden_size)
        error = ""
    except ValueError as exc:
        requested, source, chosen, error = None, "", None, str(exc)
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip()
    return ThreadReport(
        torch.get_num_threads(), chosen, usable_cores(), requested, source, load, error, policy
    )
