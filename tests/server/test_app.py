"""The app's error boundary, in process: an unexpected exception answers a generic 500 with an
error id, and the details go to the server's log under that id."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from posttrain.server.app import create_app
from posttrain.server.config import ServerConfig


def test_internal_errors_answer_an_id_and_log_the_details(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
    )
    app = create_app(config)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("disk full at /srv/posttrain/runs/session-of-someone-else")

    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"X-API-Key": "tml-any"})
        # The OpenAI-compatible routes are mounted (no longer skipped on ImportError).
        models = client.get("/v1/models", headers={"X-API-Key": "tml-any"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert response.status_code == 500
    match = re.fullmatch(
        r"internal server error \(error id ([0-9a-f]{12})\)", response.json()["detail"]
    )
    assert match is not None, response.text
    assert "someone-else" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "someone-else" in str(logged[0].exc_info[1])
