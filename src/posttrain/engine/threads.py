"""The threads torch computes on: how many (from the cores this process may use), and which one.

The threading model: one thread runs torch compute per device. A training client runs its calls
on a `ComputeThread` of its own; `posttrain serve` gives every model and sampler the same one,
so the server computes on exactly one thread. That thread's intra-op pool gets one OpenMP
thread per usable core. Two Python threads computing at once would each start a full pool and
fight over the cores: OpenMP threads wait at their barriers for a thread that is descheduled.

"Usable" is the smallest of: the CPUs in this process's affinity mask (`taskset`, a container's
cpuset), the CPU quota of its cgroup (`docker --cpus`), and `os.cpu_count()`. torch's own
default ignores the quota. An explicit `POSTTRAIN_NUM_THREADS` or `OMP_NUM_THREADS` wins.
Waiting OpenMP threads must not spin on cores that other processes need: see
`park_openmp_pool`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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


class ComputeThread:
    """One thread that runs the torch calls given to it one at a time, in submission order,
    whoever submits them.

    A call submitted from this thread itself runs at once, inline: queued behind the call that
    submits it, a caller waiting for it would deadlock the thread.
    """

    def __init__(self, name: str = "compute") -> None:
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._ident: int | None = None  # known once the thread ran its first call

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """`fn(*args)` on this thread, after the calls submitted before it."""
        if self.is_current():
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the error belongs to whoever reads the future
                future.set_exception(exc)
            return future
        return self._pool.submit(self._run, fn, *args)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on this thread and return its result (from any thread)."""
        return self.submit(fn, *args).result()

    def is_current(self) -> bool:
        return self._ident == threading.get_ident()

    @property
    def ident(self) -> int | None:
        """`threading.get_ident()` of the thread (None before its first call)."""
        return self._ident

    def close(self, wait: bool = True) -> None:
        """Stop after the calls already submitted (`wait`), or drop those not yet started."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _run(self, fn: Callable[..., T], *args: object) -> T:
        self._ident = threading.get_ident()
        return fn(*args)


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
