"""Futures returned by training clients: awaitable, and `.result()` for synchronous code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from posttrain.engine.compute_thread import ComputeThread

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """The pending result of one client call (the tinker SDK's name and methods)."""

    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[object, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)`, computed when this one completes."""
        out: concurrent.futures.Future[U] = concurrent.futures.Future()

        def done(f: concurrent.futures.Future[T]) -> None:
            try:
                out.set_result(fn(f.result()))
            except BaseException as exc:  # the error belongs to whoever awaits `out`
                out.set_exception(exc)

        self._future.add_done_callback(done)
        return APIFuture(out)


class OrderedRunner:
    """Runs submitted calls one at a time in submission order on one background thread: a
    thread of its own, or a `ComputeThread` shared with other runners (`posttrain serve` runs
    every model's calls on one, so torch never computes on two threads at once)."""

    def __init__(self, name: str, thread: ComputeThread | None = None) -> None:
        self._own = thread is None
        self._thread = thread or ComputeThread(name)
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> APIFuture[T]:
        if self._closed:
            raise RuntimeError("this client is closed: cannot run new calls")
        future = self._thread.submit(fn)
        if not future.done():
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
        return APIFuture(future)

    def close(self) -> None:
        """Finish the calls already submitted; a shared thread goes on running the others'."""
        self._closed = True
        if self._own:
            self._thread.close()
        elif not self._thread.is_current():
            # All of them: a shared thread keeps each tenant's order, not submission order
            # across tenants, and a shared sampler takes calls from several tenants.
            concurrent.futures.wait(list(self._pending))
