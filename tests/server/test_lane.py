"""A model's lane runs its requests in seq_id order, and a refused request's seq_id still takes
its turn: the requests after it never wait for the seq-gap timeout (in process, real store)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from posttrain.server.config import ServerConfig
from posttrain.server.lanes import Lane, Outcome
from posttrain.server.runtime import Runtime
from posttrain.server.store import Store

GAP_TIMEOUT = 0.5


@pytest.fixture
async def runtime(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Runtime]:
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
        seq_gap_timeout=GAP_TIMEOUT,
    )
    store = Store(config.db_path)
    rt = Runtime(config, store)
    rt.start(asyncio.get_running_loop())
    yield rt
    rt.close()
    store.close()


class Recorder:
    """Jobs that record the order they ran in."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.ran, self.lock = runtime, list[int](), threading.Lock()

    def submit(self, lane: Lane, seq_id: int) -> str:
        request_id = f"r{seq_id}-{time.monotonic_ns()}"
        self.runtime.store.add_future(request_id, "me", "test", "hash")

        def job() -> Outcome:
            with self.lock:
                self.ran.append(seq_id)
            return Outcome({"seq_id": seq_id})

        lane.submit(seq_id, request_id, job)
        return request_id

    async def outcome(self, request_id: str) -> tuple[str, str | None]:
        row = await self.runtime.wait(request_id, "me", 5.0)
        assert row is not None and row.status != "pending"
        return row.status, row.error


async def test_a_refused_seq_id_takes_its_turn(runtime: Runtime) -> None:
    lane, jobs = Lane(runtime, "m"), Recorder(runtime)
    started = time.monotonic()
    third = jobs.submit(lane, 3)  # waits for 1 and 2
    lane.skip(2)  # refused before it was queued: a turn that runs nothing
    first = jobs.submit(lane, 1)
    assert await jobs.outcome(first) == ("completed", None)
    assert await jobs.outcome(third) == ("completed", None)
    assert jobs.ran == [1, 3]
    # No wait for the gap timeout: the refused turn passed at once (timing on a loaded 2-core
    # machine is ~10 ms; the timeout is 500 ms).
    assert time.monotonic() - started < GAP_TIMEOUT
    assert lane.next_seq == 4 and not lane.waiting


async def test_skip_never_takes_a_turn_that_is_queued_or_past(runtime: Runtime) -> None:
    lane, jobs = Lane(runtime, "m"), Recorder(runtime)
    waiting = jobs.submit(lane, 2)
    lane.skip(2)  # a refused retry of a queued request: the queued one keeps its turn
    lane.skip(0)  # before the first turn: nothing to pass
    done = jobs.submit(lane, 1)
    assert await jobs.outcome(done) == ("completed", None)
    assert await jobs.outcome(waiting) == ("completed", None)
    lane.skip(1)  # already run
    assert jobs.ran == [1, 2] and lane.next_seq == 3 and not lane.waiting


async def test_a_request_on_a_refused_turn_fails_and_names_it(runtime: Runtime) -> None:
    lane, jobs = Lane(runtime, "m"), Recorder(runtime)
    lane.skip(2)  # waits for 1
    status, error = await jobs.outcome(jobs.submit(lane, 2))
    assert status == "failed" and error is not None
    assert "seq_id 2 of model m was taken by a request the server refused" in error
    await asyncio.sleep(GAP_TIMEOUT * 1.5)  # the gap expires: only the refused turn waited
    assert lane.next_seq == 3 and not lane.waiting and jobs.ran == []
