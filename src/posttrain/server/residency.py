"""Bounded memory (`posttrain serve --max-resident-adapters N`): which adapters are in memory.

At most `limit` adapters are resident: LoRA training clients (adapter, AdamW state, gradients)
and LoRA sampling models together. To make room, the least recently used idle one leaves: a
training client is spilled to disk (`LocalTrainingClient.spill`) and rebuilt from there on its
next request, bit-exact; a sampling model is dropped, as its weights are on disk already.
`limit=None` keeps everything (and spills nothing): the server's behaviour without the flag.

A training client is busy while a request of its own runs (`pinned`; a model's lane runs one
at a time). A busy client is never evicted. Sampling models run their requests whole on the
compute thread, where evictions run too, so none is evicted mid-request; a holder outside it
(the OpenAI endpoints) keeps using a dropped one, which is freed when it lets go.

Threads: spills, rebuilds and evictions run on the compute thread (torch work, and one at a
time, so no eviction races another); `_lock` guards the bookkeeping and is never held while
waiting for the compute thread. A training client's reload waits on its lane thread for a busy
adapter to become idle (up to `wait_s`). A sampling model's admission runs on the compute
thread, which cannot wait (the busy clients' requests queue behind it), so it refuses at once;
the sample request it refused waits on the event loop instead (`room`) and is tried again
once an adapter may leave, up to `wait_s` in all too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.compute_thread import ComputeThread
from posttrain.server.lanes import Job, Outcome, UserError
from posttrain.server.sources import SourceBusyError

log = logging.getLogger(__name__)

Build = Callable[[], LocalTrainingClient]


class NoRoomError(UserError, SourceBusyError):
    """Every resident adapter is busy: nothing can leave to make room for another (a user
    error on the Tinker side; a 503 on the OpenAI-compatible endpoints). `seen`, from
    `admit_sampler`: the notices that an adapter may leave before the refusal (`Residency.room`
    waits for the next one)."""

    def __init__(self, message: str, seen: int = 0) -> None:
        super().__init__(message)
        self.seen = seen


class Unloaded(LookupError):
    """The training model is not live (unloaded, or never created)."""


@dataclass
class _Trainer:
    """A training model: resident (`client`) or spilled; `build` makes a fresh client of its
    LoRA settings, which the spill is loaded into."""

    build: Build
    client: LocalTrainingClient | None = None
    pins: int = 0  # its requests running now


@dataclass(frozen=True)
class _Sampler:
    drop: Callable[[], None]  # forget the loaded sampling model (its weights stay on disk)


class Residency:
    """The resident adapters, least recently used first, and the spilled training clients."""

    def __init__(
        self, limit: int | None, spill_dir: Path, compute: ComputeThread, wait_s: float = 60.0
    ) -> None:
        self.limit = limit
        self.spill_dir = spill_dir
        self.compute = compute
        self.wait_s = wait_s
        self._trainers: dict[str, _Trainer] = {}  # every live training model, by model id
        self._lru: OrderedDict[str, _Trainer | _Sampler] = OrderedDict()  # resident ones
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when an adapter may leave
        self._changes = 0  # such notices so far: a waiter sees whether one came meanwhile
        self._wakers: list[Callable[[], None]] = []  # `room`'s, told of the next notice
        self.spills = 0  # training clients written to disk so far
        self.reloads = 0  # and rebuilt from there
        self.sample_waits = 0  # waits of refused sample requests (`room`) so far
        # Spills of an earlier process: its models are unloaded, so they are debris.
        shutil.rmtree(spill_dir, ignore_errors=True)

    # training clients
    def create(self, model_id: str, build: Build) -> LocalTrainingClient:
        """Build a new training model's client on the compute thread, room made first. It is
        busy until `release`d (once registered) or `forget`-ten (if it never is)."""
        trainer = _Trainer(build, pins=1)
        with self._lock:
            self._trainers[model_id] = trainer
        try:
            return self._load(model_id, trainer)
        except BaseException:
            self.forget(model_id)
            raise

    def pinned(self, model_id: str, job: Job) -> Job:
        """`job`, with `model_id` busy while it runs (its client is not evicted meanwhile)."""

        def run() -> Outcome:
            with self.using(model_id):
                return job()

        return run

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[None]:
        with self._lock:
            trainer = self._trainers.get(model_id)
            if trainer is not None:
                trainer.pins += 1
        try:
            yield
        finally:
            if trainer is not None:
                self.release(model_id, trainer)

    def release(self, model_id: str, trainer: _Trainer | None = None) -> None:
        """One pin of `model_id` less (`create`'s, once the model is registered)."""
        with self._lock:
            trainer = trainer or self._trainers.get(model_id)
            if trainer is not None:
                trainer.pins -= 1
                self._wake()

    def client(self, model_id: str) -> LocalTrainingClient:
        """The model's client, reloaded from its spill if it left; call it from a request of
        the model's (`pinned`). Unloaded: no such live model."""
        with self._lock:
            trainer = self._trainers.get(model_id)
            if trainer is None:
                raise Unloaded(model_id)
            if trainer.client is not None and model_id in self._lru:
                self._lru.move_to_end(model_id)
                return trainer.client
            assert trainer.pins > 0, "reload a training client only inside its request"
        return self._load(model_id, trainer)

    def forget(self, model_id: str) -> LocalTrainingClient | None:
        """The model is unloaded: drop it and its spill. Returns its client to close, if it is
        resident (one being spilled now is closed by the spill)."""
        with self._lock:
            trainer = self._trainers.pop(model_id, None)
            resident = self._lru.pop(model_id, None) is not None
            self._wake()
        # After any spill or reload of it already queued there, so none writes it again.
        with contextlib.suppress(RuntimeError):  # the compute thread stopped: server exiting
            self.compute.submit(shutil.rmtree, self._spill_path(model_id), True)
        return trainer.client if trainer is not None and resident else None

    def _load(self, model_id: str, trainer: _Trainer) -> LocalTrainingClient:
        """Make room, then build the client (from its spill, if it has one), on the compute
        thread; wait on this thread while every resident adapter is busy."""
        deadline = time.monotonic() + self.wait_s
        while True:
            client, seen = self.compute.call(self._try_load, model_id, trainer)
            if client is not None:
                return client
            with self._lock:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoRoomError(self._no_room(f" (waited {self.wait_s:g} s for one)"))
                if self._changes == seen:
                    self._idle.wait(left)

    def _try_load(self, model_id: str, trainer: _Trainer) -> tuple[LocalTrainingClient | None, int]:
        """On the compute thread: (the client, _) once loaded; (None, `_changes` now) when
        nothing can leave yet."""
        with self._lock:
            if self._trainers.get(model_id) is not trainer:
                raise Unloaded(model_id)  # unloaded meanwhile
            if trainer.client is not None and model_id in self._lru:
                return trainer.client, 0  # its spill failed, so it stayed
            victims = self._victims()
            if victims is None:
                return None, self._changes
        self._evict(victims)
        client = trainer.build()
        try:
            path = self._spill_path(model_id)
            if path.exists():
                client.restore(path)
                shutil.rmtree(path)  # the memory copy is the state now
                self.reloads += 1
                log.info("adapter %s reloaded from disk", model_id)
        except BaseException:
            client.close()
            raise
        with self._lock:
            if self._trainers.get(model_id) is not trainer:
                client.close()
                raise Unloaded(model_id)
            trainer.client = client
            self._lru[model_id] = trainer
        return client, 0

    # sampling models
    def admit_sampler(self, key: str, drop: Callable[[], None]) -> None:
        """Before a LoRA sampling model loads (on the compute thread): make room for it."""
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return
            victims = self._victims()
            if victims is None:
                raise NoRoomError(self._no_room(""), self._changes)
            self._lru[key] = _Sampler(drop)
        self._evict(victims)

    async def room(self, refused: NoRoomError, since: float) -> None:
        """On the event loop, for a request `admit_sampler` refused: return once an adapter
        may leave (a request finished, a model unloaded) since the refusal, to try again; a
        NoRoomError once `wait_s` seconds have passed since `since` (loop time of the request's
        first refusal), as a training client's reload waits."""
        loop = asyncio.get_running_loop()
        freed: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not freed.done():
                freed.set_result(None)

        def wake() -> None:  # under the lock, on the thread that frees an adapter
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is exiting
                loop.call_soon_threadsafe(settle)

        with self._lock:
            if self._changes != refused.seen:
                return  # one left meanwhile
            self._wakers.append(wake)
            self.sample_waits += 1
        try:
            await asyncio.wait_for(freed, since + self.wait_s - loop.time())
        except TimeoutError:
            raise NoRoomError(self._no_room(f" (waited {self.wait_s:g} s for one)")) from None
        finally:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)

    def touch(self, key: str) -> None:
        """The sampling model `key` is used: it is the most recently used now."""
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)

    def forget_sampler(self, key: str) -> None:
        """The sampling model left the sampler cache (or failed to load)."""
        with self._lock:
            item = self._lru.get(key)
            if isinstance(item, _Sampler):
                del self._lru[key]

    # eviction
    def _victims(self) -> list[tuple[str, _Trainer | _Sampler]] | None:
        """Under the lock: take the least recently used idle adapters out of the resident set
        until one more fits; None (nothing taken) if too few are idle."""
        if self.limit is None:
            return []
        over = len(self._lru) + 1 - self.limit
        keys = [k for k, item in self._lru.items() if not _busy(item)][: max(over, 0)]
        if len(keys) < over:
            return None
        return [(k, self._lru.pop(k)) for k in keys]

    def _evict(self, victims: list[tuple[str, _Trainer | _Sampler]]) -> None:
        """On the compute thread: spill and close the training clients, drop the samplers. A
        spill that fails puts its client back (and the error goes to the request)."""
        for index, (key, item) in enumerate(victims):
            if isinstance(item, _Sampler):
                item.drop()
                log.info("adapter %s left memory (--max-resident-adapters %s)", key, self.limit)
                continue
            client = item.client
            assert client is not None
            try:
                client.spill(self._spill_path(key))
            except BaseException:
                with self._lock:  # the rest stay resident, as least recently used
                    for k, kept in reversed(victims[index:]):
                        if isinstance(kept, _Sampler) or self._trainers.get(k) is kept:
                            self._lru[k] = kept
                            self._lru.move_to_end(k, last=False)
                raise
            self.spills += 1
            log.info("adapter %s spilled to disk (--max-resident-adapters %s)", key, self.limit)
            with self._lock:
                item.client = None
                gone = self._trainers.get(key) is not item
            if gone:  # unloaded while it was written
                shutil.rmtree(self._spill_path(key), ignore_errors=True)
            client.close()

    def _wake(self) -> None:
        """Under the lock: an adapter may leave now (a pin released, a model unloaded)."""
        self._changes += 1
        self._idle.notify_all()
        for wake in self._wakers:
            wake()
        self._wakers.clear()

    def _no_room(self, waited: str) -> str:
        return (
            f"no room for another adapter: all {self.limit} resident adapters are busy with "
            f"requests{waited} (posttrain serve --max-resident-adapters {self.limit}); retry "
            "once one finishes, or restart the server with a larger --max-resident-adapters"
        )

    def _spill_path(self, model_id: str) -> Path:
        return self.spill_dir / model_id.replace(":", "_")

    def clients_in_memory(self) -> dict[str, LocalTrainingClient]:
        """The training clients in memory now (not spilled) by model id, for checks and tests."""
        with self._lock:
            return {m: t.client for m, t in self._trainers.items() if t.client is not None}

    def resident(self) -> list[str]:
        """The resident adapters' keys, least recently used first (for tests and logs)."""
        with self._lock:
            return list(self._lru)


def _busy(item: _Trainer | _Sampler) -> bool:
    return isinstance(item, _Trainer) and item.pins > 0
