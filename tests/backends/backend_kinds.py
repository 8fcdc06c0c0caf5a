"""The three backends a lifecycle test runs against, and how to look at a model on each.

LocalBackend; RayBackend on a local Ray (one worker: the lifecycle is the same for any
number, and each worker costs seconds to start); TinkerBackend against a real `posttrain serve`
on loopback. The fixtures that make them are in this directory's conftest.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend
from posttrain.engine.checkpoint import list_checkpoints

# The server tests' helpers start and stop `posttrain serve` (tests/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import KEY, ServerProcess, post, result  # pyright: ignore[reportMissingImports]

MakeBackend = Callable[[Path], TrainableBackend]
KINDS = [
    "local",
    pytest.param("ray", marks=pytest.mark.slow),  # Ray and its actors start in seconds
    pytest.param("tinker", marks=pytest.mark.slow),  # so does the server subprocess
]
PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary
# What a model's state is compared by. In this process (LocalBackend) and on a Ray worker
# started the same way, the same data, start and kernels give the same bits. TinkerBackend's
# weights are on the server: compared by the logprobs it computes with them (the first token
# has none), two loaded copies of the same weights in one server process agreeing to float32
# rounding (rel 1e-6); a skipped or doubled step moves them by orders of magnitude more.
State = dict[str, torch.Tensor] | list[float | None]


def make(kind: str, path: Path, server: ServerProcess | None) -> TrainableBackend:
    if kind == "local":
        from posttrain.backends.local import LocalBackend

        return LocalBackend(path)
    if kind == "ray":
        from posttrain.backends.ray import RayBackend
        from posttrain.engine.ray.executor import RayConfig

        config = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
        return RayBackend(path, num_workers=1, ray_config=config)
    from posttrain.backends.tinker import TinkerBackend

    assert server is not None
    return TinkerBackend(path, base_url=server.url, api_key=KEY)


def tiny(name: str, base_model: Path | str, **kwargs: object) -> TrainableModel:
    return TrainableModel(name=name, project="p", base_model=str(base_model), lora_rank=4, **kwargs)  # pyright: ignore[reportArgumentType]


async def state_of(kind: str, backend: TrainableBackend, model: TrainableModel) -> State:
    if kind == "tinker":
        return (await backend.sampling_client(model).compute_logprobs(PROMPT))[1:]
    client = backend.client(model)  # pyright: ignore[reportAttributeAccessIssue]
    weights = client.dispatch.executor.full_tensors("weights")[0]  # rank 0's, whole
    return {n: w.detach().clone() for n, w in weights.items() if w is not None}


def same(kind: str, got: State, want: State) -> bool:
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return got == pytest.approx(want, rel=1e-6)


def indexed_steps(kind: str, model: TrainableModel) -> list[int]:
    """The steps of the model's checkpoints: complete step directories, or index records."""
    if kind == "tinker":
        index = model.directory / "checkpoints.jsonl"
        lines = index.read_text().splitlines() if index.exists() else []
        return [json.loads(line)["step"] for line in lines]
    return [int(p.name) for p in list_checkpoints(model.directory / "checkpoints")]


def model_id(backend: TrainableBackend, model: TrainableModel) -> str:
    return str(backend.client(model).sdk_client.model_id)  # pyright: ignore[reportAttributeAccessIssue]


def training_runs(server: ServerProcess | None) -> set[str]:
    """The server's models of this key (none without a server: the in-process backends)."""
    if server is None:
        return set()
    import httpx

    response = httpx.get(
        f"{server.url}/api/v1/training_runs", params={"limit": 1000}, headers={"X-API-Key": KEY}
    )
    return {r["training_run_id"] for r in response.json()["training_runs"]}


def is_loaded(server: ServerProcess, model_id: str) -> bool:
    """Whether the server still holds the model: a request of a freed one fails at once with
    "not loaded" (a held one would wait for the seq_ids before this one, then fail)."""
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    body = {"model_id": model_id, "seq_id": 10**6, "adam_params": adam}
    submitted = post(server, "optim_step", json=body)
    assert submitted.status_code == 200, submitted.text
    return "not loaded" not in result(server, submitted.json()["request_id"]).get("error", "")
