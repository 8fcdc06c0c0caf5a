"""The sampling engines as the CLI shows them: each way `[inference]` selects one, where it runs
and what it can do (`posttrain backends`, `explain`), and which backends take `inference=`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from posttrain.backends.plugins.registry import BackendInfo, import_target
from posttrain.backends.plugins.schema import constructor_parameters
from posttrain.inference import EngineCapabilities, InferenceConfig
from posttrain.inference.engines import ENGINES, EngineName, Placement

Runs = Literal["in-process", "worker process", "server"]
RUNS: dict[Placement, Runs] = {
    "here": "in-process",
    "process": "worker process",
    "server": "server",
}

WEIGHT_SYNC = {
    "live": "none needed: it samples the training weights themselves",
    "full": "what training changed, after every optimizer step (`sync` says how)",
    "none": "none: it samples a fixed policy, so training on its samples goes off-policy",
}
OPENAI_PROBED = (
    "probed from the server at start; shown are those it must have (token ids, and logprobs "
    "unless allow_training_without_logprobs). Unless sync = 'none', the server loads the "
    "model's weights at register: one that cannot (vLLM without VLLM_SERVER_DEV_MODE=1, "
    "SGLang, posttrain serve) is refused there"
)


@dataclass(frozen=True)
class EngineMode:
    """One way `[inference]` selects an engine, and what that engine then does."""

    engine: EngineName
    selected_by: str  # the [inference] keys that choose it
    runs: Runs
    capabilities: EngineCapabilities
    probed: bool = False  # declared here; the server's answer to a probe decides at start

    def as_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "selected_by": self.selected_by,
            "runs": self.runs,
            "capabilities": asdict(self.capabilities),
            "capabilities_source": "probed" if self.probed else "declared",
            "weight_sync_per_step": WEIGHT_SYNC[self.capabilities.weight_sync],
        }


ENGINE_MODES: tuple[EngineMode, ...] = tuple(
    EngineMode(spec.name, mode.selected_by, RUNS[mode.placement], mode.capabilities, mode.probed)
    for spec in ENGINES.values()
    for mode in spec.modes
)


def mode_of(config: InferenceConfig) -> EngineMode:
    """The row of ENGINE_MODES that `config` selects."""
    mode = config.mode
    return next(
        m for m in ENGINE_MODES if (m.engine, m.selected_by) == (config.engine, mode.selected_by)
    )


def sync_route(config: InferenceConfig, lora_rank: int, train_unembed: bool | None) -> str:
    """What each optimizer step moves to `config`'s engine, for a job with `lora_rank`
    (0: full fine-tuning) and `train_unembed` (None: posttrain's default, trained)."""
    if config.placement == "here":
        return "live (the engine samples the training weights: nothing moves)"
    if config.placement == "server":
        adapter = "adapter (loaded as a LoRA, <model>-posttrain-v<step>)"
        if config.fixed_policy:
            return "none (the server's fixed weights)"
        if config.sync == "lora":
            return adapter
        if config.sync == "auto" and lora_rank:
            return (
                f"{adapter} if vLLM's LoRA carries it and the server loads it at register, "
                "else whole weights"
            )
        return "whole weights"
    if lora_rank == 0:
        return "in place (full fine-tuning: the trainable tensors written into its weights)"
    if config.lora_route() == "merge":
        return "adapter merged in place (the engine computes W0 + s B A; no LoRA kernels)"
    unembed = "; unembedding adapter merged in place" if train_unembed is not False else ""
    return f"adapter (loaded as a LoRA, posttrain-v<step>{unembed})"


def where(config: InferenceConfig) -> str:
    """Where `config`'s engine samples."""
    if config.placement == "server":
        model = config.model or "the first model it lists"
        return f"the server at {config.url} (model: {model})"
    if config.placement == "here":
        return "in this process, on the training weights"
    threads = f", {config.threads} thread(s)" if config.threads else ""
    if config.spec.python_env is not None:  # an engine with an interpreter of its own
        python, source = config.spec.python(config.python)
        return f"a worker process running {python} ({source}), dtype {config.dtype}{threads}"
    devices = config.split_devices() or ("cpu", "cpu")
    return f"a worker process on {devices[0]} (training on {devices[1]}){threads}"


def accepts_inference(info: BackendInfo) -> bool | None:
    """Whether the backend's constructor takes `inference=` (None: it cannot be imported).
    Read from the signature, so a plugin with an `inference` parameter counts too."""
    if not info.importable and info.source != "builtin":  # a built-in lacks only its extra
        return None
    try:
        return "inference" in constructor_parameters(import_target(info.target))
    except (ImportError, ValueError):
        return None


def capability_flags(capabilities: EngineCapabilities) -> str:
    return ", ".join(f"{key}={value}" for key, value in asdict(capabilities).items())
