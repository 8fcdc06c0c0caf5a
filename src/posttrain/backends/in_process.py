"""The client source of the backends that train in this process or in their own workers
(LocalBackend, RayBackend): a client built by a function, loading checkpoint files itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Generic

from posttrain.backends.client_models import ClientT
from posttrain.backends.model import TrainableModel


class InProcessClients(Generic[ClientT]):
    """The `ClientSource` of LocalBackend and RayBackend: `make(model, directory)` builds a
    client that loads checkpoint files itself."""

    def __init__(self, make: Callable[[TrainableModel, Path], ClientT]) -> None:
        self.make = make

    async def open(self, model: TrainableModel, directory: Path, checkpoint: str | None) -> ClientT:
        try:
            client = await asyncio.to_thread(self.make, model, directory)
        except FileNotFoundError as exc:
            raise FileNotFoundError(missing_base_model(model, exc)) from exc
        if checkpoint is not None:
            try:
                await client.load_state(checkpoint, with_optimizer=True)
            except BaseException:
                client.close()
                raise
        return client

    async def reload(self, client: ClientT, checkpoint: str) -> ClientT:
        await client.load_state(checkpoint, with_optimizer=True)
        return client

    async def release(self, client: ClientT) -> None:
        client.close()


def missing_base_model(model: TrainableModel, error: FileNotFoundError) -> str:
    return (
        f"cannot register model {model.name!r}: base_model={model.base_model!r} is not a model "
        f"({error}). Pass an existing model directory (one with config.json, e.g. built by "
        "`posttrain make-tiny-model DIR`) or a Hugging Face hub id such as 'Qwen/Qwen3-0.6B'"
    )
