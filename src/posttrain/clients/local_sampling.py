"""LocalSamplingClient: samples from a fixed set of published weights, as the tinker SDK's
SamplingClient does for `save_weights_and_get_sampling_client` and `create_sampling_client`.

It holds its own replica of the model, loaded from a sampler-weights (or state) checkpoint, so
training that continues on the training client never changes what it samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from posttrain.clients.futures import APIFuture, OrderedRunner
from posttrain.engine.worker import Worker
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class LocalSamplingClient:
    """Sampling and prompt scoring on one snapshot of the weights; calls run in order."""

    def __init__(self, worker: Worker, *, base_model: str, model_path: str) -> None:
        self._worker = worker
        self.base_model = base_model
        self.model_path = model_path
        self._runner = OrderedRunner("posttrain-sampler")

    @classmethod
    def load(
        cls, factory: Callable[[], Worker], path: str | Path, *, base_model: str
    ) -> LocalSamplingClient:
        """A fresh replica from `factory` with the weights saved at `path` (no optimizer)."""
        worker = factory()
        worker.load_state(Path(path), with_optimizer=False)
        return cls(worker, base_model=base_model, model_path=str(path))

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        tokens = prompt.to_ints()
        return self._runner.submit(
            lambda: self._worker.sampler().sample(
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
        return self._runner.submit(
            lambda: self._worker.sample(tokens, num_samples, sampling_params)
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = prompt.to_ints()
        return self._runner.submit(lambda: self._worker.compute_logprobs(tokens))

    def get_tokenizer(self) -> object:
        return self._worker.get_tokenizer()

    def get_base_model(self) -> str:
        return self.base_model

    def close(self) -> None:
        self._runner.close()
