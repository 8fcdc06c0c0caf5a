"""What runs behind the endpoints: live models, their ordered request lanes, samplers, futures.

Each live model has a lane (`server.lanes`) that runs its requests in `seq_id` order. A
request's outcome is written to the store before its waiters are woken, so `retrieve_future`
always reads it from one place, after a restart too.

Threads. torch computes on exactly one thread, `Runtime.compute` (one device per server): every
call of every model and sampler (forward, forward_backward, optim_step, sampling, prompt
logprobs, checkpoint saves and loads, model loading, and the spills and reloads of adapters
beyond --max-resident-adapters, `server.residency`) runs there, one at a time. Whose turn it is
is fair between tenants: a request's tenant is its Tinker session (a ServiceClient's training
and sampling clients), else its owner (`tenant_of`); `run` makes the job's calls that tenant's
(`server.fair_queue.as_tenant`), and among tenants with calls waiting the compute thread runs the
one that has used the least compute time; one tenant's calls keep their order. Two threads
computing at once would each run an OpenMP pool as large as the usable
cores and fight over them (see `posttrain.engine.threads`). The other threads only decide order
and wait: a model's lane thread hands that model's requests to the compute thread in `seq_id`
order and waits for each; `admin` does the same for creating models; `asyncio.to_thread`
callers of `sampler` wait for a sampler to load there. A sampling request runs whole on the
compute thread (`sampling` is the compute thread), so loading its sampler, sampling and scoring
the prompt take one turn there, not three. What runs off the compute thread computes nothing
with torch: SQLite writes, JSON and protobuf encoding, directory deletes (`files`).

Memory. The base model's weights are in memory once (`models.shared_base`): every LoRA
training client and every sampler, the base model's own included, is a module tree of its own
over those tensors, with its own adapter, optimizer state and generator. A client costs its
adapter and AdamW moments; a sampler of saved weights costs its adapter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.checkpoint import is_complete_checkpoint
from posttrain.engine.compute_thread import ComputeThread
from posttrain.inference.model_sampler import ModelSampler
from posttrain.models.shared_base import SharedBases
from posttrain.server.config import ServerConfig, model_config_int
from posttrain.server.fair_queue import FairQueue, as_tenant
from posttrain.server.lanes import Job, Lane, UserError, category_of
from posttrain.server.residency import Residency, Unloaded
from posttrain.server.sampler_cache import SamplerCache
from posttrain.server.sources import UnknownModelError
from posttrain.server.store import FutureRow, ModelRow, SamplerRow, Store

log = logging.getLogger(__name__)

RESTARTED = "the server restarted before this request finished; submit it again"


class Runtime:
    """Live models and samplers of one server process; implements SamplerSource."""

    def __init__(self, config: ServerConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.lanes: dict[str, Lane] = {}
        self.live_sessions: dict[str, str] = {}  # live model id -> its session id
        self._reaper: asyncio.Task[None] | None = None
        self._events: dict[str, asyncio.Event] = {}
        # One copy of the base model's weights, which every client reads (module doc).
        self.bases = SharedBases()
        # The only thread where torch computes, shared fairly between tenants.
        self.compute = ComputeThread("compute", queue=FairQueue())
        # The training clients, and which adapters are in memory (--max-resident-adapters).
        self.residency = Residency(
            config.max_resident_adapters, config.storage_dir / "spilled-adapters", self.compute
        )
        self.samplers = SamplerCache(
            config.sampler_cache_size,
            self._load_sampler,
            lambda key: self.residency.forget_sampler(_sampler_key(key)),
        )
        self.admin = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="admin")
        # Deletes get their own thread: they must not wait behind a client.close on admin.
        self.files = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="files")
        # Sampling jobs run whole on the compute thread: one turn per request (module doc).
        self.sampling = self.compute
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_context_length = model_config_int(config.model_path, "max_position_embeddings")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "Runtime.start was not called"
        return self._loop

    @property
    def seq_gap_timeout(self) -> float:
        return self.config.seq_gap_timeout

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.store.fail_pending(RESTARTED)
        self._reaper = loop.create_task(self._reap_expired_sessions())

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for lane in self.lanes.values():
            lane.close("the server is shutting down")
        self.admin.shutdown(wait=False, cancel_futures=True)
        self.files.shutdown(wait=False, cancel_futures=True)
        self.compute.close(wait=False)

    # futures
    def run(self, request_id: str, job: Job, tenant: str | None = None) -> None:
        """Run `job` on the calling (worker) thread and record its outcome; what it submits to
        the compute thread is the request's tenant's (`tenant`, else `tenant_of`)."""
        try:
            with as_tenant(tenant or self.tenant_of(request_id)):
                outcome = job()
        except Exception as exc:
            if category_of(exc) == "server":
                traceback.print_exc()
            self.fail(request_id, str(exc) or type(exc).__name__, category_of(exc))
            return
        payload = None if outcome.json is None else json.dumps(finite_json(outcome.json)).encode()
        self.store.complete_future(request_id, payload, outcome.proto)
        self._notify(request_id)

    def fail(self, request_id: str, error: str, category: str = "user") -> None:
        self.store.fail_future(request_id, error, category)
        self._notify(request_id)

    def submit(
        self, pool: concurrent.futures.Executor | ComputeThread, request_id: str, job: Job
    ) -> None:
        if isinstance(pool, ComputeThread):  # the job runs whole there, in its tenant's turn
            tenant = self.tenant_of(request_id)
            pool.submit(self.run, request_id, job, tenant, tenant=tenant)
        else:
            pool.submit(self.run, request_id, job)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant the compute thread is fair between (module doc): the session of the
        request's model or sampling session, else "owner:<key hash>"."""
        return self.store.tenant(request_id)

    def submit_ordered(self, model_id: str, seq_id: int, request_id: str, job: Job) -> None:
        lane = self.lanes.get(model_id)
        if lane is None:
            self.fail(request_id, not_loaded(model_id))
            return
        # Busy while it runs: its model's client is not evicted under it.
        lane.submit(seq_id, request_id, self.residency.pinned(model_id, job))

    def _notify(self, request_id: str) -> None:
        def wake() -> None:
            event = self._events.pop(request_id, None)
            if event is not None:
                event.set()

        if self._loop is not None:
            self._loop.call_soon_threadsafe(wake)

    async def wait(self, request_id: str, owner: str, timeout: float) -> FutureRow | None:
        """The future's row once it is finished, or still pending after `timeout` seconds."""
        event = self._events.setdefault(request_id, asyncio.Event())
        row = self.store.future(request_id, owner)
        if row is None or row.status != "pending":
            self._events.pop(request_id, None)
            return row
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return self.store.future(request_id, owner)

    # models
    def build_client(
        self, model_id: str, lora: dict[str, int | bool], seed: int
    ) -> LocalTrainingClient:
        """Load the base model with a fresh LoRA adapter; called from a worker thread, it loads
        on the compute thread (loading computes: LoRA init, weight copies), where the client's
        calls run too. The client is busy (never evicted) until `add_model` registers it or
        `discard_client` drops it."""
        build = functools.partial(self._new_client, self.model_dir(model_id), lora, seed)
        return self.residency.create(model_id, build)

    def _new_client(
        self, storage: Path, lora: dict[str, int | bool] | None, seed: int = 0
    ) -> LocalTrainingClient:
        """The base model, with a fresh LoRA adapter when `lora` is given (None: the base model
        alone, for sampling it); run it on the compute thread. Both read the one copy of the
        base's weights in `bases`: a client costs its adapter and optimizer, not a model."""
        if lora is None:
            return create_training_client(
                self.config.model_path,
                device=self.config.device,
                storage_dir=storage,
                compute_thread=self.compute,
                lora_rank=None,
                head="reference",  # never trained: it may share the weights
                shared_base=self.bases,
            )
        client = create_training_client(
            self.config.model_path,
            lora_rank=int(lora["rank"]),
            train_attn=bool(lora["train_attn"]),
            train_mlp=bool(lora["train_mlp"]),
            train_unembed=bool(lora["train_unembed"]),
            device=self.config.device,
            seed=seed,
            storage_dir=storage,
            compute_thread=self.compute,
            shared_base=self.bases,
        )
        client.dispatch.set_packing(self.config.packing)  # on this thread: no queue to wait on
        return client

    def model_dir(self, model_id: str) -> Path:
        return self.config.storage_dir / "runs" / model_id.replace(":", "_")

    def check_live(self, row: ModelRow) -> None:
        """A user error if the session that asks for the model has finished (or expired)."""
        if self.store.session_state(row.session_id, row.owner) != "live":
            raise UserError(
                f"session {row.session_id} finished while model {row.model_id} was loading"
            )

    def add_model(self, row: ModelRow, client: LocalTrainingClient) -> None:
        """From the job that built the model: records and registers it on the event loop (where
        sessions are unloaded, so the two never interleave) and returns once it is live. The
        session check, the `models` row and the live model happen together or not at all; if
        not, the client (a full model copy) is closed."""

        async def register() -> None:
            self.check_live(row)
            self.store.add_model(row)
            self.lanes[row.model_id] = Lane(self, row.model_id)
            self.live_sessions[row.model_id] = row.session_id

        try:
            asyncio.run_coroutine_threadsafe(register(), self.loop).result()
        except BaseException:
            self.discard_client(row.model_id, client)
            raise
        self.residency.release(row.model_id)  # `build_client`'s pin: idle until a request

    def discard_client(self, model_id: str, client: LocalTrainingClient) -> None:
        """Drop a client `build_client` made that never became a live model."""
        self.residency.forget(model_id)
        client.close()

    def client(self, model_id: str) -> LocalTrainingClient:
        """The live model's client (for jobs, which `submit_ordered` keeps it in memory for;
        reloaded if it was spilled); a user error once the model was unloaded."""
        try:
            return self.residency.client(model_id)
        except Unloaded:
            raise UserError(not_loaded(model_id)) from None

    # unloading: a session's models and ephemeral samplers go when it finishes or expires
    def unload_session(self, session_id: str) -> None:
        """Called on the event loop. Named checkpoints stay; the rest of the session goes."""
        for model_id in [m for m, s in self.live_sessions.items() if s == session_id]:
            self.unload_model(model_id)
        for row in self.store.ephemeral_samplers(session_id):
            assert row.weights_dir is not None
            self.background(
                self.files, f"deleting {row.weights_dir}", self.drop_weights, row.weights_dir
            )

    def unload_model(self, model_id: str) -> None:
        """Called on the event loop; unloading twice is harmless."""
        self.live_sessions.pop(model_id, None)
        lane = self.lanes.pop(model_id, None)
        client = self.residency.forget(model_id)
        if lane is not None:
            lane.close(not_loaded(model_id))
        if client is not None:
            # close() waits for the call in flight, so not on the event loop; the client (and
            # its model) is freed once that call has finished with it.
            self.background(self.admin, f"closing model {model_id}", client.close)

    def background(
        self, pool: concurrent.futures.Executor, what: str, fn: Callable[..., object], *args: object
    ) -> concurrent.futures.Future[object]:
        """Run `fn(*args)` on `pool`; nobody waits for it, so a failure is logged here."""

        def report(future: concurrent.futures.Future[object]) -> None:
            if not future.cancelled() and future.exception() is not None:
                exc = future.exception()
                assert exc is not None
                log.error("%s failed", what, exc_info=(type(exc), exc, exc.__traceback__))

        future = pool.submit(fn, *args)
        future.add_done_callback(report)
        return future

    async def _reap_expired_sessions(self) -> None:
        timeout = self.config.session_timeout
        while True:
            await asyncio.sleep(min(timeout / 2, 30.0))
            try:
                self.reap_expired_sessions(time.time() - timeout)
            except Exception:
                # One bad iteration (a locked database, a failing unload) must not end the
                # reaper: sessions would then never expire. The next iteration tries again.
                log.exception(
                    "expiring sessions failed; retrying in %.3g s", min(timeout / 2, 30.0)
                )

    def reap_expired_sessions(self, cutoff: float) -> None:
        """Finish the sessions without a heartbeat since `cutoff` and unload them."""
        for session_id in self.store.expire_sessions(cutoff):
            self.unload_session(session_id)

    # samplers
    def sampler_client(
        self, weights_dir: str | None, lora: dict[str, int | bool] | None
    ) -> LocalTrainingClient:
        """A cached sampling model: the base model (weights_dir None) or saved weights.
        Called on the compute thread only (`server.sampler_cache`)."""
        client = self.samplers.get(weights_dir, lora)
        if weights_dir is not None and lora is not None:
            self.residency.touch(_sampler_key(weights_dir))
        return client

    def evict_weights(self, weights_dir: str) -> None:
        """Forget the sampler loaded from `weights_dir` (its files changed or went away)."""
        self.samplers.evict(weights_dir)

    def drop_weights(self, weights_dir: str) -> None:
        """Evict the sampler of `weights_dir`, then delete the directory."""
        self.samplers.drop(weights_dir)

    def _load_sampler(
        self, weights_dir: str | None, lora: dict[str, int | bool] | None
    ) -> LocalTrainingClient:
        """The sampling model, loaded on the compute thread (see `build_client`)."""
        storage = self.config.storage_dir / "sampler-scratch"
        if weights_dir is None or lora is None:
            return self.compute.call(self._new_client, storage, None)
        # Checked before loading a model for nothing; also puts back a checkpoint whose
        # replacement a kill interrupted (engine.atomic_replace), where renames are not atomic.
        if not is_complete_checkpoint(weights_dir):
            raise UserError(f"the weights of this sampler are gone (no checkpoint {weights_dir})")

        def load() -> LocalTrainingClient:
            key = _sampler_key(weights_dir)
            # Room first: with --max-resident-adapters, an idle adapter may leave for it.
            self.residency.admit_sampler(key, lambda: self.samplers.evict(weights_dir))
            try:
                client = self._new_client(storage, lora)
                # On the compute thread already, so the load runs inline.
                client.load_state(weights_dir, with_optimizer=False).result()
            except BaseException:
                self.residency.forget_sampler(key)
                raise
            return client

        return self.compute.call(load)

    def sampler_for_row(self, row: SamplerRow) -> LocalTrainingClient:
        return self.sampler_client(row.weights_dir, row.lora)

    # SamplerSource, for the OpenAI-compatible endpoints
    def model_names(self, owner: str | None) -> list[str]:
        names = [self.config.base_model]
        if owner is not None:
            names += [c.tinker_path for c in self.store.checkpoints(owner) if c.kind == "sampler"]
        return names

    def sampler(self, name: str, owner: str | None) -> ModelSampler:
        """Called from a worker thread; the sampler loads on the compute thread, where the
        sampler cache lives (its lock is never held by a thread waiting for compute)."""
        if self.config.serves(name):
            client = self.compute.call(self.sampler_client, None, None)
            return ModelSampler(client, client.get_tokenizer())
        row = self.store.checkpoint(name, owner) if owner is not None else None
        if row is None or row.kind != "sampler":
            raise UnknownModelError(f"model {name!r} is not served")
        model = self.store.model(row.model_id, row.owner)
        if model is None:
            raise UnknownModelError(f"model {name!r} is not served")
        client = self.compute.call(self.sampler_client, row.dir, model.lora)
        return ModelSampler(client, client.get_tokenizer())


def finite_json(value: object) -> object:
    """`value` with each non-finite float as the string "NaN", "Infinity" or "-Infinity": JSON
    has no such numbers (the SDK's parser refuses `NaN`), and pydantic reads these strings back
    as floats. A skipped optim_step reports grad_norm NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def not_loaded(model_id: str) -> str:
    return (
        f"model {model_id} is not loaded: its session finished or expired, or the server "
        "restarted; create a training client from one of its checkpoints"
    )


def _sampler_key(weights_dir: str) -> str:
    """A LoRA sampling model's key among the resident adapters (`server.residency`)."""
    return f"sampler:{Path(weights_dir)}" if weights_dir else "sampler:"
