"""A tiny llama model (`models.tiny`) written as a GGUF file, to try `.gguf` base models without a
download: `posttrain make-tiny-model DIR --gguf FILE`, `make_tiny_model(DIR, gguf=FILE)`.

The file has the keys and tensor layout llama.cpp's convert_hf_to_gguf.py writes for a Llama
checkpoint (Q and K rows permuted for its rotary layout), float32 weights (or float16 matrices,
as an F16 file stores them), and the byte-level tokenizer and chat template in its metadata.
transformers' GGUF reader gives the same model back. Only the byte-level tokenizer of the test
sizes is written this way: it has no merges, which the reader then derives from nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a Q or K projection's rows (transformers undoes it)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: Path, path: Path, *, half: bool = False, tied: bool = False) -> Path:
    """Write the tiny llama model in `model_dir` as GGUF file `path`; return `path`. `half`
    stores the matrices as F16 (1-D weights stay F32, as llama.cpp keeps them); `tied` leaves
    out the unembedding, as llama.cpp does for a model whose unembedding is its embedding."""
    import gguf  # make_tiny_model checks it is there, naming the extra
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    if config.model_type != "llama":
        raise ValueError(
            f"{model_dir} is a {config.model_type} model; a GGUF file is written of a llama one "
            "(make-tiny-model --arch llama)"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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
        if gguf_name is None:
            raise ValueError(f"{model_dir}: no GGUF name for tensor {name!r}")
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
