"""Fair turns between tenants on one `ComputeThread` (`server.fair_queue.FairQueue`).

The scheduler is tested alone first, with hand-set call durations (no clock, no threads), so
the exact order and shares follow from the rule: the waiting tenant with the least charged
time goes next, ties to the earlier call, and a tenant that becomes active starts at `vtime`.
Then the thread itself, with real sleeps: a flooding tenant against three that submit one call
at a time, FIFO within a tenant, inline calls, and close().
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Hashable
from typing import Any

import pytest
import torch

from posttrain.engine.compute_thread import ComputeThread
from posttrain.server.fair_queue import FairQueue, as_tenant, current_tenant

STEADY = ("a", "b", "c")


def simulate(durations: dict[str, float], late_resubmit: bool, turns: int) -> list[str]:
    """Tenant "f" queues 50 calls at once; each of `STEADY` keeps one call queued, submitting
    the next when the last finishes (`late_resubmit`: only after the next call has started, as
    when the compute thread picks before the waiting thread wakes). Returns who ran, in order."""
    queue = FairQueue()
    for i in range(50):
        queue.push("f", lambda: None, i)
    for tenant in STEADY:
        queue.push(tenant, lambda: None)
    ran: list[str] = []
    owed: str | None = None  # a steady tenant whose next call is not submitted yet
    for _ in range(turns):
        picked = queue.pop()
        assert picked is not None
        tenant = picked[0]
        assert isinstance(tenant, str)
        if owed is not None:
            queue.push(owed, lambda: None)
            owed = None
        ran.append(tenant)
        queue.charge(tenant, durations[tenant])
        if tenant in STEADY:
            if late_resubmit:
                owed = tenant
            else:
                queue.push(tenant, lambda: None)
    return ran


@pytest.mark.parametrize("late_resubmit", [False, True])
def test_equal_calls_take_turns_round_robin(late_resubmit: bool) -> None:
    # All start at 0 and ties go to the earlier call: f (its calls came first), then a, b, c,
    # each charged 1; then again f, a, b, c. A steady tenant resubmitting late restarts at
    # max(its used, vtime) = its used, since vtime (the used of the tenant started last) never
    # exceeds it: it loses no turn. So 200 turns are exactly 50 each: 25%, f's 50 calls done.
    ran = simulate(dict.fromkeys(["f", *STEADY], 1.0), late_resubmit, 200)
    assert ran[:8] == ["f", "a", "b", "c"] * 2
    assert Counter(ran) == dict.fromkeys(["f", *STEADY], 50)


def test_shares_are_of_compute_time_not_of_calls() -> None:
    # f's calls take 4x as long: after f's first call (used 4), a, b and c each run 4 calls
    # (used 1..4) before f's used is the least again (ties to f's older call). So each round
    # is 16 s, 4 s each: 25% of the time each, f gets 1 call in 13.
    durations = {"f": 4.0, "a": 1.0, "b": 1.0, "c": 1.0}
    ran = simulate(durations, late_resubmit=False, turns=13 * 10)
    assert ran[:13] == ["f"] + ["a", "b", "c"] * 4
    time_used = Counter({t: n * durations[t] for t, n in Counter(ran).items()})
    assert time_used == dict.fromkeys(["f", *STEADY], 40.0)


def test_idle_time_banks_no_credit() -> None:
    queue = FairQueue()
    for _ in range(3):
        queue.push("busy", lambda: None)
    for _ in range(3):
        picked = queue.pop()
        assert picked is not None and picked[0] == "busy"
        queue.charge("busy", 1.0)
    queue.push("busy", lambda: None)
    # "late" was idle while "busy" used 3 s; it starts at vtime (2: busy's used when its
    # last call started), not at 0, so it gets one turn ahead of busy (3), not three.
    queue.push("late", lambda: None)
    assert queue.used["late"] == 2.0
    picked = queue.pop()
    assert picked is not None and picked[0] == "late"
    queue.charge("late", 1.0)
    queue.push("late", lambda: None)  # now late (3) ties busy (3): busy's call is older
    picked = queue.pop()
    assert picked is not None and picked[0] == "busy"


def test_forgets_tenants_that_would_restart_at_vtime() -> None:
    queue = FairQueue()
    for tenant in ("x", "y"):
        queue.push(tenant, lambda: None)
    for _ in range(2):
        picked = queue.pop()
        assert picked is not None
        queue.charge(picked[0], 1.0)
    queue.push("y", lambda: None)
    picked = queue.pop()
    assert picked is not None
    queue.charge("y", 1.0)
    # x (used 1) is idle and vtime is 1: it would restart at 1 anyway, so it is forgotten.
    assert "x" not in queue.used and queue.used["y"] == 2.0


def work(log: list[Any], tenant: Hashable, seconds: float, item: object = None) -> None:
    time.sleep(seconds)
    log.append((tenant, item) if item is not None else tenant)


def test_a_flooding_tenant_gets_its_share_and_no_more() -> None:
    """50 calls of "f" queued at once, while a, b and c each submit a call, wait for it, and
    submit the next. Every call sleeps 10 ms, so by the rule each tenant gets 25% of the turns
    while f's calls last; the waiting threads wake in far less than the 30 ms that the other
    three tenants' turns take, so none misses its turn (the simulation above shows it would
    not lose one anyway). 20% is the issue's bound; the margin is for a loaded machine."""
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    log: list[Any] = []
    stop = threading.Event()

    def steady(tenant: str) -> None:
        while not stop.is_set():
            compute.submit(work, log, tenant, 0.01, tenant=tenant).result()

    gate = threading.Event()
    compute.submit(gate.wait)  # holds the thread until every tenant has a call queued
    flood = [compute.submit(work, log, "f", 0.01, i, tenant="f") for i in range(50)]
    threads = [threading.Thread(target=steady, args=(t,)) for t in STEADY]
    for thread in threads:
        thread.start()
    while len(queue.waiting) < 4:  # the setup only
        time.sleep(0.001)
    gate.set()
    flood[-1].result()
    stop.set()
    for thread in threads:
        thread.join()
    compute.close()
    until = next(i for i, e in enumerate(log) if e == ("f", 49)) + 1
    window = [e if isinstance(e, str) else "f" for e in log[:until]]
    shares = {t: n / len(window) for t, n in Counter(window).items()}
    assert set(shares) == {"f", *STEADY}
    assert min(shares.values()) >= 0.2, shares
    # One tenant's calls keep their submission order.
    assert [e[1] for e in log if isinstance(e, tuple)] == list(range(50))


def test_fifo_within_a_tenant_whoever_submits() -> None:
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    gate = threading.Event()
    compute.submit(gate.wait)
    log: list[Any] = []
    futures = []
    for i in range(20):  # two tenants interleaved, one from a thread that sets its tenant
        futures.append(compute.submit(work, log, "x", 0.0, i, tenant="x"))
        with as_tenant("y"):
            futures.append(compute.submit(work, log, "y", 0.0, i))
    gate.set()
    for future in futures:
        future.result()
    compute.close()
    for tenant in ("x", "y"):
        assert [item for t, item in log if t == tenant] == list(range(20))
    assert current_tenant.get() is None  # the block restored it


def test_calls_from_the_thread_itself_run_inline_in_the_callers_turn() -> None:
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)

    def outer() -> list[str]:
        seen = ["outer"]
        # Queued behind this call it would deadlock; inline, it runs now, whatever tenant.
        compute.submit(seen.append, "inner", tenant="other").result(timeout=5)
        return seen

    assert compute.call(outer, tenant="me") == ["outer", "inner"]
    assert set(compute.used()) <= {"me"}  # the inline call was part of "me"'s time
    compute.close()


def test_without_tenants_it_is_submission_order() -> None:
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    gate = threading.Event()
    compute.submit(gate.wait)
    log: list[Any] = []
    futures = [compute.submit(work, log, None, 0.0, i) for i in range(30)]
    gate.set()
    for future in futures:
        future.result()
    assert [item for _, item in log] == list(range(30))
    compute.close()


def test_close_waits_or_drops() -> None:
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    log: list[Any] = []
    futures = [compute.submit(work, log, t, 0.01, i, tenant=t) for i in range(3) for t in "xy"]
    compute.close()  # waits: every call ran
    assert all(f.done() and not f.cancelled() for f in futures) and len(log) == 6
    with pytest.raises(RuntimeError):
        compute.submit(work, log, "x", 0.0)
    assert not queue.waiting

    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    gate = threading.Event()
    running = compute.submit(gate.wait, tenant="x")
    later = [compute.submit(work, log, t, 0.0, tenant=t) for t in "xyz"]
    while not running.running():
        time.sleep(0.001)
    compute.close(wait=False)  # the call running finishes; the waiting ones are dropped
    assert all(f.cancelled() for f in later)
    gate.set()
    assert running.result(timeout=5) is True


def test_a_submission_racing_close_is_refused_cleanly() -> None:
    # A call whose turn cannot be queued (the pool is shut down) is taken back, even when a
    # close(wait=False) drained it first; calls are told apart by identity, not by their args
    # (tensors have no truth value).
    queue = FairQueue()
    compute = ComputeThread("test-fair", queue=queue)
    call = queue.push("x", torch.add, torch.ones(3), torch.ones(3))
    twin = queue.push("x", torch.add, torch.ones(3), torch.ones(3))
    queue.remove("x", twin)
    assert list(queue.waiting["x"]) == [call]
    compute.close(wait=False)  # drains `call`
    queue.remove("x", call)  # no error: it was gone already
    with pytest.raises(RuntimeError):
        compute.submit(torch.add, torch.ones(3), torch.ones(3), tenant="x")
    assert not queue.waiting
