"""A local training client's whole state on disk and back (`LocalTrainingClient.spill` and
`restore`), for `posttrain serve --max-resident-adapters`, which keeps a bounded number of
adapters in memory (`server.residency`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from posttrain.engine import atomic_replace
from posttrain.engine.checkpoint import load_checkpoint, save_checkpoint
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.executor import InProcessExecutor
from posttrain.engine.worker import Worker

STATE = "state"  # the adapter and AdamW state, a checkpoint (`engine.checkpoint`)
GRADS = "grads.pt"  # each worker's accumulated gradients, by parameter name


def _workers(dispatch: Dispatch) -> list[Worker]:
    executor = dispatch.executor
    if not isinstance(executor, InProcessExecutor):
        raise TypeError("only clients whose workers run in this process can be spilled")
    return executor.workers


def spill(dispatch: Dispatch, path: Path) -> None:
    """Write what the workers' next results depend on to `path`, atomically: adapter weights
    and AdamW state (moments, step, hyperparameters) as a checkpoint, and every worker's
    accumulated gradients, so a spill between forward_backward and optim_step loses nothing.

    Not the RNG state `save_state` keeps: the server's global generators are shared by all its
    clients, so no client owns them (and none draws from them: LoRA starts from a forked
    generator, sampling from seeded ones, and the server's LoRA has no dropout).
    """
    workers = _workers(dispatch)
    dispatch.prepare("optim_step")  # parked gradients and moments back on their params
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        first = workers[0]  # replicas hold the same weights and optimizer state
        save_checkpoint(
            tmp / STATE, model=first.model, optimizer=first.optimizer, include_rng=False
        )
        grads = [{n: p.grad for n, p in w.trainable_parameters().items()} for w in workers]
        torch.save(grads, tmp / GRADS)
        with atomic_replace.name_lock(path):
            atomic_replace.publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore(dispatch: Dispatch, path: Path) -> None:
    """Load what `spill` wrote into fresh workers of the same LoRA settings."""
    workers = _workers(dispatch)
    grads = torch.load(path / GRADS, weights_only=True)
    if len(grads) != len(workers):
        raise ValueError(
            f"{path} holds {len(grads)} workers' gradients, the client has {len(workers)}"
        )
    for worker, worker_grads in zip(workers, grads, strict=True):
        load_checkpoint(
            path / STATE, model=worker.model, optimizer=worker.optimizer, restore_rng=False
        )
        worker.set_grads(worker_grads)
