"""`InferenceConfig`: which engine samples, and how it runs (TOML `[inference]`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from posttrain.algo.config_fields import reject_unknown_keys
from posttrain.inference.engines import (
    ENGINE_NAMES,
    ENGINES,
    NOT_SHIPPED,
    EngineMode,
    EngineName,
    EngineSpec,
    LoraRoute,
    Placement,
)

# The [inference] keys some engine has as its own, and the engine(s) that have each.
_OWNED = {
    key: [s.name for s in ENGINES.values() if key in s.options]
    for s in ENGINES.values()
    for key in s.options
}
SyncMode = Literal["auto", "none", "reload", "lora"]
ParityMode = Literal["error", "warn", "off"]
PARITY_MODES: tuple[ParityMode, ...] = ("error", "warn", "off")
LoraSync = Literal["auto", "adapter", "merge"]


@dataclass(frozen=True)
class InferenceConfig:
    """How rollouts are sampled. The defaults sample with posttrain's own sampler on the
    training weights, in this process, exactly as before engines existed.

    `devices` splits sampling from training: "cuda:0,cuda:1" samples on the first device and
    trains on the last; "cpu,cpu" samples in a process of its own (`threads` torch threads)
    while training keeps this process's threads. vLLM always runs in a process of its own.
    """

    engine: EngineName = "pytorch"
    devices: str | None = None  # "SAMPLER,TRAINER": split mode
    threads: int | None = (
        None  # the engine process's torch/OpenMP threads (None: 1 when split on CPU)
    )
    python: str | None = (
        None  # vllm: an interpreter with vLLM installed (None: $POSTTRAIN_VLLM_PYTHON, else this one)
    )
    dtype: Literal["float32", "bfloat16", "float16"] = (
        "float32"  # vllm: fp32 matches training to ~2e-6
    )
    kv_cache_mb: int = 512  # vllm: KV cache size; vLLM's own default takes 92% of RAM
    max_model_len: int | None = None  # vllm: None: the model's max positions
    url: str | None = None  # openai: the server's base URL, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # openai: the served model name (None: the first of /v1/models)
    api_key: str | None = None  # openai
    sync: SyncMode = "auto"  # openai: how weights reach the server (auto: lora, else reload)
    # vllm: how a LoRA run's adapter reaches the engine each step: "adapter" loads it as a
    # LoRA (vLLM's LoRA kernels), "merge" merges it into the engine's weights in place (plain
    # kernels); "auto": adapter on a GPU, merge on a CPU, where vLLM's LoRA kernels sample
    # slower (docs/engines.md). The split pytorch engine always merges.
    lora_sync: LoraSync = "auto"
    allow_training_without_logprobs: bool = False  # openai: accept a server without logprobs
    start_timeout_s: float = 600.0  # a worker process must be ready within this
    # Whether a step fails ("error"), logs ("warn") or says nothing ("off") when the engine's
    # logprobs are further from the trainer's than a correct engine's (`trainer.parity`).
    parity_check: ParityMode = "error"
    # vllm, openai: weight versions an engine holds at once (an adapter slot each; a sample
    # in flight may still use an older one). None: 3, or a job's max_off_policy_steps + 2.
    keep_versions: int | None = None

    def __post_init__(self) -> None:
        engine = self.engine
        if engine in NOT_SHIPPED:
            raise ValueError(
                f"[inference] engine = {engine!r} is not built in: {NOT_SHIPPED[engine]}"
            )
        if engine not in ENGINE_NAMES:
            raise ValueError(
                f"[inference] engine must be one of {list(ENGINE_NAMES)}, got {engine!r}"
            )
        spec = self.spec
        for key, example in spec.required.items():
            if not getattr(self, key):
                raise ValueError(f"[inference] engine = {engine!r} needs {key} = {example!r}")
        defaults = {f.name: f.default for f in fields(self)}
        for key, owners in _OWNED.items():
            if key not in spec.options and getattr(self, key) != defaults[key]:
                named = " or ".join(repr(o) for o in owners)
                raise ValueError(f"[inference] {key} is for engine = {named}, not {engine!r}")
        if self.lora_sync not in ("auto", "adapter", "merge"):
            raise ValueError(
                f"[inference] lora_sync must be 'auto', 'adapter' or 'merge', got {self.lora_sync!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"[inference] threads must be >= 1, got {self.threads}")
        if self.keep_versions is not None and self.keep_versions < 2:
            raise ValueError(
                f"[inference] keep_versions must be >= 2 (the version served and the next), "
                f"got {self.keep_versions}"
            )
        if self.kv_cache_mb < 16:
            raise ValueError(f"[inference] kv_cache_mb must be >= 16, got {self.kv_cache_mb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"[inference] max_model_len must be >= 2, got {self.max_model_len}")
        if self.parity_check not in PARITY_MODES:
            raise ValueError(
                f"[inference] parity_check must be one of {list(PARITY_MODES)}, got "
                f"{self.parity_check!r}"
            )
        if not (0 < self.start_timeout_s < math.inf):
            raise ValueError(f"[inference] start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.devices is not None:
            self.split_devices()  # checks the form

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, object], source: str = "[inference]"
    ) -> InferenceConfig:
        """From a TOML table or keyword dict; an unknown key names the nearest valid one."""
        reject_unknown_keys(values, [f.name for f in fields(cls)], source)
        return cls(**values)  # pyright: ignore[reportArgumentType]

    @property
    def spec(self) -> EngineSpec:
        """What the configured engine is and can do (`engines.py`)."""
        return ENGINES[self.engine]

    @property
    def fixed_policy(self) -> bool:
        """Whether the engine samples weights that training never reaches: a server with
        sync = 'none', explicitly off-policy (register warns once, and each step reports the
        gap). Every other engine and sync follows training: what the server cannot take is
        refused at register, for a job as for the API."""
        return self.sync == "none"

    @property
    def placement(self) -> Placement:
        """Where the engine samples: here (on the training weights), in a worker process, or
        on a server."""
        places = {mode.placement for mode in self.spec.modes}
        if "server" in places:
            return "server"
        return "here" if "here" in places and self.devices is None else "process"

    @property
    def mode(self) -> EngineMode:
        """The way the engine runs under this config (`EngineSpec.modes`)."""
        placement, fixed = self.placement, self.fixed_policy
        return next(m for m in self.spec.modes if (m.placement, m.fixed) == (placement, fixed))

    @property
    def split(self) -> bool:
        """Whether sampling runs in a process of its own, apart from training."""
        return self.placement == "process"

    @property
    def on_gpu(self) -> bool:
        """Whether the engine samples on a CUDA device (`devices`' first)."""
        devices = self.split_devices()
        return devices is not None and devices[0].startswith("cuda")

    def lora_route(self) -> LoraRoute:
        """How a LoRA run's adapter reaches this engine (`lora_sync`, resolved): an engine
        with one route takes that one; under "auto", an adapter on a GPU, else merged."""
        routes = self.spec.lora_routes
        if len(routes) == 1:
            return routes[0]
        if self.lora_sync != "auto":
            return self.lora_sync
        return "adapter" if self.on_gpu and "adapter" in routes else routes[0]

    def versions_kept(self, max_off_policy_steps: int = 0) -> int:
        """How many weight versions the engine keeps: `keep_versions`, else enough for every
        sample in flight of a run `max_off_policy_steps` ahead (that + 2, at least 3)."""
        if self.keep_versions is not None:
            return self.keep_versions
        return max(3, max_off_policy_steps + 2)

    def split_devices(self) -> tuple[str, str] | None:
        """(sampler device, trainer device) from `devices`, or None when not split."""
        if self.devices is None:
            return None
        parts = [p.strip() for p in self.devices.split(",")]
        if len(parts) != 2 or not all(p.split(":")[0] in ("cpu", "cuda") for p in parts):
            raise ValueError(
                f"[inference] devices must be 'SAMPLER,TRAINER', e.g. 'cuda:0,cuda:1' or "
                f"'cpu,cpu', got {self.devices!r}"
            )
        return parts[0], parts[1]


def head_size(model_config: Mapping[str, object]) -> int | None:
    """The attention head size of a transformers config (as a dict): `head_dim`, else
    hidden_size / num_attention_heads; None when it says neither."""
    head = model_config.get("head_dim")
    if isinstance(head, int):
        return head
    hidden, heads = model_config.get("hidden_size"), model_config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def head_problem(config: InferenceConfig, model_config: Mapping[str, object]) -> str | None:
    """Why the configured engine cannot sample this model on the CPU, or None: vLLM-CPU runs
    some model families and head sizes only (on a GPU, `[inference] devices = "cuda:..."`,
    vLLM's own checks apply)."""
    if config.on_gpu:
        return None
    refused = config.spec.cpu_refused_families.get(str(model_config.get("model_type")))
    if refused is not None:
        return (
            f"engine = {config.engine!r} samples on the CPU, and for this model: {refused} "
            "([inference] devices = 'cuda:...')"
        )
    sizes = config.spec.cpu_head_sizes
    if sizes is None:
        return None
    head = head_size(model_config)
    if head is None or head in sizes:
        return None
    return (
        f"engine = {config.engine!r} samples on the CPU, and its CPU attention has no kernel "
        f"for this model's head size {head} (it has {', '.join(map(str, sizes))}); sample "
        "with engine = 'pytorch', or train a model whose head size is one of those (e.g. "
        "tiny:qwen2:mini, head size 32)"
    )
