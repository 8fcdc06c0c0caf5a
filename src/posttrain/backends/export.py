"""`export_model`: a trained model's checkpoint as a Hugging Face model directory.

The source is what a run leaves: a model directory (`model.json` and `checkpoints/<step>/`,
as LocalBackend and RayBackend write it; RayBackend's FSDP2 shards are gathered into this same
format when saved), or a job's run directory holding `models/<name>/`. A LoRA checkpoint is
merged into the base weights (W = W0 + alpha / r * B @ A, `inference.weights.merge_trainable`)
and written as plain safetensors, or written as a PEFT adapter; a full fine-tuning checkpoint is
written as its weights. Tokenizer files, chat template, config and generation config come from
the base model, and `posttrain_export.json` records where the weights came from.

Tied embeddings: a base model that ties its unembedding to its input embedding stays tied
unless training changed the two apart (an adapter on `lm_head` alone); only then the export
writes an `lm_head` of its own with `tie_word_embeddings: false`, and says so. Such a model's
adapter of the shared matrix is merged only: as a PEFT adapter it would merge wrong.

The output is written to a hidden sibling and renamed into place, so OUT_DIR holds either
nothing, the previous directory (with `force`), or the whole export.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from posttrain.backends.tinker_export import (
    TINKER_PREFIX,
    fetch_tinker_checkpoint,
    is_tinker_model,
    tinker_checkpoint,
)
from posttrain.engine import atomic_replace
from posttrain.engine.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    checkpoint_kind,
    checkpoint_problem,
    step_directories,
)
from posttrain.inference.adapters import PEFT_PREFIX, split_adapter
from posttrain.inference.weights import (
    base_weights_for_merge,
    merge_trainable,
    ties_word_embeddings,
    write_model_directory,
)
from posttrain.models.file_modes import apply_umask, save_tensors
from posttrain.models.source import resolve_model_source

ExportMode = Literal["merge", "adapter"]
ExportDtype = Literal["float32", "bfloat16"]
PROVENANCE = "posttrain_export.json"
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TOKENIZER_FILES = (
    *("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"),
    *("merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja"),
)


@dataclass(frozen=True)
class ExportResult:
    """What `export_model` wrote: where, from which checkpoint, in which form."""

    path: Path
    source: str  # the model directory, or the tinker:// checkpoint
    step: int | None  # None: a tinker:// path, which names no step
    form: Literal["merged", "adapter", "full"]
    dtype: ExportDtype
    base_model: str
    untied_embeddings: bool
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class _Source:
    """One checkpoint to export and the settings of the model it belongs to."""

    origin: str  # the model directory, or the tinker:// checkpoint
    step: int | None
    checkpoint: Path
    base_model: str  # as model.json names it, a relative one made absolute


def export_model(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    step: int | None = None,
    model: str | None = None,
    mode: ExportMode | None = None,
    dtype: ExportDtype | None = None,
    force: bool = False,
    base_url: str | None = None,
    api_key: str | None = None,
) -> ExportResult:
    """Write the checkpoint of `step` (default: the latest) of the model in `run_dir` to
    `out_dir` as a Hugging Face model directory.

    `run_dir`: a model directory (`model.json`, `checkpoints/<step>/`) or a run directory
    holding `models/<name>/` (`model` picks one when it holds several). `mode`: "merge" (the
    default for LoRA) merges the adapter into the base weights; "adapter" writes the PEFT
    adapter for `PeftModel.from_pretrained(base, out_dir)`. A full fine-tuning run is written as
    its weights. `dtype`: the weights' dtype, default the base model's. `force` replaces an
    existing `out_dir`.

    A Tinker run: `run_dir` is a `tinker://` checkpoint path, or a TinkerBackend model
    directory (its `checkpoints.jsonl`); the weights are fetched from the service at `base_url`
    (default $TINKER_BASE_URL) with `api_key` (default $TINKER_API_KEY) through the tinker SDK.
    """
    if mode not in (None, "merge", "adapter"):
        raise ValueError(f"mode must be 'merge', 'adapter' or None, got {mode!r}")
    out = Path(out_dir)
    text = str(run_dir)
    model_dir = None if text.startswith(TINKER_PREFIX) else _model_directory(Path(run_dir), model)
    if model_dir is not None and not is_tinker_model(model_dir):
        _check_out_dir(out, model_dir, force)
        return _export(_local_source(model_dir, step), out, mode, dtype, force)
    tinker_path, tinker_step = tinker_checkpoint(text if model_dir is None else model_dir, step)
    _check_out_dir(out, model_dir, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    fetch_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.fetch-", dir=out.parent))
    try:
        fetched = fetch_tinker_checkpoint(
            tinker_path, fetch_dir / "checkpoint", base_url=base_url, api_key=api_key
        )
        problem = checkpoint_problem(fetched.directory)
        if problem is not None:
            raise ValueError(f"the weights fetched from {tinker_path} are damaged: {problem}")
        source = _Source(tinker_path, tinker_step, fetched.directory, fetched.base_model)
        return _export(source, out, mode, dtype, force)
    finally:
        shutil.rmtree(fetch_dir, ignore_errors=True)


def _export(
    source: _Source, out: Path, mode: ExportMode | None, dtype: ExportDtype | None, force: bool
) -> ExportResult:
    kind = checkpoint_kind(source.checkpoint)
    if kind == "full" and mode == "adapter":
        raise ValueError(
            f"{source.checkpoint} is a full fine-tuning checkpoint (lora_rank 0): it has no "
            "adapter to write; export it without --adapter (its full weights)"
        )
    base_dir = _base_directory(source.base_model)
    out_dtype = dtype or _config_dtype(base_dir)
    if out_dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {out_dtype!r}")
    form: Literal["merged", "adapter", "full"] = (
        "full" if kind == "full" else "adapter" if mode == "adapter" else "merged"
    )
    adapter = load_file(str(source.checkpoint / ADAPTER_WEIGHTS)) if form == "adapter" else {}
    # Checked before anything is written: an adapter PEFT would merge wrong is refused.
    notes = _adapter_notes(source.checkpoint, adapter, ties_word_embeddings(base_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    apply_umask(tmp)  # mkdtemp's 0700 would hide the model from a server run as another user
    try:
        if form == "adapter":
            untied = False
            _write_adapter(source, adapter, base_dir, tmp, out_dtype)
        else:
            untied = _write_merged(source, base_dir, tmp, out_dtype, lora=kind == "lora")
            notes = (_UNTIED_NOTE,) if untied else ()
        result = ExportResult(
            out, source.origin, source.step, form, out_dtype, source.base_model, untied, notes
        )
        _write_provenance(tmp / PROVENANCE, result, source)
        with atomic_replace.name_lock(out):
            if out.exists() and not force:  # made meanwhile by someone else
                raise FileExistsError(_exists_message(out))
            atomic_replace.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


_UNTIED_NOTE = (
    "the base model ties lm_head to the input embedding, but training changed lm_head alone "
    "(a LoRA on lm_head): the export unties them (tie_word_embeddings: false, an lm_head.weight "
    "of its own)"
)


def _adapter_notes(
    checkpoint: Path, adapter: Mapping[str, torch.Tensor], tied: bool
) -> tuple[str, ...]:
    """Refuse an adapter of a tied model's shared matrix, which PEFT merges wrong; a note for
    an adapter vLLM's LoRA cannot load."""
    split = split_adapter(adapter)
    layers = sorted({name.removeprefix(PEFT_PREFIX).split(".lora_")[0] for name in split.other})
    if not layers:
        return ()
    if tied:
        # PEFT 0.21 loads it right (lm_head's LoRA shares the embedding's factors), but
        # merge_and_unload merges embed_tokens and lm_head each into their one matrix: the
        # shared delta lands on it twice, an lm_head delta changes the input embedding too.
        raise ValueError(
            f"--adapter: {checkpoint} has a LoRA on {', '.join(layers)}, and the base model ties "
            "lm_head to the input embedding (one matrix): PEFT loads that adapter right, but its "
            "merge_and_unload() merges each of the two layers into the one matrix, so the merged "
            "model is wrong, and vLLM's LoRA cannot load it. Export without --adapter (the "
            "merged model, which is right and stays tied), or train with train_unembed=False "
            "(train_unembed=True on a tied model adapts the shared matrix)"
        )
    return (
        f"the adapter has a LoRA on {', '.join(layers)}, which vLLM's LoRA cannot load (it "
        "refuses an lm_head or embedding adapter on Qwen2 and Llama); PEFT loads and merges "
        "it. For vLLM, export without --adapter (the merged model), or train with "
        "train_unembed=False",
    )


def _local_source(model_dir: Path, step: int | None) -> _Source:
    record = json.loads((model_dir / "model.json").read_text())
    base = str(record.get("base_model") or "")
    if not base:
        raise ValueError(f"{model_dir / 'model.json'} names no base_model")
    if base.startswith("./"):  # a base model inside the directory (a copied or moved run)
        base = str((model_dir / base).resolve())
    checkpoint = _checkpoint(model_dir, step)
    return _Source(str(model_dir), int(checkpoint.name), checkpoint, base)


def _model_directory(run_dir: Path, model: str | None) -> Path:
    """The model directory `run_dir` is or holds (`models/<name>/`)."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run or model directory at {run_dir}")
    if (run_dir / "model.json").is_file():
        if model is not None and model != run_dir.name:
            raise ValueError(f"{run_dir} is the directory of model {run_dir.name!r}, not {model!r}")
        return run_dir
    models = run_dir / "models"
    found = sorted(p.name for p in models.glob("*") if (p / "model.json").is_file())
    if not found:
        raise FileNotFoundError(
            f"{run_dir} is not a model directory (no model.json) and holds no models/<name>/: "
            "pass the run directory a training run printed, or its models/<name>/"
        )
    if model is None:
        if len(found) > 1:
            raise ValueError(
                f"{run_dir} holds {len(found)} models ({', '.join(found)}): pick one with "
                "--model NAME (model=NAME)"
            )
        model = found[0]
    if model not in found:
        raise ValueError(f"{run_dir} holds no model {model!r}; it holds {', '.join(found)}")
    return models / model


def _checkpoint(model_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step`, or of the latest step; intact, or an error saying why not."""
    directory = model_dir / "checkpoints"
    steps = step_directories(directory)
    if not steps:
        raise FileNotFoundError(f"{model_dir} has no checkpoints (no {directory.name}/<step>/)")
    intact = [p.name for p in steps if checkpoint_problem(p) is None]
    chosen = steps[-1] if step is None else directory / str(step)
    if chosen not in steps:
        listed = ", ".join(intact) or "none"
        raise ValueError(
            f"step {step} has no checkpoint in {directory}; steps with a checkpoint: {listed}"
        )
    problem = checkpoint_problem(chosen)
    if problem is not None:
        others = [s for s in intact if s != chosen.name]
        hint = f"; export an intact step with --step ({', '.join(others)})" if others else ""
        raise ValueError(f"checkpoint of step {chosen.name} is damaged: {problem}{hint}")
    return chosen


def _check_out_dir(out: Path, model_dir: Path | None, force: bool) -> None:
    resolved = out.resolve()
    if model_dir is not None and (
        resolved == model_dir.resolve() or resolved in model_dir.resolve().parents
    ):
        raise ValueError(f"OUT_DIR {out} holds the model being exported; pick another directory")
    if out.exists() and not force:
        raise FileExistsError(_exists_message(out))
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT_DIR {out} exists and is not a directory")
    if out.exists() and not (out / PROVENANCE).is_file() and any(out.iterdir()):
        # --force replaces an earlier export, never a directory of something else.
        raise FileExistsError(
            f"OUT_DIR {out} is a non-empty directory that is not an export (no {PROVENANCE}); "
            "refusing to replace it even with --force: pick another OUT_DIR"
        )


def _exists_message(out: Path) -> str:
    return f"OUT_DIR {out} exists; pass --force (force=True) to replace it"


def _base_directory(base_model: str) -> Path:
    """The base model's local directory (a hub id: its files in the Hugging Face cache)."""
    resolved = Path(resolve_model_source(base_model))
    if (resolved / "config.json").is_file():
        return resolved
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(resolved)))


def _config_dtype(base_dir: Path) -> ExportDtype:
    config = json.loads((base_dir / "config.json").read_text())
    saved = config.get("dtype") or config.get("torch_dtype")
    return "bfloat16" if saved == "bfloat16" else "float32"


def _write_merged(source: _Source, base_dir: Path, tmp: Path, dtype: str, *, lora: bool) -> bool:
    """The merged (or full) weights as a model directory in `tmp`; True when it unties."""
    base, tied = base_weights_for_merge(base_dir)
    # Merged in float32 whatever the base's dtype, then cast once.
    base = {k: v.float() if v.is_floating_point() else v for k, v in base.items()}
    if lora:
        config = json.loads((source.checkpoint / ADAPTER_CONFIG).read_text())
        trainable = _adapter_tensors(source.checkpoint, tied)
        scale = _lora_scale(source.checkpoint, config)
    else:
        trainable = _full_tensors(source.checkpoint)
        scale = None
    merged = merge_trainable(base, trainable, lora_scale=scale)
    head, embedding = merged.get("lm_head.weight"), merged.get("model.embed_tokens.weight")
    if tied and head is not None and embedding is not None and torch.equal(head, embedding):
        del merged["lm_head.weight"]  # a tied model's one matrix, saved under both names
    untie = tied and "lm_head.weight" in merged
    cast = _DTYPES[dtype]
    weights = {k: v.to(cast) if v.is_floating_point() else v for k, v in merged.items()}
    write_model_directory(weights, base_dir, tmp, untie=untie, dtype=dtype)
    _ensure_generation_config(base_dir, tmp)
    return untie


def _adapter_tensors(checkpoint: Path, tied: bool) -> dict[str, torch.Tensor]:
    tensors = load_file(str(checkpoint / ADAPTER_WEIGHTS))
    if tied and any(".lora_embedding_" in name for name in tensors):
        # A LoRA on a tied model's shared matrix: PEFT saves the output projection's factors
        # too, as transposed copies of the embedding's (`models.load._share_tied_factors`);
        # the embedding's pair is merged once, and both uses read it.
        tensors = {k: v for k, v in tensors.items() if ".lm_head.lora_" not in k}
    return tensors


def _lora_scale(checkpoint: Path, config: Mapping[str, object]) -> float:
    unsupported = [key for key in ("use_rslora", "use_dora") if config.get(key)]
    if unsupported or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            f"{checkpoint / ADAPTER_CONFIG} uses {', '.join(unsupported) or 'per-layer ranks'}, "
            "which posttrain never writes; merge it with PEFT's merge_and_unload instead"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not isinstance(alpha, int | float) or rank < 1:
        raise ValueError(f"{checkpoint / ADAPTER_CONFIG} has no valid r and lora_alpha")
    return float(alpha) / rank


def _full_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(files):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(checkpoint / name)))
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


def _write_adapter(
    source: _Source, tensors: Mapping[str, torch.Tensor], base_dir: Path, tmp: Path, dtype: str
) -> None:
    """The PEFT adapter, its base model recorded where PEFT and vLLM look for it."""
    config = json.loads((source.checkpoint / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = _portable_base(source.base_model, base_dir)
    config["inference_mode"] = True
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    cast = _DTYPES[dtype]
    save_tensors(
        {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()},
        tmp / ADAPTER_WEIGHTS,
        {"format": "pt"},
    )
    for name in (*_TOKENIZER_FILES, "generation_config.json"):
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, tmp / name)  # the umask's mode, not the base's


def _portable_base(base_model: str, base_dir: Path) -> str:
    """A hub id as it is; any other base model as its local directory's absolute path: PEFT
    and vLLM read neither posttrain's `packaged:` and `tiny:` names nor a GGUF file."""
    local = Path(resolve_model_source(base_model)).exists()
    return str(base_dir.resolve()) if local else base_model


def _ensure_generation_config(base_dir: Path, tmp: Path) -> None:
    """The base's generation_config.json, or one derived from its config (eos, bos, pad)."""
    if (tmp / "generation_config.json").is_file():
        return
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(base_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))


def _write_provenance(path: Path, result: ExportResult, source: _Source) -> None:
    record = {
        "format_version": 1,
        **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()},
        "checkpoint": source.origin
        if source.origin.startswith(TINKER_PREFIX)
        else str(source.checkpoint),
        "notes": list(result.notes),
    }
    record.pop("path")
    path.write_text(json.dumps(record, indent=2) + "\n")
