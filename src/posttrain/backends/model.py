"""TrainableModel: a named model in a project, registered with a backend, with its own logs."""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

from posttrain.backends.model_log import ModelLog
from posttrain.logging_sinks import (
    Sink,
    SinkName,
    check_sinks,
    close_sinks,
    open_sinks,
    sinks_from_env,
)
from posttrain.models.lora import DEFAULT_LORA_RANK, LoraSettings
from posttrain.run_records import best_step
from posttrain.trainer.steps import RunState

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from posttrain.backends.protocol import TrainableBackend

log = logging.getLogger(__name__)
# openai_client()'s client per event loop (its connections belong to that loop), with the
# endpoint it was made for.
LoopClients: TypeAlias = (
    "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, AsyncOpenAI]]"
)


@dataclass(frozen=True)
class OpenAIEndpoint:
    """Where an OpenAI client samples a model: `base_url` (ending in /v1), key, model name."""

    base_url: str
    api_key: str
    model_name: str


@runtime_checkable
class ServesOpenAI(Protocol):
    """A backend that can serve its registered models through an OpenAI-compatible endpoint."""

    def openai_endpoint(self, model: TrainableModel) -> OpenAIEndpoint: ...


@runtime_checkable
class DeletesCheckpoints(Protocol):
    """A backend that keeps a model's checkpoints by step and can delete them."""

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's complete checkpoints, oldest first."""
        ...

    async def delete_checkpoints(self, model: TrainableModel, keep: set[int]) -> list[int]:
        """Delete the model's checkpoints of every step not in `keep`; the deleted steps."""
        ...


@dataclass
class TrainableModel(ModelLog):
    """A model to post-train. `base_model` is a local directory or a hub id.

    `lora_rank=None` or `lora_rank=0` (the TOML spelling) trains every weight (full
    fine-tuning, stored as None); else LoRA of that rank, Tinker's 32 unless given (`.lora`).
    `run_state` is JSON the caller wants restored on resume (a data cursor, a controller's
    state); it is saved with every checkpoint. `report_metrics` names where `log` also sends
    its rows besides history.jsonl: "tensorboard", "wandb", "mlflow" (packages not installed
    by posttrain); None reads the POSTTRAIN_LOG_TO environment variable, `[]` means none.
    """

    name: str
    project: str
    base_model: str
    lora_rank: int | None = DEFAULT_LORA_RANK
    lora_alpha: float | None = None
    # LoRA's layers (Tinker's LoraConfig flags); train_unembed: see `LoraSettings`.
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    run_state: RunState = field(default_factory=dict)
    report_metrics: Sequence[SinkName] | None = None
    _backend: TrainableBackend | None = field(default=None, init=False, repr=False)
    _dir: Path | None = field(default=None, init=False, repr=False)
    _lora: LoraSettings | None = field(default=None, init=False, repr=False, compare=False)
    _step: int = field(default=0, init=False, repr=False)
    _resume_step: int | None = field(default=None, init=False, repr=False)
    _sinks: list[Sink] = field(default_factory=list, init=False, repr=False)
    _openai_clients: LoopClients = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __post_init__(self) -> None:
        check_names(self)
        if self.lora_rank == 0:  # the job's TOML spells full fine-tuning 0: one meaning
            self.lora_rank = None
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(
                f"lora_rank must be >= 1 for LoRA, or 0 / None for full fine-tuning, got "
                f"{self.lora_rank}"
            )
        self._check_lora_layers()
        flags = (self.train_attn, self.train_mlp, self.train_unembed)
        self._lora = LoraSettings.of(self.lora_rank, self.lora_alpha, *flags)
        if self.lora_rank is None and self.dtype != "float32":
            raise ValueError(
                f"TrainableModel: full fine-tuning (lora_rank=None) in {self.dtype} would round "
                "most updates away; give a lora_rank (adapters stay float32) or dtype='float32'"
            )
        if self.report_metrics is not None:
            if isinstance(self.report_metrics, str):
                raise ValueError(
                    "TrainableModel.report_metrics is a list of sink names, e.g. "
                    f"[{self.report_metrics!r}], not a string"
                )
            self.report_metrics = check_sinks(self.report_metrics, "TrainableModel.report_metrics")

    @property
    def lora(self) -> LoraSettings | None:
        """The model's LoRA, built once from its flat fields (ART's and Tinker's spelling):
        what the engines, exporters and checks read (None: full fine-tuning)."""
        return self._lora

    def _check_lora_layers(self) -> None:
        flags = {k: getattr(self, k) for k in ("train_attn", "train_mlp", "train_unembed")}
        for key, value in flags.items():
            if not isinstance(value, bool) and not (key == "train_unembed" and value is None):
                kind = "a bool or None" if key == "train_unembed" else "a bool"
                raise ValueError(f"TrainableModel.{key} must be {kind}, got {value!r}")
        off = [k for k, v in flags.items() if v is False]
        if self.lora_rank is None and off:
            raise ValueError(
                f"TrainableModel: {off} = False choose LoRA layers, but lora_rank is None (full "
                "fine-tuning trains every weight); give a lora_rank or leave them as they are"
            )
        if self.lora_rank is not None and len(off) == len(flags):
            raise ValueError(
                "TrainableModel: LoRA needs at least one of train_attn, train_mlp, "
                "train_unembed to be True"
            )

    async def register(self, backend: TrainableBackend, *, resume_step: int | None = None) -> None:
        """Attach to `backend`: load the base model, or resume from the latest checkpoint.

        A latest checkpoint that is damaged is an error, never a silent older resume.
        `resume_step=N` resumes from the checkpoint of step N instead (0 with no checkpoint 0:
        from the base model); the checkpoints of later steps are moved aside, not deleted.
        """
        if resume_step is not None and (
            not isinstance(resume_step, int) or isinstance(resume_step, bool) or resume_step < 0
        ):
            raise ValueError(f"resume_step must be a step number >= 0 or None, got {resume_step!r}")
        self._resume_step = resume_step
        try:
            await backend.register(self)
            if self._resume_step is not None:  # the backend did not take it
                self.detach()
                raise ValueError(
                    f"{type(backend).__name__} cannot resume model {self.name!r} from a chosen "
                    f"step (resume_step={resume_step}); it registered from its latest "
                    "checkpoint, and is detached again: close the backend, and register "
                    "without resume_step or with LocalBackend/RayBackend"
                )
        finally:
            self._resume_step = None

    def take_resume_step(self) -> int | None:
        """For a backend's register(): the `resume_step` given to `register` (once)."""
        step, self._resume_step = self._resume_step, None
        return step

    def attach(self, backend: TrainableBackend, directory: Path, step: int) -> None:
        """Called by a backend's register(). The metric sinks open first: if one refuses, the
        model is left as it was (and the sinks opened before it are closed)."""
        names = self.report_metrics
        if names is None:
            names = sinks_from_env(os.environ)
        sinks = open_sinks(names, directory, project=self.project, name=self.name)
        previous, self._sinks = self._sinks, sinks
        self._backend, self._dir, self._step = backend, directory, step
        try:  # a model registered again logs to its new sinks only
            close_sinks(previous)
        except Exception:  # the new registration stands; the old sink's loss is reported
            log.warning("closing the metric sinks of model %r failed", self.name, exc_info=True)

    def detach(self) -> None:
        """Undo `attach` (a backend's register() that fails after it): close the sinks."""
        sinks, self._sinks = self._sinks, []
        self._backend, self._dir, self._step = None, None, 0
        close_sinks(sinks)

    @property
    def backend(self) -> TrainableBackend:
        if self._backend is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered; call `await model.register(backend)` first"
            )
        return self._backend

    def openai_endpoint(self) -> OpenAIEndpoint:
        """Where this model's latest weights are served; the backend starts serving if needed."""
        backend = self.backend
        if not isinstance(backend, ServesOpenAI):
            raise NotImplementedError(
                f"{type(backend).__name__} cannot serve an OpenAI-compatible endpoint for model "
                f"{self.name!r}"
            )
        return backend.openai_endpoint(self)

    def openai_client(self) -> AsyncOpenAI:
        """An `openai.AsyncOpenAI` for this model; pass `model=model.inference_model_name`.

        Its completions and chat completions ask for token ids by default (`extra_body`
        `return_token_ids=True`, as ART's client does), which also brings the sampled tokens'
        logprobs: each choice then becomes a Trajectory on exact tokens
        (`Trajectory(messages_and_choices=[..., choice])`). A request's own `extra_body` wins.
        Calls in the same event loop share one client (making one costs milliseconds, and
        rollouts often ask for it once each); its connections belong to that loop. One that
        user code closed (`async with client:`, a cleanup) is replaced, never handed out.
        """
        return loop_client(self._openai_clients, self.openai_endpoint(), token_id_client_class())

    async def get_step(self) -> int:
        """ART's name for `model.step`: the number of training steps taken."""
        return self.step

    def get_inference_name(self, step: int | None = None) -> str:
        """ART's name for `inference_model_name`. posttrain serves a model's latest weights
        only, so `step` may be None or the current step."""
        if step is not None and step != self.step:
            raise ValueError(
                f"model {self.name!r} serves the weights of its current step ({self.step}) "
                f"only, not step {step}; call get_inference_name() without a step"
            )
        return self.inference_model_name

    @property
    def inference_model_name(self) -> str:
        """The `model=` to send through `openai_client()` (for this model's latest weights)."""
        return self.openai_endpoint().model_name

    @property
    def directory(self) -> Path:
        self.backend  # noqa: B018 - raises the clear "not registered" error
        assert self._dir is not None
        return self._dir

    @property
    def step(self) -> int:
        return self._step

    def set_step(self, step: int) -> None:
        self._step = step

    def config_dict(self) -> dict[str, object]:
        keys = (
            *("name", "project", "base_model", "lora_rank", "lora_alpha"),
            *("train_attn", "train_mlp", "train_unembed", "dtype", "seed"),
        )
        return {k: getattr(self, k) for k in keys}

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """ART's name: delete every checkpoint but the latest and the best, the one whose step
        has the highest mean of `best_checkpoint_metric` ("<split>/<key>" of history.jsonl,
        as `log` writes it; ties go to the later step) among the steps that still have a
        checkpoint. Returns the deleted steps. A metric that `log` never wrote for a
        checkpointed step is an error naming those it did, and nothing is deleted."""
        backend = self.backend
        if not isinstance(backend, DeletesCheckpoints):
            raise NotImplementedError(
                f"{type(backend).__name__} cannot delete checkpoints of model {self.name!r}"
            )
        steps = backend.checkpoint_steps(self)
        if not steps:
            return []
        best = best_step(self.history(), best_checkpoint_metric, steps)
        return await backend.delete_checkpoints(self, keep={steps[-1], best})


@dataclass
class Model(ModelLog):
    """A model that is not trained (ART's `art.Model`): a baseline, a judge or a teacher served
    behind an OpenAI-compatible URL, e.g. `Model(name="gpt-4.1", project="p",
    inference_base_url="https://api.openai.com/v1", inference_api_key=...)`. Rollout code
    written for a TrainableModel runs on it: `openai_client()`, `get_inference_name()`,
    `openai_endpoint()`. Registered with a backend, `log` writes its history.jsonl and
    trajectories beside the trained models' (`<path>/<project>/models/<name>`), so runs
    compare; its trajectory files hold messages, not tokens (a server need not return them).
    """

    name: str
    project: str
    config: object = None
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None  # what requests send as `model=`; None: `name`
    logs_tokens: ClassVar[bool] = False
    _dir: Path | None = field(default=None, init=False, repr=False)
    _sinks: list[Sink] = field(default_factory=list, init=False, repr=False)
    _openai_clients: LoopClients = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __post_init__(self) -> None:
        check_names(self)

    @property
    def trainable(self) -> bool:
        return False

    @property
    def step(self) -> int:
        return 0  # never trained

    async def get_step(self) -> int:
        return 0

    async def register(self, backend: object) -> None:
        """Log beside the backend's models: `<path>/<project>/models/<name>` (nothing loads)."""
        path = getattr(backend, "path", None)
        if not isinstance(path, str | Path):
            raise TypeError(
                f"{type(backend).__name__} has no path to keep model {self.name!r}'s logs in"
            )
        directory = Path(path) / self.project / "models" / self.name
        directory.mkdir(parents=True, exist_ok=True)
        self._dir = directory

    @property
    def directory(self) -> Path:
        if self._dir is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered; call `await model.register(backend)` "
                "first to log it"
            )
        return self._dir

    def openai_endpoint(self) -> OpenAIEndpoint:
        if self.inference_base_url is None or self.inference_api_key is None:
            raise ValueError(
                f"model {self.name!r} is not trained: give it inference_base_url and "
                "inference_api_key (the OpenAI-compatible server it is sampled from)"
            )
        return OpenAIEndpoint(
            self.inference_base_url, self.inference_api_key, self.get_inference_name()
        )

    def openai_client(self) -> AsyncOpenAI:
        """An `openai.AsyncOpenAI` for the server, one per event loop, as TrainableModel's
        (a closed one is replaced); it sends requests as they are, with no posttrain fields."""
        try:
            from openai import AsyncOpenAI
        except ImportError as exc:
            raise ImportError(
                "model.openai_client() needs the openai SDK: pip install openai"
            ) from exc
        return loop_client(self._openai_clients, self.openai_endpoint(), AsyncOpenAI)

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model=` to send: `inference_model_name`, else `name`."""
        return self.inference_model_name or self.name


def check_names(model: TrainableModel | Model) -> None:
    """`name` and `project` name directories: plain names only."""
    for key in ("name", "project"):
        value = getattr(model, key)
        if not value or "/" in value or value in {".", ".."}:
            raise ValueError(f"{type(model).__name__}.{key} must be a plain name, got {value!r}")


def loop_client(
    cache: LoopClients,
    endpoint: OpenAIEndpoint,
    make: type[AsyncOpenAI],
) -> AsyncOpenAI:
    """The client of this event loop for `endpoint`: the cached one unless it was closed or
    the endpoint moved, else a new one (its connections belong to the loop)."""
    key = f"{endpoint.base_url} {endpoint.api_key}"
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    cached = cache.get(loop) if loop is not None else None
    if cached is not None and cached[0] == key and not cached[1].is_closed():
        return cached[1]
    client = make(base_url=endpoint.base_url, api_key=endpoint.api_key)
    if loop is not None:
        cache[loop] = (key, client)
    return client


# Request fields every completion from openai_client() carries (vLLM's extension).
TOKEN_ID_DEFAULTS: dict[str, object] = {"return_token_ids": True}
_TOKEN_ID_CLIENT: list[type] = []


def token_id_client_class() -> type[AsyncOpenAI]:
    """`openai.AsyncOpenAI` that adds TOKEN_ID_DEFAULTS under every completion request's own
    `extra_body` (made on first use: the openai SDK is an optional dependency)."""
    if _TOKEN_ID_CLIENT:
        return _TOKEN_ID_CLIENT[0]
    try:
        from openai import AsyncOpenAI
    except ImportError as exc:
        raise ImportError(
            "model.openai_client() needs the openai SDK: pip install 'posttrain[server]' openai"
        ) from exc

    class TokenIdOpenAI(AsyncOpenAI):
        # `_prepare_options` is the SDK's hook for changing a request before it is built.
        async def _prepare_options(self, options):
            options = await super()._prepare_options(options)
            if options.method == "post" and options.url in ("/completions", "/chat/completions"):
                options.extra_json = {**TOKEN_ID_DEFAULTS, **(options.extra_json or {})}
            return options

    _TOKEN_ID_CLIENT.append(TokenIdOpenAI)
    return TokenIdOpenAI
