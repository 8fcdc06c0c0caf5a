"""GGUF files as base models: converted once into a safetensors model directory, then cached.

transformers reads the file (`from_pretrained(folder, gguf_file=name)`, with the `gguf`
package): the weights dequantized to float32, the tokenizer and chat template from the file's
metadata. A model loaded that way refuses `save_pretrained` ("quantized with gguf ... not
serializable"), so its weights go into a plain model of the same config, which saves as
safetensors beside the tokenizer.

The saved dtype is the narrowest of bfloat16, float16 and float32 that holds every dequantized
weight exactly (`lossless_dtype`). A 4-bit block such as Q4_1 stores w = d * q + m with float16
d and m, and those values need more than bfloat16's 8 significant bits: in SmolLM2-135M-Instruct's
Q4_1 file only 3% of the embedding's values and about 25% of each layer's survive bfloat16, so
it is saved in float32. An F16 or BF16 file is saved in its own dtype, at half the size.

The cache is `$POSTTRAIN_CACHE/gguf/<sha256>-v<FORMAT>` (default ~/.cache/posttrain), built in a
temporary directory beside it and renamed, under a lock per file: a killed conversion leaves no
entry, and a second process converting the same file waits for the first and reads its result.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.models.cache import (
    Echo,
    ModelSourceError,
    cache_root,
    copy_model_dir,
    exclusive,
    new_dir,
    publish_dir,
    say,
    sha256_file,
    write_json,
)
from posttrain.models.file_modes import apply_umask_to_weights
from posttrain.models.gguf_header import GGUFHeaderError, read_layout

if TYPE_CHECKING:
    import torch

# Bump when the files a conversion writes change, so cached conversions are redone.
FORMAT = 1
RECORD = "posttrain-import.json"  # what was converted, from what, with which versions
_MAGIC = b"GGUF"


def gguf_cache() -> Path:
    """Where converted GGUF files live: `$POSTTRAIN_CACHE/gguf`."""
    return cache_root() / "gguf"


def cache_entry(sha256: str) -> Path:
    """The cached conversion of the GGUF file whose sha256 is `sha256` (it may not exist yet)."""
    return gguf_cache() / f"{sha256}-v{FORMAT}"


def check_gguf_file(spec: str | Path) -> Path:
    """The GGUF file `spec` names: it exists, starts with the GGUF magic bytes and holds every
    byte its tensor table names (`gguf_header`: milliseconds, whatever its size), and the `gguf`
    package is installed unless the file's conversion is cached. Nothing is converted."""
    text = str(spec)
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"GGUF file {text!r} does not exist; give the path of a .gguf file (or a packaged "
            "model: `posttrain fetch-model --list`)"
        )
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {text!r} is a directory, not a file")
    with path.open("rb") as handle:
        head = handle.read(len(_MAGIC))
    if head != _MAGIC:
        raise ModelSourceError(
            f"GGUF file {path} does not start with the GGUF magic bytes {_MAGIC!r}, so it is not "
            "a GGUF file, or its start is damaged; download it again and compare its sha256 with "
            "the publisher's"
        )
    # Hashing the file to find its conversion is only worth it when the package is missing;
    # a file converted before is whole (its sha256 names the conversion).
    if importlib.util.find_spec("gguf") is None:
        if cached_gguf(path) is None:
            require_gguf_package(f"reading GGUF file {path}")
        return path
    _check_layout(path)
    return path


def _check_layout(path: Path) -> None:
    """Raise unless the file holds its whole header and every tensor its table names."""
    size = path.stat().st_size
    try:
        layout = read_layout(path)
        if layout.data_end > size:
            raise GGUFHeaderError(f"its tensor table needs {layout.data_end} bytes")
    except GGUFHeaderError as exc:
        raise ModelSourceError(
            f"GGUF file {path} is truncated or damaged ({size} bytes; {exc}); download it "
            "again and compare its sha256 with the publisher's"
        ) from None


def require_gguf_package(doing: str) -> None:
    """Raise, naming the extra to install, unless the `gguf` package (transformers reads GGUF
    files with it) is installed."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(
            f"{doing} needs the gguf package, which is not installed: pip install "
            "'posttrain[gguf]' (or pip install gguf)"
        )


def cached_gguf(spec: str | Path) -> Path | None:
    """The cached conversion of GGUF file `spec`, or None (none yet, or no such file)."""
    path = Path(spec).expanduser()
    if not path.is_file():
        return None
    entry = cache_entry(file_sha256(path))
    return entry if entry.is_dir() else None


def import_gguf(
    spec: str | Path,
    out_dir: str | Path | None = None,
    *,
    sha256: str | None = None,
    echo: Echo = say,
) -> Path:
    """The model directory (safetensors, tokenizer, chat template) converted from GGUF file `spec`.

    Without `out_dir`, the cached conversion: made now if missing (about 35 s for SmolLM2's
    98 MB file on 2 cores), read from the cache afterwards. With `out_dir`, a copy written there
    (from the cache when it has one), which must not exist or be empty. `sha256`, when the caller
    has just checked the file's, spares hashing it again.
    """
    path = check_gguf_file(spec)
    digest = sha256 or file_sha256(path)
    entry = cache_entry(digest)

    def convert(tmp: Path) -> None:
        convert_gguf(path, tmp, sha256=digest, echo=echo)

    if out_dir is None:
        if entry.is_dir():
            return entry
        with exclusive(gguf_cache() / "locks" / entry.name, f"converting {path.name}", echo):
            if entry.is_dir():  # converted by the process we waited for
                return entry
            for stale in entry.parent.glob(f".{entry.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
            return publish_dir(entry, convert)
    if entry.is_dir():
        echo(f"copying the cached conversion of {path.name} from {entry}")
        return copy_model_dir(entry, out_dir)
    return publish_dir(new_dir(out_dir), convert)


def convert_gguf(path: Path, out: Path, *, sha256: str | None = None, echo: Echo = say) -> None:
    """Write the model directory of GGUF file `path` into the directory `out`."""
    require_gguf_package(f"reading GGUF file {path}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    size_mb = path.stat().st_size / 1e6
    echo(f"converting {path.name} ({size_mb:.0f} MB) into a safetensors model, once per file")
    folder, name = str(path.parent), path.name
    try:
        echo("reading and dequantizing the weights (transformers' GGUF reader)")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        echo("reading the tokenizer and chat template")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # whatever the reader raised: say which file and what to do
        raise unreadable_gguf(path, exc) from exc
    state = model.state_dict()
    dtype = lossless_dtype(state.values())
    config = model.config
    # The GGUF quantizer's settings would make transformers read the saved directory as GGUF.
    vars(config).pop("quantization_config", None)
    with torch.device("meta"):  # no second copy of the weights: they are assigned below
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    count = sum(p.numel() for p in plain.parameters()) / 1e6
    echo(f"writing {count:.1f}M parameters as {str(dtype).removeprefix('torch.')} safetensors")
    plain.save_pretrained(out)
    apply_umask_to_weights(out)
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and tokenizer.model_max_length > context:
        tokenizer.model_max_length = context  # the reader leaves transformers' 1e30 default
    tokenizer.save_pretrained(out)
    write_json(out / RECORD, _record(path, sha256 or file_sha256(path), dtype))
    echo(f"converted {path.name} in {time.perf_counter() - start:.0f} s")


def lossless_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The narrowest of bfloat16, float16 and float32 that holds every one of `tensors` exactly
    (integer tensors aside)."""
    import torch

    fits = [torch.bfloat16, torch.float16]
    for tensor in tensors:
        if tensor.is_floating_point():
            fits = [d for d in fits if torch.equal(tensor.to(d).to(tensor.dtype), tensor)]
        if not fits:
            return torch.float32
    return fits[0]


def unreadable_gguf(path: Path, error: BaseException) -> ModelSourceError:
    """Why transformers could not read GGUF file `path`: the file is damaged (the gguf package's
    own reader fails too), or transformers does not read its architecture."""
    import transformers
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except Exception as exc:
        return ModelSourceError(
            f"GGUF file {path} is truncated or damaged ({path.stat().st_size} bytes; the gguf "
            f"package cannot read it either: {exc}); download it again and compare its sha256 "
            "with the publisher's"
        )
    architecture = field.contents() if field is not None else "unknown"
    return ModelSourceError(
        f"transformers {transformers.__version__} cannot read GGUF file {path} (architecture "
        f"{architecture!r}): {type(error).__name__}: {error}. transformers reads only some "
        "architectures from GGUF (https://huggingface.co/docs/transformers/gguf); a newer "
        "transformers may read this one, or give the original model's directory or hub id as "
        "base_model instead"
    )


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime, inode) under the cache so a file
    is read once: hashing a 98 MB GGUF takes about 0.2 s, a 4 GB one about 10 s."""
    stat = path.stat()
    where = str(path.resolve())
    key: dict[str, object] = {
        "path": where,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "inode": stat.st_ino,
        "device": stat.st_dev,
    }
    record = gguf_cache() / "hashes" / f"{hashlib.sha256(where.encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(record.read_text())
        if {k: saved.get(k) for k in key} == key and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or unreadable: hash the file
    digest = sha256_file(path)
    with contextlib.suppress(OSError):  # a read-only cache costs a hash per call, nothing else
        write_json(record, {**key, "sha256": digest})
    return digest


def _record(path: Path, sha256: str, dtype: torch.dtype) -> dict[str, object]:
    from importlib.metadata import version

    import transformers

    return {
        "source": path.name,
        "sha256": sha256,
        "dtype": str(dtype).removeprefix("torch."),
        "format": FORMAT,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
    }
