"""The sampling engines posttrain ships, each declared once: where it runs, which `[inference]`
keys are its own, which sampling fields it honours, how a LoRA run's adapter reaches it, and
what it can do. Config checks, the engine session, the worker process, `posttrain backends`,
`explain` and `doctor` read this table; none of them asks an engine's name.

Adding an engine is a row here (and its runner or client). A new SamplingParams field is
honoured by the engines whose `sampling` names it (pytorch: every field) and refused by name by
every other engine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from posttrain.inference.protocol import EngineCapabilities
from posttrain.models.families import vllm_cpu_refusals
from posttrain.types import SamplingParams

EngineName = Literal["pytorch", "vllm", "openai"]
# "here": this process, on the training weights; "process": a worker process of its own (on
# its own device or thread budget); "server": an OpenAI-compatible server by URL.
Placement = Literal["here", "process", "server"]
LoraRoute = Literal["adapter", "merge"]

# The SamplingParams fields every engine honours; the others, each at its neutral value (its
# default, which leaves the distribution alone), are honoured by the engines whose
# `EngineSpec.sampling` names them and refused by name by the rest. A new SamplingParams
# field joins these by itself.
BASE_SAMPLING = ("max_tokens", "seed", "stop", "temperature")
OPTIONAL_SAMPLING: Mapping[str, object] = {
    f.name: f.default for f in fields(SamplingParams) if f.name not in BASE_SAMPLING
}
# The fields that change which token is drawn (all but `entropies`, which only reports).
DISTRIBUTION_FIELDS = tuple(f for f in OPTIONAL_SAMPLING if f != "entropies")


@dataclass(frozen=True)
class EngineMode:
    """One way an engine runs, and what it then does."""

    placement: Placement
    selected_by: str  # the [inference] keys that choose it
    capabilities: EngineCapabilities
    fixed: bool = False  # samples the server's own weights (sync = 'none'): off-policy
    probed: bool = False  # declared here; the server's answer to a probe decides at start


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is and can do."""

    name: EngineName
    summary: str  # `doctor`'s line for it
    modes: tuple[EngineMode, ...]
    # [inference] keys that are this engine's own (refused for every other engine), and the
    # keys it cannot start without, each with an example value.
    options: tuple[str, ...] = ()
    required: Mapping[str, str] = field(default_factory=dict)
    sampling: frozenset[str] = frozenset()  # the OPTIONAL_SAMPLING fields it honours
    logprobs_from: str = ""  # whose logprobs it returns, for its refusals
    lora_routes: tuple[LoraRoute, ...] = ("merge",)  # the first is the CPU's under "auto"
    runner: str | None = None  # "module:Class" its worker process runs (host.py)
    module: str | None = None  # what it imports: checked by `doctor`
    python_env: str | None = None  # names the interpreter its worker runs (None: this one)
    install_hint: Callable[[], str] | None = None  # how to get `module`
    sees_one_gpu: bool = False  # its worker takes its GPU from CUDA_VISIBLE_DEVICES
    # The attention head sizes it has CPU kernels for (None: any).
    cpu_head_sizes: tuple[int, ...] | None = None
    # Model families (transformers model_type) it cannot run on the CPU, and why.
    cpu_refused_families: Mapping[str, str] = field(default_factory=dict[str, str])

    def refused_sampling(self, params: SamplingParams) -> str | None:
        """Why this engine cannot sample `params` as posttrain's sampler would, or None."""
        asked = [
            f"{name} = {getattr(params, name)!r}"
            for name, neutral in OPTIONAL_SAMPLING.items()
            if name not in self.sampling
            and name != "entropies"
            and getattr(params, name) != neutral
        ]
        if asked:
            return (
                f"the {self.name} engine samples with top_k = -1 and top_p = 1 only, without "
                f"min_p or penalties (asked: {', '.join(asked)}): {self.logprobs_from} fold "
                "them in and no longer equal the trainer's log_softmax(logits / T); use "
                "engine = 'pytorch' for them"
            )
        if params.entropies and "entropies" not in self.sampling:
            return (
                f"the {self.name} engine does not return token entropies "
                "(SamplingParams.entropies); use engine = 'pytorch', or uncertainty_kind = "
                "'surprisal'"
            )
        return None

    def python(self, configured: str | None) -> tuple[str, str]:
        """The interpreter this engine's worker runs, and where that came from: `configured`
        ([inference] python), else ${python_env}, else this interpreter."""
        if configured:
            return configured, "[inference] python"
        if self.python_env and os.environ.get(self.python_env):
            return os.environ[self.python_env], f"${self.python_env}"
        return sys.executable, "this interpreter"


def _vllm_hint() -> str:
    from posttrain.inference.vllm_install import install_hint

    return install_hint()


LIVE = EngineCapabilities(
    returns_token_ids=True,
    returns_logprobs=True,
    weight_sync="live",
    own_process=False,
    provides_token_entropies=True,
)
SPLIT_PYTORCH = replace(LIVE, weight_sync="full", own_process=True)
VLLM = replace(SPLIT_PYTORCH, provides_token_entropies=False)
# What an OpenAI-compatible server must return: its probe at start refuses a server without
# token ids, and one without logprobs unless allow_training_without_logprobs.
OPENAI_RELOAD = VLLM
OPENAI_FIXED = replace(VLLM, weight_sync="none")

ENGINES: Mapping[EngineName, EngineSpec] = {
    "pytorch": EngineSpec(
        "pytorch",
        "in-process on the training weights (the default); split with [inference] devices",
        (
            EngineMode("here", "engine = 'pytorch' (the default)", LIVE),
            EngineMode("process", "engine = 'pytorch', devices = 'SAMPLER,TRAINER'", SPLIT_PYTORCH),
        ),
        sampling=frozenset(OPTIONAL_SAMPLING),
        runner="posttrain.inference.pytorch_runner:PytorchRunner",
    ),
    "vllm": EngineSpec(
        "vllm",
        "vLLM in a worker process",
        (EngineMode("process", "engine = 'vllm'", VLLM),),
        options=("python", "lora_sync"),
        logprobs_from="vLLM's processed logprobs",
        lora_routes=("merge", "adapter"),
        runner="posttrain.inference.vllm_runner:VLLMRunner",
        module="vllm",
        python_env="POSTTRAIN_VLLM_PYTHON",
        install_hint=_vllm_hint,
        sees_one_gpu=True,
        # vllm-cpu 0.32.0's `CPUAttentionBackend.get_supported_head_sizes`: vLLM loads a
        # model with another head size and fails only at the first sample.
        cpu_head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
        # Measured with vllm-cpu 0.32.0 on the tiny test models: qwen3, gemma3 (past the
        # sliding window) and olmo3 sample exactly transformers' greedy tokens.
        cpu_refused_families=vllm_cpu_refusals(),
    ),
    "openai": EngineSpec(
        "openai",
        "any OpenAI-compatible server by [inference] url (capabilities probed at start)",
        (
            EngineMode(
                "server", "engine = 'openai' (sync 'auto'/'reload')", OPENAI_RELOAD, probed=True
            ),
            EngineMode("server", "engine = 'openai', sync = 'none'", OPENAI_FIXED, True, True),
        ),
        options=("url", "model", "api_key", "sync"),
        required={"url": "http://HOST:PORT/v1"},
        logprobs_from="a server's processed logprobs",
        module="httpx",
        install_hint=lambda: "pip install 'posttrain[openai-engine]'",
    ),
}
ENGINE_NAMES: tuple[EngineName, ...] = tuple(ENGINES)
# Engines the seeds name that posttrain does not ship: refused with the way to reach them.
NOT_SHIPPED = {
    "sglang": "serve the model with SGLang and use engine = 'openai' with its url",
    "max": "serve the model with MAX and use engine = 'openai' with its url",
    "mlx": "serve the model with mlx_lm.server and use engine = 'openai' with its url",
}
