"""The Tinker protocol's checkpoint endpoints: `save_weights` (training state),
`save_weights_for_sampler` (named sampler weights, or an ephemeral snapshot for a sampling
client) and `load_weights` (into a live model, or as a new model's first request)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from fastapi import HTTPException, Request

from posttrain.server import tinker_schema as s
from posttrain.server.lanes import Job, Outcome, UserError
from posttrain.server.store import CheckpointKind, CheckpointRow, ModelRow, SamplerRow
from posttrain.server.tinker_api import Api, in_client_terms, not_found, owner, str_dict


class CheckpointApi:
    """Handlers of the checkpoint endpoints; each method is one endpoint."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.rt = api.rt
        self.store = api.store
        self.config = api.config

    async def save_weights(self, body: s.SaveWeights, request: Request) -> dict[str, object]:
        with self.api.turn(owner(request), body.model_id, body.seq_id):
            model = self.api.model(body.model_id, owner(request))
        name = body.path or f"checkpoint-{body.seq_id}"
        job = self.save_job(model, "weights", name, body.overwrite, body.user_metadata)
        return await self.api.ordered(request, "save_weights", model, body.seq_id, job)

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
        with self.api.turn(owner(request), body.model_id, body.seq_id):
            model = self.api.model(body.model_id, owner(request))
        if body.path:
            job = self.save_job(model, "sampler", body.path, True, body.user_metadata)
            return await self.api.ordered(
                request, "save_weights_for_sampler", model, body.seq_id, job
            )
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

        return await self.api.ordered(
            request, "save_weights_for_sampler", model, body.seq_id, ephemeral
        )

    def loadable(self, body: s.LoadWeights, who: str) -> tuple[CheckpointRow, ModelRow]:
        """The checkpoint `body` loads and the model that saved it; 404 or 400 if it cannot."""
        ckpt = self.api.checkpoint(body.path, who)
        if body.optimizer and ckpt.kind != "weights":
            raise HTTPException(
                400,
                f"{body.path} holds sampler weights, without optimizer state: load it without "
                "the optimizer, or load a save_state checkpoint (tinker://.../weights/...)",
            )
        source = self.store.model(ckpt.model_id, who)
        if source is None:
            raise not_found(f"checkpoint {body.path!r}")
        return ckpt, source

    async def load_weights(self, body: s.LoadWeights, request: Request) -> dict[str, object]:
        who = owner(request)
        if body.model_id is None:
            return await self.create_from_checkpoint(body, request, *self.loadable(body, who))
        if body.seq_id is None:
            raise HTTPException(400, "load_weights on an existing model needs seq_id")
        with self.api.turn(who, body.model_id, body.seq_id):
            ckpt, _ = self.loadable(body, who)
            model = self.api.model(body.model_id, who)

        def load() -> Outcome:
            client = self.rt.client(model.model_id)
            client.load_state(ckpt.dir, with_optimizer=body.optimizer).result()
            return Outcome({"path": body.path, "type": "load_weights"})

        names = {ckpt.dir: body.path}
        return await self.api.ordered(request, "load_weights", model, body.seq_id, load, names)

    async def create_from_checkpoint(
        self, body: s.LoadWeights, request: Request, ckpt: CheckpointRow, source: ModelRow
    ) -> dict[str, object]:
        """load_weights as a model's first request: the model comes from the checkpoint."""
        who = owner(request)
        if body.session_id is None or body.model_seq_id is None:
            raise HTTPException(400, "load_weights needs model_id, or session_id and model_seq_id")
        self.api.session(body.session_id, who)
        self.api.check_base_model(source.base_model)
        if body.base_model is not None:
            self.api.check_base_model(body.base_model)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        rid, new = await self.api.new_future(
            request, "load_weights", f"create:{model_id}", model_id
        )
        if new:
            metadata = str_dict(body.user_metadata) or source.user_metadata
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
                    self.rt.discard_client(model_id, client)
                    raise
                self.rt.add_model(row, client)
                return Outcome({"model_id": model_id, "path": body.path, "type": "load_weights"})

            names = {**self.api.path_names(model_id), ckpt.dir: body.path}
            self.rt.submit(self.rt.admin, rid, in_client_terms(job, names))
        return {"request_id": rid, "model_id": model_id}


def _dir_size(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
