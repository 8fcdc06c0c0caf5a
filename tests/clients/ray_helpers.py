"""Helpers shared by the Ray client tests: data, tensor comparisons, reading worker state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import psutil
import torch

from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.executor import TensorKind
from posttrain.engine.ray.actor import WorkerHost
from posttrain.types import AdamParams, Datum, ModelInput

Tensors = dict[str, torch.Tensor]
T = TypeVar("T")


def make_datums(loss_fn: str, seed: int, count: int) -> list[Datum]:
    """`count` datums of different lengths (5 to 15 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(count):
        length = 5 + 3 * i % 11
        tokens = torch.randint(3, 200, (length + 1,), generator=gen)
        inputs: dict[str, torch.Tensor] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(length, generator=gen)
        else:
            inputs["logprobs"] = -5.7 + 0.3 * torch.randn(length, generator=gen)
            inputs["advantages"] = torch.randn(length, generator=gen)
        datums.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return datums


def rel_error(got: Tensors, expected: Tensors) -> float:
    """||got - expected|| / ||expected|| over all tensors together (in float64)."""
    assert got.keys() == expected.keys()
    num = sum(float((got[k].double() - expected[k].double()).norm() ** 2) for k in expected)
    den = sum(float(expected[k].double().norm() ** 2) for k in expected)
    return (num / den) ** 0.5


def difference(after: Tensors, before: Tensors) -> Tensors:
    return {name: after[name] - before[name] for name in after}


def summed(per_rank: list[Tensors], names: set[str]) -> Tensors:
    """Each named tensor summed over the ranks that hold it."""
    return {n: torch.stack([rank[n] for rank in per_rank if n in rank]).sum(0) for n in names}


def stepped_norm(client: LocalTrainingClient | RayTrainingClient, adam: AdamParams) -> float:
    """optim_step; returns the pre-clip gradient norm it reports."""
    metrics = client.optim_step(adam).result().metrics
    assert metrics is not None
    return metrics["grad_norm:mean"]


def local_grads(client: LocalTrainingClient) -> Tensors:
    """Worker 0's gradients (None ones left out)."""
    grads = client.dispatch.executor.full_tensors("grads")[0]
    return {n: g for n, g in grads.items() if g is not None}


def local_weights(client: LocalTrainingClient) -> Tensors:
    weights = client.dispatch.executor.full_tensors("weights")[0]
    return {n: w for n, w in weights.items() if w is not None}


def ray_tensors(client: RayTrainingClient, kind: TensorKind) -> list[Tensors]:
    """Each rank's whole weights or gradients (None gradients left out)."""
    per_rank = client.executor.full_tensors(kind)
    return [{n: t for n, t in rank.items() if t is not None} for rank in per_rank]


def run_on_rank(client: RayTrainingClient, rank: int, fn: Callable[[WorkerHost], T]) -> T:
    """`fn(host)` inside rank `rank`'s actor, to inspect it or inject a fault. Define `fn` inside
    the test (a module-level function of a test module is not importable in the actor)."""
    import ray

    actor = client.executor._actors[rank]
    return ray.get(actor.__ray_call__.remote(fn))  # pyright: ignore[reportAttributeAccessIssue]


def wait_until_gone(pids: list[int], within_s: float = 30.0) -> bool:
    """True once none of `pids` is a live process (a zombie awaiting its parent counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not [pid for pid in pids if _alive(pid)]:
            return True
        time.sleep(0.2)
    return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
