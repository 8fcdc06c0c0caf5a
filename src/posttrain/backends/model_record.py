"""What a backend keeps for one registered model: one record, found by one lookup
(`client_models.ModelClients.record`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from posttrain.backends.model import TrainableModel
from posttrain.clients.protocol import TrainingClient
from posttrain.inference.session import EngineSession

ClientT = TypeVar("ClientT", bound=TrainingClient)


@dataclass
class ModelRecord(Generic[ClientT]):
    """A registered model with its training client and what was made for it."""

    model: TrainableModel
    client: ClientT  # trains the model; a failed step may replace it (`ClientSource.reload`)
    engine: EngineSession  # samples the client's weights (made anew with a new client)
    # The value model of PPO with a critic (`backends.critics`), from its first 'gae' step.
    critic: ClientT | None = None
    # The frozen base model of a fully fine-tuned policy: its KL (and DPO) reference, made at
    # first use, in workers of its own (a LoRA policy switches its adapters off instead).
    reference: ClientT | None = None
    warned_precision: bool = False  # the sampler/trainer precision warning, given once
