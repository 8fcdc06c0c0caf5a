"""Whole, LoRA-merged weights for an engine that holds its own copy of the model.

The training client hands over its trainable tensors (PEFT names for LoRA, Hugging Face names
for full fine-tuning). `WeightExporter` lays them over the base model's weights, merging each
LoRA pair as W = W0 + (alpha / rank) * B @ A, and writes a Hugging Face model directory
(`model.safetensors`, `config.json`, tokenizer files) that vLLM or posttrain's sampler load
as-is. vLLM's own LoRA is not used: on a CPU it is slower than posttrain's sampler, and it
cannot put an adapter on an `lm_head`, which posttrain's default LoRA trains where it is untied.

A base model that ties its unembedding to the input embedding is written tied, its one matrix
under the embedding's name: a LoRA on that shared matrix (`train_unembed=True`) is merged into
the embedding, which both uses read. Only an adapter on such a model's `lm_head` alone (an
older posttrain's) unties them.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.inference.protocol import WeightSnapshot
from posttrain.models.file_modes import save_tensors
from posttrain.models.lora import LoraSettings
from posttrain.models.source import resolve_model_source

_PEFT_PREFIX = "base_model.model."
# In memory a factor's name holds its adapter's name (`.lora_A.default.weight`); PEFT's saved
# adapter file leaves it out (`.lora_A.weight`): both are read.
_LORA = re.compile(r"^(?P<layer>.+)\.lora_(?P<which>[AB])(\.[^.]+)?\.weight$")
# An embedding's LoRA (a tied model's unembedding adapter): A is [rank, vocab], B [hidden, rank].
_EMBEDDING_LORA = re.compile(r"^(?P<layer>.+)\.lora_embedding_(?P<which>[AB])(\.[^.]+)?$")
_KEEP = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def load_base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors files, on the CPU."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights; an engine with its own copy of the model "
            "needs the base model in safetensors form (save it with save_pretrained)"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def base_weights_for_merge(base_dir: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(weights, tied) of a base model directory; a tied model's `lm_head.weight`, if saved, is
    dropped: it is the embedding, and whatever is trained or merged is derived from that."""
    weights = load_base_weights(base_dir)
    tied = ties_word_embeddings(base_dir)
    if tied:
        weights.pop("lm_head.weight", None)
    return weights, tied


def ties_word_embeddings(model_dir: Path) -> bool:
    """Whether the model directory's config ties the unembedding to the input embedding."""
    config = json.loads((model_dir / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_model_directory(
    weights: Mapping[str, torch.Tensor],
    base_dir: Path,
    directory: Path,
    *,
    untie: bool,
    dtype: str | None = None,
) -> None:
    """A Hugging Face model directory: `weights` as `model.safetensors`, and the base model's
    config, generation config and tokenizer files; `untie` writes tie_word_embeddings false
    (the weights hold an `lm_head` of their own), `dtype` the config's dtype."""
    save_tensors(weights, directory / "model.safetensors", {"format": "pt"})
    for name in _KEEP:
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, directory / name)  # the umask's mode
    if untie or dtype is not None:
        config = json.loads((directory / "config.json").read_text())
        if untie:
            config["tie_word_embeddings"] = False
        if dtype is not None:
            # transformers >= 4.56 writes "dtype", older ones (and vLLM's reader) "torch_dtype".
            for key in ("dtype", "torch_dtype"):
                config[key] = dtype
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def merge_trainable(
    base: Mapping[str, torch.Tensor],
    trainable: Mapping[str, torch.Tensor],
    *,
    lora_scale: float | None,
) -> dict[str, torch.Tensor]:
    """`base` with the trained tensors laid over it: LoRA pairs merged (`lora_scale` =
    alpha / rank), full-fine-tuning tensors replacing theirs. Names are Hugging Face's."""
    pairs, plain = lora_pairs(trainable)
    merged = dict(base) | plain
    if pairs and lora_scale is None:
        raise ValueError("the trainable weights hold LoRA adapters but no lora_scale was given")
    for layer, pair in pairs.items():
        key = _base_key(merged, layer)
        merged[f"{layer}.weight"] = merge_pair(merged[key], pair, float(lora_scale or 0.0))
    return {k: v.contiguous() for k, v in merged.items()}


def lora_pairs(
    trainable: Mapping[str, torch.Tensor],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """({layer: {"A": A, "B": B}}, {Hugging Face name: tensor}) of a client's trainable
    tensors: the LoRA factors by layer (an embedding's as a linear layer's), and the rest."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in trainable.items():
        name = name.removeprefix(_PEFT_PREFIX)
        match = _LORA.match(name)
        embedding = _EMBEDDING_LORA.match(name)
        if match is not None:
            pairs.setdefault(match["layer"], {})[match["which"]] = tensor
        elif embedding is not None:
            # W0 + s (B A)^T for the [vocab, hidden] table: the same pair as a linear layer's,
            # its factors transposed and swapped.
            which = "B" if embedding["which"] == "A" else "A"
            pairs.setdefault(embedding["layer"], {})[which] = tensor.t()
        else:
            plain[name.replace(".base_layer.", ".")] = tensor
    return pairs, plain


def merge_pair(w0: torch.Tensor, pair: Mapping[str, torch.Tensor], scale: float) -> torch.Tensor:
    """W0 + scale * B @ A, summed in float32, in W0's dtype."""
    a, b = pair["A"].float(), pair["B"].float()
    return (w0.float() + scale * (b @ a)).to(w0.dtype)


def _base_key(weights: Mapping[str, torch.Tensor], layer: str) -> str:
    key = f"{layer}.weight"
    if key in weights:
        return key
    if layer == "lm_head" and "model.embed_tokens.weight" in weights:
        return "model.embed_tokens.weight"  # tied in the base model
    raise KeyError(f"LoRA layer {layer!r} has no base weight {key!r} in the base model")


def new_version_directory(directory: Path) -> Path:
    """A fresh hidden directory in `directory` to write a version into, then publish."""
    tmp = directory / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    return tmp


def publish_version(tmp: Path, final: Path, written: list[Path], keep: int) -> Path:
    """Rename the written `tmp` to `final` (atomic: an engine never sees half a version), and
    delete the oldest of `written` (updated in place) beyond the newest `keep`."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    written[:] = [p for p in written if p != final] + [final]
    while len(written) > keep:
        shutil.rmtree(written.pop(0), ignore_errors=True)
    return final


class WeightExporter:
    """Writes the model's whole weights at each version into `directory/v<version>`, keeping
    only the newest `keep` versions (an engine may still be reading the one before)."""

    def __init__(
        self,
        base_model: str | Path,
        directory: Path,
        *,
        lora: LoraSettings | None,
        keep: int = 2,
    ) -> None:
        self.base_dir = Path(resolve_model_source(base_model))
        if not (self.base_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"base_model {str(base_model)!r} is not a model directory; an engine with its own "
                "copy of the model needs a local directory (config.json and safetensors)"
            )
        self.directory = directory
        self.tied = ties_word_embeddings(self.base_dir)
        self.lora_scale = None if lora is None else lora.alpha / lora.rank
        self.keep = keep
        self._base: dict[str, torch.Tensor] | None = None
        self._written: list[Path] = []

    def export(self, trainable: Mapping[str, torch.Tensor], version: int) -> WeightSnapshot:
        """Write version `version`'s weights; returns where they are."""
        if self._base is None:
            self._base, _ = base_weights_for_merge(self.base_dir)
        merged = merge_trainable(self._base, trainable, lora_scale=self.lora_scale)
        tmp = new_version_directory(self.directory)
        # An adapter of a tied model's lm_head alone unties it.
        untie = self.tied and "lm_head.weight" in merged
        write_model_directory(merged, self.base_dir, tmp, untie=untie)
        final = publish_version(tmp, self.directory / f"v{version}", self._written, self.keep)
        return WeightSnapshot(final, version)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
