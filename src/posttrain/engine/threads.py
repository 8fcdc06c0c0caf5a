"""The threads torch computes on: how many (from the cores this process may use), and which one.

The threading model: one thread runs torch compute per device. A training client runs its calls
on a `ComputeThread` of its own (`engine.compute_thread`); `posttrain serve` gives every model
and sampler the same one, so the server computes on exactly one thread, taking its calls fairly
between tenants (`server.fair_queue`). That thread's intra-op pool gets one OpenMP thread per
usable core. Two Python threads computing at once would each start a full pool and
fight over the cores: OpenMP threads wait at their barriers for a thread that is descheduled.

"Usable" is the smallest of: the CPUs in this process's affinity mask (`taskset`, a container's
cpuset), the CPU quota of its cgroup (`docker --cpus`), and `os.cpu_count()`. torch's own
default ignores the quota. An explicit `POSTTRAIN_NUM_THREADS` or `OMP_NUM_THREADS` wins.
Waiting OpenMP threads must not spin on cores that other processes need: see
`park_openmp_pool`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

ENV_OVERRIDE = "POSTTRAIN_NUM_THREADS"


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
