"""GGUF files written by the tests themselves with the `gguf` package, from posttrain's tiny
llama model (`posttrain.models.tiny_gguf`), and other small files the GGUF and packaged-model
tests need. Nothing is downloaded."""

from __future__ import annotations

import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch

from posttrain.models.load import load_hf_model
from posttrain.models.tiny import make_tiny_model
from posttrain.models.tiny_gguf import write_gguf


def write_tiny_gguf(path: Path, *, seed: int = 0, half: bool = False, tied: bool = False) -> Path:
    """Write the tiny llama model of `seed` as GGUF file `path` (`models.tiny_gguf`, as
    `posttrain make-tiny-model --gguf` does); return the model directory it came from (beside
    `path`). `half` and `tied` are `write_gguf`'s."""
    source = make_tiny_model(path.with_suffix(".hf"), arch="llama", seed=seed)
    write_gguf(source, path, half=half, tied=tied)
    return source


def write_gguf_of_architecture(path: Path, architecture: str) -> None:
    """A well-formed GGUF file of `architecture` holding one small tensor."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("one tensor")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(
    source: str | Path, ids: list[int], *, half: bool = False, tied: bool = False
) -> torch.Tensor:
    """The float32 logits for `ids` of the model `load_hf_model(source)` loads; `half` rounds
    its matrices to float16 first, and `tied` unembeds with the embedding, as
    `write_tiny_gguf(half=..., tied=...)` stores the model."""
    model = load_hf_model(source)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    if half:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.copy_(param.half().float())
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def write_wheel(directory: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel of `package` holding `files` (path inside -> bytes), as pip
    downloads it from a `--find-links` directory."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    members = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: posttrain-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    members[f"{info}/RECORD"] = "".join(
        f"{name},,\n" for name in [*members, f"{info}/RECORD"]
    ).encode()
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel
