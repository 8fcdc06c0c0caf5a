"""The Tinker HTTP protocol (spec sections 3-8): handshake, sessions, models, training, sampling
and futures, under /api/v1.

Submissions are validated, written as a pending future (deduplicated on the model and
`seq_id`), and handed to the runtime; results are fetched with `retrieve_future`. Another
owner's ids are answered exactly like unknown ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response

from posttrain.server import tinker_schema as s
from posttrain.server.proto import (
    ProtocolError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    forward_backward_output_json,
)
from posttrain.server.runtime import Job, Outcome, Runtime, UserError
from posttrain.server.store import (
    CheckpointKind,
    CheckpointRow,
    DuplicateRequest,
    ModelRow,
    SamplerRow,
)
from posttrain.types import AdamParams

PROTOBUF = "application/x-protobuf"


def owner(request: Request) -> str:
    """The caller's identity, set by the auth middleware on every request."""
    return request.state.owner


def not_found(what: str) -> HTTPException:
    return HTTPException(404, f"{what} not found")


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
        self, request: Request, kind: str, model: ModelRow, seq_id: int, job: Job
    ) -> dict[str, object]:
        rid, new = await self.new_future(
            request, kind, f"{model.model_id}#{seq_id}", model.model_id, seq_id
        )
        if new:
            self.store.touch_model(model.model_id)
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

    async def finish_session(self, session_id: str, request: Request) -> dict[str, object]:
        """The session's models are unloaded and its snapshot samplers deleted; its named
        checkpoints stay. Finishing twice is fine."""
        try:
            reason = str((await request.json()).get("reason", {}).get("type", "finished"))
        except (ValueError, AttributeError):
            reason = "finished"
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
                _str_dict(body.user_metadata),
                time.time(),
                time.time(),
            )

            def job() -> Outcome:
                self.rt.check_live(row)  # before loading a full model copy for nothing
                self.rt.add_model(row, self.rt.build_client(model_id, settings, seed))
                return Outcome({"model_id": model_id, "type": "create_model"})

            self.rt.submit(self.rt.admin, rid, job)
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
        try:
            req = decode_forward_backward_request(
                await request.body(), request.headers.get("content-encoding")
            )
        except ProtocolError as err:
            raise HTTPException(400, f"malformed ForwardBackwardRequest protobuf: {err}") from None
        model = self.model(req.model_id, owner(request))

        def job() -> Outcome:
            client = self.rt.client(req.model_id)
            call = client.forward if req.forward_only else client.forward_backward
            out = call(req.data, req.loss_fn, req.loss_fn_config).result()
            return Outcome(None, encode_forward_backward_output(out))

        kind = "forward" if req.forward_only else "forward_backward"
        return await self.ordered(request, kind, model, req.seq_id, job)

    async def optim_step(self, body: s.OptimStep, request: Request) -> dict[str, object]:
        model = self.model(body.model_id, owner(request))
        params = dict(body.adam_params or body.optim_params or body.optimizer_params or {})

        def job() -> Outcome:
            kind = params.pop("type", "adamw")
            if kind not in ("adamw", "adam"):
                raise UserError(f"optimizer {kind!r} is not supported; the model uses adamw")
            result = self.rt.client(model.model_id).optim_step(AdamParams(**params)).result()
            return Outcome({"metrics": result.metrics or {}, "type": "optim_step"})

        return await self.ordered(request, "optim_step", model, body.seq_id, job)

    async def save_weights(self, body: s.SaveWeights, request: Request) -> dict[str, object]:
        model = self.model(body.model_id, owner(request))
        name = body.path or f"checkpoint-{body.seq_id}"
        job = self.save_job(model, "weights", name, body.overwrite, body.user_metadata)
        return await self.ordered(request, "save_weights", model, body.seq_id, job)

    def save_job(
        self,
        model: ModelRow,
        kind: CheckpointKind,
        name: str,
        overwrite: bool,
        metadata: dict[str, str] | None,
    ) -> Job:
        segment = "weights" if kind == "weights" else "sampler_weights"
        tinker_path = f"tinker://{model.model_id}/{segment}/{name}"

        def job() -> Outcome:
            previous = self.store.checkpoint(tinker_path, model.owner)
            if not overwrite and previous is not None:
                raise UserError(f"checkpoint {tinker_path} exists; save with overwrite=True")
            client = self.rt.client(model.model_id)
            save = client.save_state if kind == "weights" else client.save_weights_for_sampler
            # The save replaces the directory atomically (a failed save keeps the old one), so
            # an overwrite only has to evict the sampler loaded from the old files, after it.
            directory = save(name).result().path
            if previous is not None:
                self.rt.evict_weights(previous.dir)
            self.store.add_checkpoint(
                CheckpointRow(
                    tinker_path,
                    model.owner,
                    model.model_id,
                    kind,
                    name,
                    directory,
                    dict(metadata or {}),
                    _dir_size(directory),
                    time.time(),
                )
            )
            kind_name = "save_weights" if kind == "weights" else "save_weights_for_sampler"
            return Outcome({"path": tinker_path, "type": kind_name})

        return job

    async def save_for_sampler(
        self, body: s.SaveWeightsForSampler, request: Request
    ) -> dict[str, object]:
        model = self.model(body.model_id, owner(request))
        if body.path:
            job = self.save_job(model, "sampler", body.path, True, body.user_metadata)
            return await self.ordered(request, "save_weights_for_sampler", model, body.seq_id, job)
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"

        def ephemeral() -> Outcome:
            client = self.rt.client(model.model_id)
            directory = client.save_weights_for_sampler(f".ephemeral-{sampler_id}").result().path
            self.store.add_sampler(
                SamplerRow(
                    sampler_id,
                    model.owner,
                    model.session_id,
                    model.base_model,
                    None,
                    directory,
                    model.lora,
                )
            )
            return Outcome({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

        return await self.ordered(
            request, "save_weights_for_sampler", model, body.seq_id, ephemeral
        )

    async def load_weights(self, body: s.LoadWeights, request: Request) -> dict[str, object]:
        who = owner(request)
        ckpt = self.checkpoint(body.path, who)
        if body.optimizer and ckpt.kind != "weights":
            raise HTTPException(400, f"{body.path} holds sampler weights: no optimizer state")
        source = self.store.model(ckpt.model_id, who)
        if source is None:
            raise not_found(f"checkpoint {body.path!r}")
        if body.model_id is not None:
            model = self.model(body.model_id, who)
            if body.seq_id is None:
                raise HTTPException(400, "load_weights on an existing model needs seq_id")

            def load() -> Outcome:
                client = self.rt.client(model.model_id)
                client.load_state(ckpt.dir, with_optimizer=body.optimizer).result()
                return Outcome({"path": body.path, "type": "load_weights"})

            return await self.ordered(request, "load_weights", model, body.seq_id, load)
        return await self.create_from_checkpoint(body, request, ckpt, source)

    async def create_from_checkpoint(
        self, body: s.LoadWeights, request: Request, ckpt: CheckpointRow, source: ModelRow
    ) -> dict[str, object]:
        """load_weights as a model's first request: the model comes from the checkpoint."""
        who = owner(request)
        if body.session_id is None or body.model_seq_id is None:
            raise HTTPException(400, "load_weights needs model_id, or session_id and model_seq_id")
        self.session(body.session_id, who)
        self.check_base_model(source.base_model)
        if body.base_model is not None:
            self.check_base_model(body.base_model)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        rid, new = await self.new_future(request, "load_weights", f"create:{model_id}", model_id)
        if new:
            metadata = _str_dict(body.user_metadata) or source.user_metadata
            row = ModelRow(
                model_id,
                who,
                body.session_id,
                source.base_model,
                source.lora,
                metadata,
                time.time(),
                time.time(),
            )

            def job() -> Outcome:
                self.rt.check_live(row)  # before loading a full model copy for nothing
                client = self.rt.build_client(model_id, source.lora, 0)
                try:
                    client.load_state(ckpt.dir, with_optimizer=body.optimizer).result()
                except BaseException:
                    client.close()
                    raise
                self.rt.add_model(row, client)
                return Outcome({"model_id": model_id, "path": body.path, "type": "load_weights"})

            self.rt.submit(self.rt.admin, rid, job)
        return {"request_id": rid, "model_id": model_id}

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


def _str_dict(values: dict[str, Any] | None) -> dict[str, str]:
    """user_metadata as the SDK reads it back: string values only."""
    return {str(k): v if isinstance(v, str) else str(v) for k, v in (values or {}).items()}


def _dir_size(directory: str) -> int:
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def create_tinker_router(runtime: Runtime) -> APIRouter:
    """The protocol's endpoints under /api/v1."""
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
    post("/save_weights")(api.save_weights)
    post("/save_weights_for_sampler")(api.save_for_sampler)
    post("/load_weights")(api.load_weights)
    sampling = SamplingApi(api)
    post("/create_sampling_session")(sampling.create_sampling_session)
    get("/samplers/{sampler_id}")(sampling.get_sampler)
    post("/asample")(sampling.asample)
    post("/retrieve_future")(api.retrieve_future)
    return router
