"""The Tinker HTTP protocol (spec sections 3-8): handshake, sessions, models, training, sampling
and futures, under /api/v1.

Submissions are validated, written as a pending future (deduplicated on the model and
`seq_id`), and handed to the runtime; results are fetched with `retrieve_future`. Another
owner's ids are answered exactly like unknown ones. A request refused before it is queued still
takes its `seq_id`'s turn in the model's order (`release_turn`), and a failed request's message
names checkpoints by the client's tinker:// paths, never by the server's storage paths.
Checkpoint and sampling endpoints live in `tinker_checkpoints` and `tinker_sampling`.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response

from posttrain.algo.losses import LossConfig
from posttrain.server import tinker_schema as s
from posttrain.server.lanes import Job, Outcome, UserError, category_of
from posttrain.server.proto import (
    BodyTooLarge,
    ProtocolError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    forward_backward_output_json,
)
from posttrain.server.runtime import Runtime
from posttrain.server.store import (
    CheckpointRow,
    DuplicateRequest,
    ModelRow,
)
from posttrain.types import AdamParams

PROTOBUF = "application/x-protobuf"
# Routes whose requests take a turn in their model's seq_id order.
ORDERED_ROUTES = frozenset(
    f"/api/v1/{name}"
    for name in (
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "save_weights_external",
        "load_weights",
    )
)
# Refusals the SDK retries with the same seq_id: the turn stays free for the retry.
RETRIED_STATUSES = frozenset({408, 409, 429})
ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def owner(request: Request) -> str:
    """The caller's identity, set by the auth middleware on every request."""
    return request.state.owner


def not_found(what: str) -> HTTPException:
    return HTTPException(404, f"{what} not found")


def release_turn(runtime: Runtime, who: str, model_id: object, seq_id: object) -> None:
    """A request for (`model_id`, `seq_id`) was refused before it was queued: its turn in the
    model's order passes, so the caller's later requests do not wait `seq_gap_timeout` for it.

    Only for the caller's own live model, so that nobody moves another caller's model on.
    """
    if not isinstance(model_id, str) or s.unencodable_text(model_id) is not None:
        return
    if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id <= s.INT64_MAX:
        return
    if runtime.store.model(model_id, who) is None:
        return
    lane = runtime.lanes.get(model_id)
    if lane is not None:
        lane.skip(seq_id)


def client_terms(text: str, names: Mapping[str, str]) -> str:
    """`text` with each server path in `names` replaced by the client's name for it (longest
    first, so a directory inside another is named by its own entry)."""
    for path in sorted(names, key=len, reverse=True):
        text = text.replace(path, names[path])
    return text


def in_client_terms(job: Job, names: Mapping[str, str]) -> Job:
    """`job`, whose failure message names what the client named (tinker:// paths, the base
    model) rather than the server's storage paths; the server log keeps the original."""

    def run() -> Outcome:
        try:
            return job()
        except Exception as exc:
            message = client_terms(str(exc), names)
            if message == str(exc):
                raise
            error = UserError if category_of(exc) == "user" else RuntimeError
            raise error(message) from exc

    return run


def adam_params(body: s.OptimParams | None) -> AdamParams:
    """The step's AdamParams; 400 naming the setting for anything AdamW cannot take."""
    body = body or s.OptimParams()
    if body.type not in ("adamw", "adam"):
        raise HTTPException(400, f"optimizer {body.type!r} is not supported; the model uses adamw")
    if body.model_extra:
        raise HTTPException(
            400,
            f"unknown AdamW setting(s) {', '.join(sorted(body.model_extra))}; "
            f"AdamW takes {', '.join(ADAM_FIELDS)}",
        )
    try:
        return AdamParams(**{name: getattr(body, name) for name in ADAM_FIELDS})
    except ValueError as err:
        raise HTTPException(400, str(err)) from None


class Api:
    """Handlers share the runtime; each method is one endpoint."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.store = runtime.store
        self.config = runtime.config

    # helpers
    def session(self, session_id: str, who: str) -> None:
        """A live session of the caller: 404 if unknown, 410 once finished (or expired)."""
        state = self.store.session_state(session_id, who)
        if state is None:
            raise not_found(f"session {session_id!r}")
        if state == "finished":
            raise HTTPException(410, f"session {session_id!r} has finished; create a new one")

    def model(self, model_id: str, who: str) -> ModelRow:
        row = self.store.model(model_id, who)
        if row is None:
            raise not_found(f"model {model_id!r}")
        return row

    def checkpoint(self, path: str, who: str) -> CheckpointRow:
        row = self.store.checkpoint(path, who)
        if row is None:
            raise not_found(f"checkpoint {path!r}")
        return row

    @contextmanager
    def turn(self, who: str, model_id: object, seq_id: object) -> Iterator[None]:
        """Around an ordered request's checks: a refusal (4xx) still passes its turn."""
        try:
            yield
        except HTTPException as exc:
            if exc.status_code < 500 and exc.status_code not in RETRIED_STATUSES:
                release_turn(self.rt, who, model_id, seq_id)
            raise

    def path_names(self, model_id: str | None = None) -> dict[str, str]:
        """Server paths -> the names the client knows them by: a model's checkpoint folders,
        the base model, then anything else under the storage folder."""
        names = {str(self.config.storage_dir): "<server storage>"}
        names[str(self.config.storage_dir.resolve())] = "<server storage>"
        if self.config.model_path != self.config.base_model:
            names[self.config.model_path] = self.config.base_model
        if model_id is not None:
            run = self.rt.model_dir(model_id)
            for folder, segment in (("checkpoints", "weights"), ("sampler_weights",) * 2):
                names[str(run / folder)] = f"tinker://{model_id}/{segment}"
                names[str(run.resolve() / folder)] = f"tinker://{model_id}/{segment}"
        return names

    def check_base_model(self, name: str) -> None:
        if not self.config.serves(name):
            raise HTTPException(
                400,
                f"base model {name!r} is not served here; this server serves "
                f"{self.config.base_model!r}",
            )

    async def new_future(
        self,
        request: Request,
        kind: str,
        dedup_key: str | None,
        model_id: str | None = None,
        seq_id: int | None = None,
    ) -> tuple[str, bool]:
        """(request_id, is_new): a retried submission with the same payload gets its first id."""
        digest = hashlib.sha256(await request.body()).hexdigest()
        request_id = uuid.uuid4().hex
        try:
            self.store.add_future(
                request_id,
                owner(request),
                kind,
                digest,
                dedup_key=dedup_key,
                model_id=model_id,
                seq_id=seq_id,
            )
        except DuplicateRequest as dup:
            old = dup.existing
            if old.owner != owner(request):
                raise not_found(f"model {model_id!r}") from None
            if old.payload_hash != digest or old.request_type != kind:
                raise HTTPException(
                    409,
                    f"{dedup_key} was already submitted with a different payload "
                    f"(request {old.request_id}); a retry must resend the same request",
                ) from None
            return old.request_id, False
        return request_id, True

    async def ordered(
        self,
        request: Request,
        kind: str,
        model: ModelRow,
        seq_id: int,
        job: Job,
        names: Mapping[str, str] | None = None,
    ) -> dict[str, object]:
        """Queue `job` in the model's seq_id order; `names` (server path -> the client's name)
        add to `path_names` for its error message."""
        rid, new = await self.new_future(
            request, kind, f"{model.model_id}#{seq_id}", model.model_id, seq_id
        )
        if new:
            self.store.touch_model(model.model_id)
            job = in_client_terms(job, {**self.path_names(model.model_id), **(names or {})})
            self.rt.submit_ordered(model.model_id, seq_id, rid, job)
        return {"request_id": rid, "model_id": model.model_id}

    # handshake and sessions
    async def create_session(self, body: s.CreateSession, request: Request) -> dict[str, object]:
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        metadata = dict(body.user_metadata or {})
        self.store.add_session(session_id, owner(request), body.tags, metadata, body.sdk_version)
        return {"session_id": session_id, "type": "create_session"}

    async def heartbeat(self, body: s.SessionRef, request: Request) -> dict[str, object]:
        # 410 for a finished session is what stops the SDK's heartbeat loop.
        self.session(body.session_id, owner(request))
        self.store.touch_session(body.session_id, owner(request))
        return {"type": "session_heartbeat"}

    async def finish_session(
        self, session_id: str, request: Request, body: s.FinishSession | None = None
    ) -> dict[str, object]:
        """The session's models are unloaded and its snapshot samplers deleted; its named
        checkpoints stay. Finishing twice is fine."""
        reason = body.reason.type if body is not None and body.reason is not None else "finished"
        if not self.store.touch_session(session_id, owner(request), finished=reason):
            raise not_found(f"session {session_id!r}")
        self.rt.unload_session(session_id)
        return {}

    # models
    async def create_model(self, body: s.CreateModel, request: Request) -> dict[str, object]:
        who = owner(request)
        self.session(body.session_id, who)
        self.check_base_model(body.base_model)
        lora = body.lora_config or s.LoraConfig()
        if not 1 <= lora.rank <= self.config.lora_rank_max:
            raise HTTPException(
                400, f"lora rank must be in [1, {self.config.lora_rank_max}], got {lora.rank}"
            )
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise HTTPException(400, "LoRA needs one of train_attn, train_mlp, train_unembed")
        if body.optimizer_config.type != "adamw":
            raise HTTPException(400, f"optimizer {body.optimizer_config.type!r}: only adamw")
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        rid, new = await self.new_future(request, "create_model", f"create:{model_id}", model_id)
        if new:
            settings = lora.model_dump(exclude={"seed"})
            seed = lora.seed if lora.seed is not None else secrets.randbits(31)
            row = ModelRow(
                model_id,
                who,
                body.session_id,
                self.config.base_model,
                settings,
                str_dict(body.user_metadata),
                time.time(),
                time.time(),
            )

            def job() -> Outcome:
                self.rt.check_live(row)  # before loading a full model copy for nothing
                self.rt.add_model(row, self.rt.build_client(model_id, settings, seed))
                return Outcome({"model_id": model_id, "type": "create_model"})

            self.rt.submit(self.rt.admin, rid, in_client_terms(job, self.path_names(model_id)))
        return {"request_id": rid, "model_id": model_id}

    async def get_info(self, body: s.ModelRef, request: Request) -> dict[str, object]:
        row = self.model(body.model_id, owner(request))
        return {
            "model_id": row.model_id,
            "model_data": {"model_name": row.base_model, "tokenizer_id": self.config.model_path},
            "is_lora": True,
            "lora_rank": row.lora["rank"],
            "model_name": row.base_model,
            "optimizer_config": {"type": "adamw"},
            "type": "get_info",
        }

    async def unload_model(self, body: s.ModelRef, request: Request) -> dict[str, object]:
        """Free a live model now rather than when its session ends (SkyRL's route; the SDK has
        its request and response types). Its requests not yet running fail; its checkpoints
        stay. A future, as in the protocol, already complete when this answers."""
        model = self.model(body.model_id, owner(request))
        rid, _ = await self.new_future(request, "unload_model", None, model.model_id)
        self.rt.unload_model(model.model_id)  # unloading twice is harmless
        self.rt.run(rid, lambda: Outcome({"model_id": model.model_id, "type": "unload_model"}))
        return {"request_id": rid, "model_id": model.model_id}

    # training
    async def forward_backward(self, request: Request) -> dict[str, object]:
        who = owner(request)
        try:
            req = decode_forward_backward_request(
                await request.body(),
                request.headers.get("content-encoding"),
                self.config.max_body_bytes,
            )
        except BodyTooLarge as err:
            raise HTTPException(413, str(err)) from None
        except ProtocolError as err:
            release_turn(self.rt, who, err.model_id, err.seq_id)
            raise HTTPException(400, f"malformed ForwardBackwardRequest protobuf: {err}") from None
        model = self.model(req.model_id, who)

        def job() -> Outcome:
            client = self.rt.client(req.model_id)
            call = client.forward if req.forward_only else client.forward_backward
            # Tinker's wire keys -> LossConfig (algo.loss_wire, the one reader of them).
            config = LossConfig.from_mapping(req.loss_fn_config, req.loss_fn)
            out = call(req.data, req.loss_fn, config).result()
            return Outcome(None, encode_forward_backward_output(out))

        kind = "forward" if req.forward_only else "forward_backward"
        return await self.ordered(request, kind, model, req.seq_id, job)

    async def optim_step(self, body: s.OptimStep, request: Request) -> dict[str, object]:
        who = owner(request)
        with self.turn(who, body.model_id, body.seq_id):
            model = self.model(body.model_id, who)
            params = adam_params(body.adam_params or body.optim_params or body.optimizer_params)

        def job() -> Outcome:
            result = self.rt.client(model.model_id).optim_step(params).result()
            return Outcome({"metrics": result.metrics or {}, "type": "optim_step"})

        return await self.ordered(request, "optim_step", model, body.seq_id, job)

    # futures
    async def retrieve_future(self, body: s.RetrieveFuture, request: Request) -> Any:
        row = await self.rt.wait(body.request_id, owner(request), self.config.poll_timeout)
        if row is None:
            raise not_found(f"request {body.request_id!r}")
        if row.status == "pending":
            return {"type": "try_again", "request_id": row.request_id, "queue_state": "active"}
        if row.status == "failed":
            return {"error": row.error or "failed", "category": row.category or "unknown"}
        if row.result_proto is not None and PROTOBUF in request.headers.get("accept", ""):
            return Response(row.result_proto, media_type=PROTOBUF)
        if row.result_json is None and row.result_proto is not None:  # a forward pass
            # Hundreds of ms for a large batch: off the event loop, which serves every client.
            return await asyncio.to_thread(forward_backward_output_json, row.result_proto)
        return Response(row.result_json or b"{}", media_type="application/json")


def str_dict(values: dict[str, Any] | None) -> dict[str, str]:
    """user_metadata as the SDK reads it back: string values only."""
    return {str(k): v if isinstance(v, str) else str(v) for k, v in (values or {}).items()}


def create_tinker_router(runtime: Runtime) -> APIRouter:
    """The protocol's endpoints under /api/v1."""
    from posttrain.server.tinker_checkpoints import CheckpointApi
    from posttrain.server.tinker_external import add_external_routes
    from posttrain.server.tinker_sampling import SamplingApi

    api = Api(runtime)
    router = APIRouter(prefix="/api/v1")
    post, get = router.post, router.get
    post("/create_session")(api.create_session)
    post("/session_heartbeat")(api.heartbeat)
    post("/sessions/{session_id}/finish")(api.finish_session)
    post("/create_model")(api.create_model)
    post("/get_info")(api.get_info)
    post("/unload_model")(api.unload_model)
    post("/forward_backward")(api.forward_backward)
    post("/optim_step")(api.optim_step)
    checkpoints = CheckpointApi(api)
    post("/save_weights")(checkpoints.save_weights)
    post("/save_weights_for_sampler")(checkpoints.save_for_sampler)
    post("/load_weights")(checkpoints.load_weights)
    add_external_routes(router, api)
    sampling = SamplingApi(api)
    post("/create_sampling_session")(sampling.create_sampling_session)
    get("/samplers/{sampler_id}")(sampling.get_sampler)
    post("/asample")(sampling.asample)
    get("/sample_batching")(sampling.batching_stats)
    post("/retrieve_future")(api.retrieve_future)
    return router
