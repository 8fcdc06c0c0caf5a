"""The Tinker protocol's read-mostly endpoints: client configuration, capabilities, telemetry,
health, training runs and their checkpoints (listing, deletion, weights info)."""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request

from posttrain.server import tinker_schema as s
from posttrain.server.runtime import Runtime
from posttrain.server.store import CheckpointRow, ModelRow
from posttrain.server.tinker_api import not_found, owner

CHECKPOINT_TYPES = {"weights": "training", "sampler": "sampler"}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def checkpoint_json(row: CheckpointRow) -> dict[str, object]:
    segment = "weights" if row.kind == "weights" else "sampler_weights"
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": CHECKPOINT_TYPES[row.kind],
        "time": _time(row.created),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": False,
        "user_metadata": row.user_metadata or None,
    }


def create_info_router(runtime: Runtime) -> APIRouter:
    store, config = runtime.store, runtime.config
    router = APIRouter(prefix="/api/v1")

    @router.post("/client/config")
    async def client_config() -> dict[str, object]:
        # Keep the SDK on the plain protocol: no JWT exchange, no server-side custom losses,
        # no batched retrieve_futures or joined sampling sessions; chunks fit the body limit.
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, config.max_body_bytes // 2),
        }

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> dict[str, object]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @router.post("/telemetry")
    async def telemetry() -> dict[str, object]:
        return {"status": "accepted"}

    @router.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, object]:
        model = {
            "model_name": config.base_model,
            "trainable": True,
            "sampleable": True,
        }
        if runtime.max_context_length is not None:
            model["max_context_length"] = runtime.max_context_length
        return {"supported_models": [model]}

    def run_json(row: ModelRow) -> dict[str, object]:
        ckpts = store.checkpoints(row.owner, row.model_id)
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

    def run_row(run_id: str, request: Request) -> ModelRow:
        row = store.model(run_id, owner(request))
        if row is None:
            raise not_found(f"training run {run_id!r}")
        return row

    @router.get("/training_runs")
    async def training_runs(
        request: Request, limit: int = 20, offset: int = 0
    ) -> dict[str, object]:
        rows = store.models(owner(request))
        page = rows[max(offset, 0) : max(offset, 0) + max(limit, 0)]
        return {
            "training_runs": [run_json(r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
        }

    @router.get("/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict[str, object]:
        return run_json(run_row(run_id, request))

    @router.get("/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request) -> dict[str, object]:
        row = run_row(run_id, request)
        return {"checkpoints": [checkpoint_json(c) for c in store.checkpoints(row.owner, run_id)]}

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, object]:
        row = run_row(run_id, request)
        path = f"tinker://{run_id}/{checkpoint_id}"
        ckpt = store.checkpoint(path, row.owner)
        if ckpt is None or not store.delete_checkpoint(path, row.owner):
            raise not_found(f"checkpoint {path!r}")
        # Renamed first, so a crash mid-delete leaves a hidden directory, not a half checkpoint.
        directory = Path(ckpt.dir)
        if directory.is_dir():
            hidden = directory.with_name(f".{directory.name}.deleting-{uuid.uuid4().hex}")
            directory.rename(hidden)
            shutil.rmtree(hidden, ignore_errors=True)
        return {}

    @router.post("/weights_info")
    async def weights_info(body: s.WeightsInfo, request: Request) -> dict[str, object]:
        ckpt = store.checkpoint(body.tinker_path, owner(request))
        model = store.model(ckpt.model_id, ckpt.owner) if ckpt else None
        if model is None:
            raise HTTPException(404, f"checkpoint {body.tinker_path!r} not found")
        return {
            "base_model": model.base_model,
            "is_lora": True,
            "lora_rank": model.lora["rank"],
            **{k: model.lora[k] for k in ("train_unembed", "train_mlp", "train_attn")},
        }

    return router
