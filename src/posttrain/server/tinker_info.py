"""The Tinker protocol's read-mostly endpoints: client configuration, capabilities, telemetry,
health, training runs and their checkpoints (listing, deletion, weights info)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from posttrain.server import tinker_schema as s
from posttrain.server.runtime import Runtime
from posttrain.server.store import CheckpointRow, ModelRow
from posttrain.server.tinker_api import not_found, owner
from posttrain.server.tinker_schema import INT64_MAX

CHECKPOINT_TYPES = {"weights": "training", "sampler": "sampler", "external": "external"}
MAX_PAGE = 10_000  # training runs per page


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def checkpoint_json(row: CheckpointRow) -> dict[str, object]:
    segment = {"weights": "weights", "sampler": "sampler_weights"}.get(row.kind, "external_weights")
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": CHECKPOINT_TYPES[row.kind],
        "time": _time(row.created),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": False,
        "user_metadata": row.user_metadata or None,
    }


class InfoApi:
    """Handlers of the read-mostly endpoints; each method is one endpoint."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.store = runtime.store
        self.config = runtime.config

    async def client_config(self) -> dict[str, object]:
        # Keep the SDK on the plain protocol: no JWT exchange, no server-side custom losses,
        # no batched retrieve_futures or joined sampling sessions; chunks fit the body limit.
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, self.config.max_body_bytes // 2),
        }

    async def dynamic_config(self) -> dict[str, object]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def telemetry(self) -> dict[str, object]:
        return {"status": "accepted"}

    async def healthz(self) -> dict[str, object]:
        return {"status": "ok"}

    async def capabilities(self) -> dict[str, object]:
        model: dict[str, object] = {
            "model_name": self.config.base_model,
            "trainable": True,
            "sampleable": True,
        }
        if self.rt.max_context_length is not None:
            model["max_context_length"] = self.rt.max_context_length
        return {"supported_models": [model]}

    def run_json(self, row: ModelRow) -> dict[str, object]:
        ckpts = self.store.checkpoints(row.owner, row.model_id)
        weights = [c for c in ckpts if c.kind == "weights"]
        samplers = [c for c in ckpts if c.kind == "sampler"]
        return {
            "training_run_id": row.model_id,
            "base_model": row.base_model,
            "model_owner": row.owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": row.lora["rank"],
            "last_request_time": _time(row.last_request),
            "last_checkpoint": checkpoint_json(weights[-1]) if weights else None,
            "last_sampler_checkpoint": checkpoint_json(samplers[-1]) if samplers else None,
            "user_metadata": row.user_metadata,
        }

    def run_row(self, run_id: str, request: Request) -> ModelRow:
        row = self.store.model(run_id, owner(request))
        if row is None:
            raise not_found(f"training run {run_id!r}")
        return row

    async def training_runs(
        self,
        request: Request,
        limit: Annotated[int, Query(ge=0, le=MAX_PAGE)] = 20,
        offset: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    ) -> dict[str, object]:
        rows = self.store.models(owner(request))
        page = rows[offset : offset + limit]
        return {
            "training_runs": [self.run_json(r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
        }

    async def training_run(self, run_id: str, request: Request) -> dict[str, object]:
        return self.run_json(self.run_row(run_id, request))

    async def checkpoints(self, run_id: str, request: Request) -> dict[str, object]:
        row = self.run_row(run_id, request)
        rows = self.store.checkpoints(row.owner, run_id)
        return {"checkpoints": [checkpoint_json(c) for c in rows]}

    async def delete_checkpoint(
        self, run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, object]:
        row = self.run_row(run_id, request)
        path = f"tinker://{run_id}/{checkpoint_id}"
        ckpt = self.store.checkpoint(path, row.owner)
        if ckpt is None or not self.store.delete_checkpoint(path, row.owner):
            raise not_found(f"checkpoint {path!r}")
        # On a worker thread: it waits for a sampler being loaded from this directory.
        await asyncio.to_thread(self.rt.drop_weights, ckpt.dir)
        return {}

    async def weights_info(self, body: s.WeightsInfo, request: Request) -> dict[str, object]:
        ckpt = self.store.checkpoint(body.tinker_path, owner(request))
        model = self.store.model(ckpt.model_id, ckpt.owner) if ckpt else None
        if model is None:
            raise HTTPException(404, f"checkpoint {body.tinker_path!r} not found")
        return {
            "base_model": model.base_model,
            "is_lora": True,
            "lora_rank": model.lora["rank"],
            **{k: model.lora[k] for k in ("train_unembed", "train_mlp", "train_attn")},
        }


def create_info_router(runtime: Runtime) -> APIRouter:
    """The read-mostly endpoints under /api/v1."""
    api = InfoApi(runtime)
    router = APIRouter(prefix="/api/v1")
    post, get = router.post, router.get
    post("/client/config")(api.client_config)
    post("/client/dynamic_config")(api.dynamic_config)
    post("/telemetry")(api.telemetry)
    get("/healthz")(api.healthz)
    get("/get_server_capabilities")(api.capabilities)
    get("/training_runs")(api.training_runs)
    get("/training_runs/{run_id}")(api.training_run)
    get("/training_runs/{run_id}/checkpoints")(api.checkpoints)
    router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")(api.delete_checkpoint)
    post("/weights_info")(api.weights_info)
    return router
