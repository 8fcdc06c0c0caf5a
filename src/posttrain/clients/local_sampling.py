"""LocalSamplingClient: samples from a fixed set of published weights, as the tinker SDK's
SamplingClient does for `save_weights_and_get_sampling_client` and `create_sampling_client`.

It holds its own replica of the model (no optimizer: a sampler needs none), so training that
continues on the training client never changes what it samples. A replica comes from a
checkpoint on disk (`create_sampling_client`), or, for a snapshot of weights held in this
process, from the training model itself without touching the disk (`snapshot_replica`).
Snapshots are taken often (a cookbook RL loop takes one per step), so a snapshot client hands
its replica back to the training client's `ReplicaPool` when closed or dropped, and the next
snapshot copies only the trainable tensors into it.
"""

from __future__ import annotations

import copy
import queue
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from posttrain.clients.futures import APIFuture, OrderedRunner
from posttrain.engine import checkpoint
from posttrain.engine.decode.sampler import Sampler
from posttrain.engine.worker import Worker
from posttrain.tokenizer import Tokenizer
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class LocalSamplingClient:
    """Sampling and prompt scoring on one snapshot of the weights; calls run in order.

    `model_path` is where the weights were read from ("" for a snapshot, which is in no
    file). `release` receives the replica when the client is closed or garbage collected
    (the training client's pool, to reuse it); without one the replica is simply dropped.
    """

    def __init__(
        self,
        sampler: Sampler,
        *,
        base_model: str,
        model_path: str,
        release: Callable[[Sampler], None] | None = None,
    ) -> None:
        self._sampler: Sampler | None = sampler
        self.base_model = base_model
        self.model_path = model_path
        self._runner = OrderedRunner("posttrain-sampler")
        # Runs once: at close(), or when a client nobody closed is collected (pending calls
        # hold the client, so that is never while one runs).
        self._release = weakref.finalize(self, release, sampler) if release else None
        if self._release is not None:
            self._release.atexit = False

    @classmethod
    def load(
        cls, factory: Callable[[], Worker], path: str | Path, *, base_model: str
    ) -> LocalSamplingClient:
        """A fresh replica from `factory` with the weights saved at `path`."""
        return cls(load_replica(factory, path), base_model=base_model, model_path=str(path))

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        tokens = prompt.to_ints()
        sampler = self._open()
        return self._runner.submit(
            lambda: sampler.sample(
                [tokens],
                num_samples,
                sampling_params,
                include_prompt_logprobs=include_prompt_logprobs,
            )[0]
        )

    def sample_many(
        self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[list[SampleResponse]]:
        """Several prompts in one batched call (posttrain's extension)."""
        tokens = [p.to_ints() for p in prompts]
        sampler = self._open()
        return self._runner.submit(lambda: sampler.sample(tokens, num_samples, sampling_params))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = prompt.to_ints()
        sampler = self._open()
        return self._runner.submit(lambda: sampler.compute_logprobs(tokens))

    def get_tokenizer(self) -> Tokenizer:
        return self._open().tokenizer

    def get_base_model(self) -> str:
        return self.base_model

    def close(self) -> None:
        """Finish the calls already made, then let go of the replica (and its memory)."""
        self._runner.close()
        self._sampler = None
        if self._release is not None:
            self._release()

    def _open(self) -> Sampler:
        if self._sampler is None:
            raise RuntimeError("this sampling client is closed; get a new one to sample")
        return self._sampler


class ReplicaPool:
    """Idle sampling replicas of one training model, kept for the next snapshot (at most one).

    `give_back` may run inside a garbage collection, in any thread, even one that is inside
    `take`: a SimpleQueue's put is safe there, where a lock could deadlock.
    """

    def __init__(self) -> None:
        self._idle: queue.SimpleQueue[Sampler] = queue.SimpleQueue()
        self._closed = False

    def give_back(self, sampler: Sampler) -> None:
        if not self._closed and self._idle.empty():
            self._idle.put(sampler)

    def take(self) -> Sampler | None:
        """An idle replica, now the caller's (None if there is none)."""
        taken = None
        while not self._idle.empty():  # a racing give_back may have left a second one
            taken = self._idle.get_nowait()
        return taken

    def close(self) -> None:
        self._closed = True
        self.take()


def snapshot_replica(worker: Worker, idle: Sampler | None) -> Sampler:
    """A sampler on `worker`'s weights as they are now, with no disk I/O.

    `idle` (a replica of the same model) gets the trainable tensors copied in place: nothing
    else changes while training. Otherwise the whole model is copied (without gradients)
    beside a copy of the tokenizer, which the caller may then change freely.
    """
    if worker.tokenizer is None:
        raise ValueError("the training worker has no tokenizer; give one to sample")
    if idle is None:
        # requires_grad stays as it is (sampling runs under inference_mode anyway): with the
        # LoRA weights frozen, a sampled logprob came out 1 ulp off the training model's.
        model = copy.deepcopy(worker.model).to(worker.config.device)
        return Sampler(model, copy.deepcopy(worker.tokenizer))
    params = dict(idle.model.named_parameters())
    with torch.no_grad():
        for name, param in worker.trainable_parameters().items():
            params[name].copy_(param)
    return idle


def load_replica(
    factory: Callable[[], Worker], path: str | Path, idle: Sampler | None = None
) -> Sampler:
    """A sampler on the weights saved at `path`: loaded into `idle` (a replica of the same
    model), else into a fresh replica from `factory`."""
    if idle is None:
        worker = factory()
        worker.load_state(Path(path), with_optimizer=False)
        return worker.sampler()  # the worker, and its (empty) optimizer, go
    checkpoint.load_checkpoint(path, model=idle.model, restore_rng=False)
    return idle
