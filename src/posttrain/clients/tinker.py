"""TinkerTrainingClient: posttrain's TrainingClient over the official `tinker` SDK.

It speaks to the Tinker service or to `posttrain serve` (extra `posttrain[tinker]`). The
shared trainer builds datums and loss configs in posttrain's vocabulary; this module turns
them into what Tinker's wire protocol carries, and refuses what it cannot carry:

- the `LossConfig` becomes Tinker's `loss_fn_config` (`algo.loss_wire.to_loss_fn_config`: the clip
  range `epsilon`/`epsilon_high` as `clip_low_threshold`/`clip_high_threshold`);
- per-token loss-reduction `weights` of the RL losses are folded into `advantages` (exact for
  `importance_sampling`, `ppo` and `cispo`: each token's term is linear in its advantage and the
  weights are >= 0), and posttrain's bookkeeping input `mask` stays behind;
- the loss options that need only logprobs (`ON_LOGPROBS`: a sequence-level
  `importance_sampling_level`, ...) run posttrain's own loss on the returned logprobs
  (`forward_backward_custom`);
- options only posttrain's loss code knows (KL penalty, truncated IS, ...) are a ValueError
  when set away from their default. The typed TinkerBackend options keep them out before this
  point; the check here guards direct use of the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from posttrain.algo.loss_wire import to_loss_fn_config
from posttrain.algo.losses import LossConfig
from posttrain.clients.custom_loss import (
    CustomLossFn,
    builtin_as_custom,
    custom_gradients,
    forward_data,
)
from posttrain.clients.futures import APIFuture
from posttrain.clients.protocol import (
    LoadWeightsResponse,
    LossFnConfig,
    SaveWeightsResponse,
    as_loss_config,
)
from posttrain.clients.token_metrics import with_token_metrics
from posttrain.tokenizer import Tokenizer
from posttrain.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)

if TYPE_CHECKING:
    import tinker

T = TypeVar("T")
U = TypeVar("U")

RL_LOSSES = ("importance_sampling", "ppo", "cispo")
SUPPORTED_LOSSES = ("cross_entropy", *RL_LOSSES)
BOOKKEEPING_INPUTS = ("mask",)
# Loss options that need only the logprobs and the datums' inputs: Tinker's loss_fn_config does
# not carry them, so posttrain's loss runs on the returned logprobs (forward_backward_custom).
ON_LOGPROBS = (
    "importance_sampling_level",
    "mask_prob_ratio",
    "max_negative_advantage_importance_sampling_weight",
    "kimi_k2_tau",
)


def _sets_any(config: LossConfig, names: Sequence[str]) -> bool:
    default = LossConfig()
    return any(getattr(config, name) != getattr(default, name) for name in names)


def import_tinker() -> Any:
    try:
        import tinker
    except ImportError as exc:
        raise ImportError(
            "TinkerBackend needs the tinker SDK: pip install 'posttrain[tinker]'"
        ) from exc
    return tinker


def protocol_loss_config(loss_fn: str, config: LossFnConfig | None) -> dict[str, float]:
    """The loss config for `loss_fn` as Tinker's `loss_fn_config` (numbers only)."""
    if loss_fn not in SUPPORTED_LOSSES:
        raise ValueError(
            f"loss_fn={loss_fn!r} cannot be sent over the Tinker protocol by posttrain; "
            f"use one of {list(SUPPORTED_LOSSES)}"
        )
    wire = to_loss_fn_config(loss_fn, as_loss_config(loss_fn, config))
    return {} if loss_fn == "cross_entropy" else wire


def protocol_inputs(loss_fn: str, datum: Datum) -> dict[str, torch.Tensor]:
    """The datum's inputs as Tinker takes them: RL weights folded into the advantages."""
    inputs = {
        k: v.detach().cpu() for k, v in datum.loss_fn_inputs.items() if k not in BOOKKEEPING_INPUTS
    }
    if loss_fn in RL_LOSSES and "weights" in inputs:
        weights = inputs.pop("weights").to(torch.float32)
        if bool((weights < 0).any()):
            raise ValueError(
                f"{loss_fn}: negative per-token weights cannot be folded into advantages"
            )
        inputs["advantages"] = inputs["advantages"].to(torch.float32) * weights
    for key, value in inputs.items():
        if value.is_floating_point():
            inputs[key] = value.to(torch.float32)
        else:
            inputs[key] = value.to(torch.int64)
    return inputs


def to_tinker_datum(loss_fn: str, datum: Datum) -> Any:
    tinker = import_tinker()
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(datum.model_input.to_ints()),
        loss_fn_inputs={
            k: tinker.TensorData.from_torch(v) for k, v in protocol_inputs(loss_fn, datum).items()
        },
    )


def from_tinker_output(out: Any) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(
        loss_fn_output_type=str(out.loss_fn_output_type),
        loss_fn_outputs=[
            {name: tensor.to_torch() for name, tensor in record.items()}
            for record in out.loss_fn_outputs
        ],
        metrics={k: float(v) for k, v in out.metrics.items()},
    )


def to_tinker_sampling_params(params: SamplingParams) -> Any:
    if params.entropies:
        raise ValueError(
            "SamplingParams.entropies=True: the Tinker protocol returns no per-token entropies, "
            "so a Tinker-protocol sampler cannot provide them; sample with entropies=False (and "
            "an uncertainty kind that reads logprobs: 'surprisal' or 'predictive_variance'), or "
            "sample on LocalBackend or RayBackend, whose samplers compute them"
        )
    tinker = import_tinker()
    stop: Any = (
        params.stop if params.stop is None or isinstance(params.stop, str) else list(params.stop)
    )
    # Each field asked for (not at its default) that the SDK's SamplingParams has is sent; one
    # it lacks (min_p and the penalties in SDK 0.38) would be dropped, so it is refused.
    sdk_fields = tinker.SamplingParams.model_fields
    asked = {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if f.name not in ("stop", "entropies") and getattr(params, f.name) != f.default
    }
    lacking = [name for name in asked if name not in sdk_fields]
    if lacking:
        named = ", ".join(f"{name}={asked[name]!r}" for name in lacking)
        raise ValueError(
            f"SamplingParams {named}: the tinker SDK's SamplingParams has no such field, so a "
            "Tinker-protocol sampler cannot honour it (the SDK drops unknown fields); sample "
            "on LocalBackend or RayBackend, or through posttrain serve's OpenAI /v1 endpoint"
        )
    return tinker.SamplingParams(**asked, stop=stop)


def from_tinker_sample(response: Any) -> SampleResponse:
    return SampleResponse(
        sequences=[
            SampledSequence(
                stop_reason=seq.stop_reason,
                tokens=list(seq.tokens),
                logprobs=None if seq.logprobs is None else list(seq.logprobs),
            )
            for seq in response.sequences
        ],
        prompt_logprobs=None
        if response.prompt_logprobs is None
        else list(response.prompt_logprobs),
    )


def _with_metrics(
    data: list[Datum], loss_fn: str, config: LossConfig
) -> Callable[[ForwardBackwardOutput], ForwardBackwardOutput]:
    """An output with its per-token metrics over the datums' counted tokens."""
    return lambda output: with_token_metrics(output, data, loss_fn, config)


def _mapped(future: Any, fn: Callable[[Any], U]) -> APIFuture[U]:
    """An SDK future (or anything with `.future()`) as a posttrain APIFuture of fn(result)."""
    raw: concurrent.futures.Future[Any] = future.future()
    return APIFuture(raw).map(fn)


class TinkerTrainingClient:
    """Tinker's primitives through the SDK; calls keep submission order on the server."""

    def __init__(self, training_client: tinker.TrainingClient, tokenizer: Tokenizer) -> None:
        self._client = training_client
        self._tokenizer = tokenizer
        self._sampler: Any = None
        self._sampler_lock = asyncio.Lock()

    @property
    def sdk_client(self) -> tinker.TrainingClient:
        return self._client

    def get_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        loss_config = as_loss_config(loss_fn, loss_fn_config)
        config = protocol_loss_config(loss_fn, loss_config)
        data = list(data)
        batch = [to_tinker_datum(loss_fn, d) for d in data]
        future = self._client.forward(batch, cast(Any, loss_fn), config or None)
        return _mapped(future, from_tinker_output).map(_with_metrics(data, loss_fn, loss_config))

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Tinker's loss on the server; a ratio loss with options the protocol does not carry
        (`ON_LOGPROBS`) runs posttrain's loss here, on the logprobs the server returns, through
        forward_backward_custom: the same loss as LocalBackend's.

        Either way the per-token metrics are computed here (`clients.token_metrics`): only this
        side knows which tokens count."""
        loss_config = as_loss_config(loss_fn, loss_fn_config)
        data = list(data)
        with_metrics = _with_metrics(data, loss_fn, loss_config)
        if loss_fn in RL_LOSSES and _sets_any(loss_config, ON_LOGPROBS):
            custom = self.forward_backward_custom(data, builtin_as_custom(loss_fn, loss_config))
            return custom.map(with_metrics)
        config = protocol_loss_config(loss_fn, loss_config)
        batch = [to_tinker_datum(loss_fn, d) for d in data]
        self._sampler = None
        future = self._client.forward_backward(batch, cast(Any, loss_fn), config or None)
        return _mapped(future, from_tinker_output).map(with_metrics)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """The SDK's forward_backward_custom, `loss_fn` seeing posttrain's datums.

        `loss_fn` is checked as on the local clients (`clients.custom_loss`) before the SDK's
        backward is sent, so a refused loss accumulates nothing; the SDK then refuses this
        client's later training requests, as it does after any failed custom loss.
        """
        data = list(data)

        def sdk_loss(
            _sent: list[Any], logprobs: list[torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, float]]:
            custom = custom_gradients(data, loss_fn, logprobs)
            grads = [-d.loss_fn_inputs["weights"] for d in custom.data]
            # A surrogate with the checked gradient and the custom loss's value (the SDK
            # reports the value it is given as loss:sum).
            surrogate = sum(
                ((g * lp).sum() for g, lp in zip(grads, logprobs, strict=True)), torch.tensor(0.0)
            )
            return surrogate - surrogate.detach() + custom.loss_sum, custom.metrics

        batch = [to_tinker_datum("cross_entropy", d) for d in forward_data(data)]
        self._sampler = None
        return _mapped(self._client.forward_backward_custom(batch, sdk_loss), from_tinker_output)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        tinker = import_tinker()
        params = tinker.AdamParams(
            learning_rate=adam_params.learning_rate,
            beta1=adam_params.beta1,
            beta2=adam_params.beta2,
            eps=adam_params.eps,
            weight_decay=adam_params.weight_decay,
            grad_clip_norm=adam_params.grad_clip_norm,
        )
        self._sampler = None  # the weights change: the next sample needs a fresh snapshot
        return _mapped(
            self._client.optim_step(params),
            lambda r: OptimStepResponse(metrics=dict(r.metrics) if r.metrics else None),
        )

    async def _sampling_client(self) -> Any:
        async with self._sampler_lock:
            if self._sampler is None:
                self._sampler = await self._client.save_weights_and_get_sampling_client()
            return self._sampler

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[SampleResponse]:
        to_tinker_sampling_params(sampling_params)  # refuses what the protocol cannot carry, now
        return _run(self._sample(prompt, num_samples, sampling_params))

    async def _sample(
        self, prompt: ModelInput, num_samples: int, params: SamplingParams
    ) -> SampleResponse:
        tinker = import_tinker()
        sampler = await self._sampling_client()
        response = await sampler.sample(
            tinker.ModelInput.from_ints(prompt.to_ints()),
            num_samples,
            to_tinker_sampling_params(params),
        )
        return from_tinker_sample(response)

    async def sample_many(
        self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams
    ) -> list[SampleResponse]:
        """Every prompt in flight at once (the server batches what it can)."""
        to_tinker_sampling_params(sampling_params)  # refused before any request is sent
        return list(
            await asyncio.gather(*(self._sample(p, num_samples, sampling_params) for p in prompts))
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return _run(self._compute_logprobs(prompt))

    async def _compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        tinker = import_tinker()
        sampler = await self._sampling_client()
        out = await sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt.to_ints()))
        return list(out)

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        saved = self._client.save_state(name, overwrite=overwrite)
        return _mapped(saved, lambda r: SaveWeightsResponse(str(r.path)))

    def load_state(self, path: str, with_optimizer: bool = False) -> APIFuture[LoadWeightsResponse]:
        """Deprecated in the SDK for live clients; TinkerBackend resumes by creating a client."""
        self._sampler = None
        load = self._client.load_state_with_optimizer if with_optimizer else self._client.load_state
        return _mapped(load(path), lambda r: LoadWeightsResponse(str(r.path or path)))

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        return _mapped(
            self._client.save_weights_for_sampler(name),
            lambda r: SaveWeightsResponse(str(r.path)),
        )

    def close(self) -> None:
        self._sampler = None


async def unload_model(base_url: str, api_key: str, model_id: str) -> None:
    """Ask a self-hosted Tinker-protocol server (posttrain serve, SkyRL) to free a model now.

    `POST /api/v1/unload_model`: the SDK has its request and response types but no method that
    sends it. The server answers with a future that is complete at once (posttrain serve), so
    the answer is not awaited further. Raises RuntimeError if the server refuses.
    """
    import httpx  # a dependency of the tinker SDK

    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            base_url.rstrip("/") + "/api/v1/unload_model",
            json={"model_id": model_id, "type": "unload_model"},
            headers={"X-API-Key": api_key},
        )
    if response.status_code != 200:
        raise RuntimeError(
            f"unload_model {model_id} answered {response.status_code}: {response.text[:200]}"
        )


def _run(coroutine: Any) -> APIFuture[Any]:
    """Schedule `coroutine` on the running loop and return its result as an APIFuture."""
    task = asyncio.get_running_loop().create_task(coroutine)
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(t: asyncio.Task[Any]) -> None:
        if t.cancelled():
            out.cancel()
        elif t.exception() is not None:
            out.set_exception(t.exception())
        else:
            out.set_result(t.result())

    task.add_done_callback(done)
    return APIFuture(out)
