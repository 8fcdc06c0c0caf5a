"""Which local clients' models can decode one batch together, and that batch's decode.

Several clients of one base model (a server's tenants: their LoRA snapshots, named sampler
weights, the base model) would each take a whole decode; batched, their rows decode together
with a per-row adapter (`engine.decode.multi_lora`), which on a small model costs little more
than one request alone (`benchmarks/multi_lora.py`). `plan` says which clients can share one
decode; `SharedDecode.sample` runs it. Both run where the clients' calls run (their compute
thread), not concurrently with them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.decode.multi_lora import MultiLora, lora_layers
from posttrain.engine.decode.sampler import SampleRequest
from posttrain.engine.worker import Worker
from posttrain.types import SampleResponse, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedDecode:
    """One decode for the requests of several clients: `host`'s model runs it, each client's
    rows with the adapter of its slot (`adapters`; None when all rows use the host's own)."""

    host: Worker
    slots: dict[int, int]  # id(client) -> its adapter slot
    adapters: MultiLora | None

    def serves(self, client: LocalTrainingClient) -> bool:
        return id(client) in self.slots

    def sample(
        self,
        requests: Sequence[tuple[LocalTrainingClient, Sequence[int], SamplingParams]],
        num_samples: int,
    ) -> list[SampleResponse]:
        """Per (client, prompt, params) request its response, what it gets alone (greedy tokens
        equal, logprobs to float32 rounding, seeded draws equal: `Sampler.sample_batched`).
        The requests share all settings but seed and max_tokens; a ValueError names a bad
        request (the caller retries them one by one)."""
        batch = [
            SampleRequest([prompt], params, self.slots[id(c)]) for c, prompt, params in requests
        ]
        responses = self.host.sampler().sample_batched(batch, num_samples, self.adapters)
        return [response for (response,) in responses]


def plan(
    clients: Sequence[LocalTrainingClient],
) -> tuple[SharedDecode | None, list[LocalTrainingClient]]:
    """The decode that most of `clients` can share (None: none can), and those that sample
    alone: a client whose workers are not one in this process, or whose adapter does not fit
    the host's (other target modules or rank layout)."""
    workers: dict[int, Worker] = {}
    alone: list[LocalTrainingClient] = []
    for client in clients:
        if id(client) in workers or client in alone:
            continue
        worker = client.sampling_worker()
        if worker is None:
            alone.append(client)
        else:
            workers[id(client)] = worker
    if not workers:
        return None, alone
    models: dict[int, nn.Module] = {key: worker.model for key, worker in workers.items()}
    if len(models) == 1:  # one client: no adapters to gather
        (key,) = models
        return SharedDecode(workers[key], {key: 0}, None), alone
    host = _host(models)
    users = {id(c): c for c in clients}
    if host is None:
        return None, [*alone, *(users[key] for key in workers)]
    fits = [key for key, model in models.items() if _fits(models[host], model)]
    alone += [users[key] for key in workers if key not in fits]
    adapters = None if len(fits) == 1 else MultiLora(models[host], [models[k] for k in fits])
    return SharedDecode(
        workers[host], {key: slot for slot, key in enumerate(fits)}, adapters
    ), alone


def _host(models: dict[int, nn.Module]) -> int | None:
    """A model with LoRA layers that can host a batch (the first in arrival order)."""
    for key, model in models.items():
        try:
            if lora_layers(model, "the host"):
                MultiLora(model, [model])
                return key
        except ValueError:
            continue
    return None


def _fits(host: nn.Module, model: nn.Module) -> bool:
    try:
        MultiLora(host, [model])
    except ValueError as exc:
        log.debug("a client samples alone: %s", exc)
        return False
    return True
