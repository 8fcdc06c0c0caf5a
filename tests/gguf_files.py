"""GGUF files written by the tests themselves with the `gguf` package, from posttrain's tiny
llama model: the keys and tensor layout llama.cpp's convert_hf_to_gguf.py writes for a Llama
checkpoint (Q and K rows permuted for its rotary layout), with the byte-level tokenizer and
chat template in the metadata. Nothing is downloaded."""

from __future__ import annotations

import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.engine.models import load_hf_model
from posttrain.engine.tiny import make_tiny_model


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a Q or K projection's rows (transformers undoes it)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, *, seed: int = 0, half: bool = False, tied: bool = False) -> Path:
    """Write the tiny llama model of `seed` as GGUF file `path`; return the model directory it
    came from (beside `path`). `half` stores the matrices as F16, as an F16 GGUF does (1-D
    weights stay F32, as llama.cpp keeps them). `tied` leaves out the unembedding, as llama.cpp
    does for a model whose unembedding is its embedding (SmolLM2, Qwen2.5-0.5B)."""
    source = make_tiny_model(path.with_suffix(".hf"), arch="llama", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("posttrain tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)

    # What transformers' GGUF tokenizer reader (integrations/gguf) reads: a byte-level ("gpt2")
    # vocabulary in id order, control tokens marked, the special ids and the chat template.
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    # The tiny vocabulary has no merges, and the writer drops an empty array; with scores and
    # no merges the reader derives merges from the vocabulary (none here).
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)  # the chat template writes <|bos|> itself
    writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.numpy()
        if name.endswith("q_proj.weight"):
            weight = _permute(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _permute(weight, config.num_key_value_heads)
        if half and weight.ndim == 2:
            weight = weight.astype(np.float16)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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
