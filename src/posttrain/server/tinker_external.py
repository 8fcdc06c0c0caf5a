"""Tinker's external weights, which `tinker checkpoint download` and `posttrain export` fetch.

`save_weights_external` writes a model's current weights (a posttrain checkpoint without
optimizer state: the PEFT adapter or full safetensors, with its manifest) as
`tinker://<model>/external_weights/<name>`. `external_weights_urls` hands out one URL per file,
valid for an hour; the file route serves them to whoever holds a URL, without the API key, as
Tinker's signed bucket URLs do (the SDK downloads them with plain urllib). A URL's token is a
random capability kept in this process: a restart ends it, and the client asks again.
"""

from __future__ import annotations

import datetime
import secrets
import time
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from posttrain.server import tinker_schema as s
from posttrain.server.config import EXTERNAL_FILES
from posttrain.server.lanes import Outcome
from posttrain.server.store import CheckpointRow
from posttrain.server.tinker_api import Api, owner

URL_TTL_S = 3600.0


class ExternalWeightsApi:
    """Handlers of the external weights endpoints; each method is one endpoint."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.store = api.store
        self._grants: dict[str, tuple[Path, float]] = {}  # token -> (directory, expiry)

    async def save_weights_external(
        self, body: s.SaveWeightsExternal, request: Request
    ) -> dict[str, object]:
        who = owner(request)
        with self.api.turn(who, body.model_id, body.seq_id):
            model = self.api.model(body.model_id, who)
        tinker_path = f"tinker://{model.model_id}/external_weights/{body.path}"
        rt = self.api.rt

        def job() -> Outcome:
            client = rt.client(model.model_id)
            directory = client.save_weights_for_sampler(f".external-{body.path}").result().path
            size = sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
            row = CheckpointRow(
                tinker_path,
                who,
                model.model_id,
                "external",
                body.path,
                directory,
                {},
                size,
                time.time(),
            )
            self.store.add_checkpoint(row)
            return Outcome({"path": tinker_path, "type": "save_weights_external"})

        return await self.api.ordered(request, "save_weights_external", model, body.seq_id, job)

    async def external_weights_urls(
        self, run_id: str, name: str, request: Request
    ) -> dict[str, object]:
        ckpt = self.api.checkpoint(f"tinker://{run_id}/external_weights/{name}", owner(request))
        directory = Path(ckpt.dir)
        expires = time.time() + URL_TTL_S
        now = time.time()
        self._grants = {t: g for t, g in self._grants.items() if g[1] > now}  # drop expired
        token = secrets.token_urlsafe(24)
        self._grants[token] = (directory, expires)
        base = str(request.base_url).rstrip("/")
        files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))
        urls = {f: f"{base}{EXTERNAL_FILES}{token}/{f}" for f in files if (directory / f).is_file()}
        when = datetime.datetime.fromtimestamp(expires, tz=datetime.UTC)
        return {"urls": urls, "expires": when.isoformat()}

    async def external_weights_file(self, token: str, file: str) -> FileResponse:
        grant = self._grants.get(token)
        if grant is None or grant[1] <= time.time():
            raise HTTPException(403, "this download URL is unknown or expired; ask for new URLs")
        directory = grant[0].resolve()
        target = (directory / file).resolve()
        if not target.is_relative_to(directory) or not target.is_file():
            raise HTTPException(404, f"no file {file!r} in these external weights")
        return FileResponse(target)


def add_external_routes(router: APIRouter, api: Api) -> None:
    """The routes under /api/v1 (the router's prefix)."""
    external = ExternalWeightsApi(api)
    router.post("/save_weights_external")(external.save_weights_external)
    router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")(
        external.external_weights_urls
    )
    files = EXTERNAL_FILES.removeprefix("/api/v1")
    router.get(files + "{token}/{file:path}")(external.external_weights_file)
