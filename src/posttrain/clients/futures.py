"""Futures returned by training clients: awaitable, and `.result()` for synchronous code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Generic, TypeVar

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
    """Runs submitted calls one at a time in submission order on a single background thread."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], T]) -> APIFuture[T]:
        return APIFuture(self._pool.submit(fn))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
