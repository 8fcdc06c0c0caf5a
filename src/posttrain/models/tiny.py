"""Tiny causal LMs with a byte-level tokenizer, built locally for tests and examples.

The tokenizer has one token per byte (ids 0..255 are the byte values) plus four special tokens,
so arithmetic and string tasks tokenise one character per token and the vocabulary stays small.
The chat template renders each turn as ``<|im_start|>{role}\\n{content}<|eos|>`` after a leading
``<|bos|>``. An assistant turn therefore ends with EOS, exactly what a sampler stops on, and
rendering a conversation prefix (with or without the generation prompt) yields a token prefix of
rendering the longer conversation: sampled tokens can be stitched into multi-turn trajectories
without re-rendering.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from posttrain.models.cache import cache_root
from posttrain.models.file_modes import apply_umask, apply_umask_to_weights

Arch = Literal["qwen2", "llama", "qwen3", "qwen3_5", "gemma3", "olmo3"]
Size = Literal["tiny", "mini", "small", "qwen2.5-0.5b", "llama3.2-1b", "qwen3-0.6b", "qwen3.5-0.8b"]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Seeding and drawing from torch's global RNG must not interleave between threads.
_INIT_LOCK = threading.Lock()

# Bump when the files make_tiny_model writes change, so cached copies are rebuilt.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class _Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int


_SHAPES: dict[Size, _Shape] = {
    # 107,584 parameters for qwen2 (q/k/v biases), 107,328 for llama.
    "tiny": _Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=512),
    # 510,592 parameters for qwen2, 509,824 for llama: big enough to learn string reversal by
    # RL in a few CPU minutes (the flagship example), where tiny plateaus.
    "mini": _Shape(hidden=128, layers=3, heads=4, kv_heads=2, intermediate=256, max_positions=512),
    # 29,778,432 parameters for qwen2, 29,768,192 for llama.
    "small": _Shape(
        hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1408, max_positions=1024
    ),
}


@dataclass(frozen=True)
class _PublicConfig:
    """The fields of a published config.json that shape the network (special token ids are
    the byte-level tokenizer's own)."""

    arch: Arch
    vocab_size: int
    shape: _Shape
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: dict[str, float | int | str] | None = None
    extra: dict[str, object] = field(default_factory=dict[str, object])  # the family's fields


# Qwen3.5's published pattern: three GatedDeltaNet layers, then one full-attention layer.
_QWEN3_5_LAYERS = ["linear_attention"] * 3 + ["full_attention"]

# The real sizes: Qwen2.5-0.5B(-Instruct), Llama-3.2-1B, Qwen3-0.6B and Qwen3.5-0.8B (its text
# model), with tied embeddings as published.
_PUBLIC: dict[Size, _PublicConfig] = {
    "qwen2.5-0.5b": _PublicConfig(
        arch="qwen2",
        vocab_size=151936,
        shape=_Shape(896, 24, 14, 2, 4864, max_positions=32768),
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "llama3.2-1b": _PublicConfig(
        arch="llama",
        vocab_size=128256,
        shape=_Shape(2048, 16, 32, 8, 8192, max_positions=131072),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-0.6b": _PublicConfig(
        arch="qwen3",
        vocab_size=151936,
        shape=_Shape(1024, 28, 16, 8, 3072, max_positions=40960),
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        extra={"head_dim": 128},
    ),
    "qwen3.5-0.8b": _PublicConfig(
        arch="qwen3_5",
        vocab_size=248320,
        shape=_Shape(1024, 24, 8, 2, 3584, max_positions=262144),
        rope_theta=10000000.0,
        rms_norm_eps=1e-6,
        rope_scaling={"partial_rotary_factor": 0.25},
        extra={
            "head_dim": 256,
            "layer_types": _QWEN3_5_LAYERS * 6,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
    ),
}
# Frequent characters first, so the filler merges of a large vocabulary are common n-grams.
_FILLER_ALPHABET = " etaoinshrdlcumwfgypbvkjxqz"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenises to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _filler_merges(count: int) -> list[tuple[str, str]]:
    """`count` BPE merges over printable ASCII: every pair, then triples, frequent letters first.

    Each merge joins tokens that exist already (two characters, or a pair and a character), so
    the merges form a valid byte-level BPE that grows the vocabulary to a real model's size.
    """
    to_unicode = _bytes_to_unicode()
    text = _FILLER_ALPHABET + "".join(
        chr(b) for b in range(32, 127) if chr(b) not in _FILLER_ALPHABET
    )
    alphabet = [to_unicode[ord(c)] for c in text]
    merges = [(a, b) for a in alphabet for b in alphabet][:count]
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    merges += itertools.islice(triples, count - len(merges))
    if len(merges) < count:
        raise ValueError(f"at most {len(alphabet) ** 2 + len(alphabet) ** 3} filler merges")
    return merges


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer: token id == byte value, specials at 256..259, chat template.

    A larger `vocab_size` adds BPE merges (`_filler_merges`) at ids 260 and up, so a real
    architecture's embedding and unembedding have their published shapes and every id is a
    token the tokenizer can produce.
    """
    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {VOCAB_SIZE}, got {vocab_size}")
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)})
    merges = _filler_merges(vocab_size - VOCAB_SIZE)
    vocab.update({a + b: VOCAB_SIZE + i for i, (a, b) in enumerate(merges)})
    # Without merges the BPE is a plain byte lookup after ByteLevel maps bytes to characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # NFC because transformers loads any qwen2 directory with Qwen2Tokenizer, which imposes it;
    # doing the same here makes both load paths (and both archs) tokenise identically.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=_SHAPES["small"].max_positions,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


def _head_dim(shape: _Shape) -> dict[str, object]:
    """Families whose config defaults a large head_dim (128 or 256) get the shape's own."""
    return {"head_dim": shape.hidden // shape.heads}


def _pattern(shape: _Shape, every: int, local: str, wide: str) -> list[str]:
    """The published layer pattern, one `wide` layer per `every`, scaled down: the last layer
    is always `wide`, so a 2-layer test model has one layer of each kind."""
    return [
        wide if (i % every == every - 1 or i == shape.layers - 1) else local
        for i in range(shape.layers)
    ]


# A test model's sliding window: short, so that test prompts run past it.
TEST_SLIDING_WINDOW = 16


def _qwen3_5(shape: _Shape) -> dict[str, object]:
    """Qwen3.5's text model, hybrid: three GatedDeltaNet linear-attention layers to one full
    attention layer, as published."""
    head = shape.hidden // shape.heads
    return {
        **_head_dim(shape),
        "layer_types": _pattern(shape, 4, "linear_attention", "full_attention"),
        "linear_num_key_heads": shape.kv_heads,
        "linear_num_value_heads": shape.heads,
        "linear_key_head_dim": head,
        "linear_value_head_dim": head,
        "linear_conv_kernel_dim": 4,
    }


def _sliding(every: int) -> Callable[[_Shape], dict[str, object]]:
    def extra(shape: _Shape) -> dict[str, object]:
        return {
            **_head_dim(shape),
            "layer_types": _pattern(shape, every, "sliding_attention", "full_attention"),
            "sliding_window": TEST_SLIDING_WINDOW,
        }

    return extra


def _gemma3(shape: _Shape) -> dict[str, object]:
    """Gemma 3's text model: five sliding-window layers to one global layer, as published."""
    return {**_sliding(6)(shape), "query_pre_attn_scalar": shape.hidden // shape.heads}


# Each architecture's config beyond the common shape: (transformers config class, its extra
# fields for a test size). Classes are looked up by name, so an older transformers without one
# (Qwen3.5, OLMo 3) fails only when that architecture is asked for.
_FAMILIES: dict[str, Callable[[_Shape], dict[str, object]]] = {
    "qwen2": lambda shape: {},
    "llama": lambda shape: {},
    "qwen3": _head_dim,
    "qwen3_5": _qwen3_5,
    "gemma3": _gemma3,
    "olmo3": _sliding(4),
}
CONFIG_CLASSES = {
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "qwen3_5": "Qwen3_5TextConfig",
    "gemma3": "Gemma3TextConfig",
    "olmo3": "Olmo3Config",
}


def _config_class(arch: str) -> Callable[..., PretrainedConfig]:
    import transformers

    name = CONFIG_CLASSES[arch]
    found = getattr(transformers, name, None)
    if found is None:
        raise ValueError(
            f"arch {arch!r} needs transformers' {name}, which transformers "
            f"{transformers.__version__} lacks; upgrade transformers"
        )
    return found


def resolve_arch(arch: Arch | None, size: Size) -> Arch:
    """The architecture of `size`: a real size's own, else `arch` (qwen2 when None)."""
    public = _PUBLIC.get(size)
    if public is None:
        return arch or "qwen2"
    if arch is not None and arch != public.arch:
        raise ValueError(f"size {size!r} is a {public.arch} architecture, got arch={arch!r}")
    return public.arch


def build_config(
    arch: Arch | None = None, size: Size = "tiny", *, tied: bool | None = None
) -> PretrainedConfig:
    """The transformers config for an (arch, size) pair, with the tokenizer's special ids.

    `qwen2.5-0.5b`, `llama3.2-1b`, `qwen3-0.6b` and `qwen3.5-0.8b` are the published configs
    of Qwen2.5-0.5B, Llama-3.2-1B, Qwen3-0.6B and Qwen3.5-0.8B's text model (vocabulary,
    shapes, layer pattern, rope, tied embeddings); the other sizes are test models.
    `tied` ties the unembedding to the input embedding (None: as published for a real size,
    untied for a test size).
    """
    if size not in _SHAPES and size not in _PUBLIC:
        raise ValueError(f"size must be one of {sorted([*_SHAPES, *_PUBLIC])}, got {size!r}")
    if arch is not None and arch not in _FAMILIES:
        raise ValueError(f"arch must be one of {sorted(_FAMILIES)}, got {arch!r}")
    arch = resolve_arch(arch, size)
    public = _PUBLIC.get(size)
    shape = public.shape if public else _SHAPES[size]
    extra: dict[str, object] = _FAMILIES[arch](shape)
    if public is not None:
        rope: dict[str, object] = {"rope_type": "default", **(public.rope_scaling or {})}
        extra = {**public.extra, "rope_parameters": {**rope, "rope_theta": public.rope_theta}}
    return _config_class(arch)(
        vocab_size=public.vocab_size if public else VOCAB_SIZE,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        bos_token_id=256 + SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=256 + SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=256 + SPECIAL_TOKENS.index(PAD_TOKEN),
        # Test sizes untie the unembedding (trainable apart, a LoRA target); real sizes tie it
        # as published.
        tie_word_embeddings=(public is not None) if tied is None else tied,
        rms_norm_eps=public.rms_norm_eps if public else 1e-6,
        initializer_range=0.02,
        **extra,
    )


def make_tiny_model(
    path: str | Path,
    *,
    arch: Arch | None = None,
    size: Size = "tiny",
    seed: int = 0,
    tied: bool | None = None,
    gguf: str | Path | None = None,
) -> Path:
    """Write a randomly initialised causal LM and its tokenizer to `path`; same seed, same bits.

    Parameter counts: tiny 107,584 (qwen2) / 107,328 (llama); mini 510,592 / 509,824;
    small 29,778,432 (qwen2) / 29,768,192 (llama); qwen2.5-0.5b 494,032,768;
    llama3.2-1b 1,235,814,400; qwen3-0.6b 596,049,920; qwen3.5-0.8b 752,393,024 (the text
    model). `arch=None` is qwen2 for the test sizes and the published
    architecture for a real size. Real sizes are saved in bfloat16, as published (about 1 and
    2.5 GB); the test sizes in float32. `tied=True` ties a test size's unembedding to its
    input embedding as real models do (one matrix: a tiny model's count drops by 64 x 260).
    The directory loads with `AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`. `gguf` also writes the model as that GGUF file
    (`models.tiny_gguf`): a llama model, the default `arch` then, of a test size.
    """
    if gguf is not None:
        arch = _gguf_arch(arch, size)
    config = build_config(arch, size, tied=tied)
    tokenizer = build_tokenizer(config.vocab_size)
    tokenizer.model_max_length = config.max_position_embeddings
    dtype = torch.bfloat16 if size in _PUBLIC else torch.float32
    # fork_rng keeps the caller's global RNG untouched by our seeding.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    apply_umask_to_weights(out)
    tokenizer.save_pretrained(out)
    if gguf is not None:
        from posttrain.models.tiny_gguf import write_gguf

        write_gguf(out, Path(gguf))
    return out


def _gguf_arch(arch: Arch | None, size: Size) -> Arch:
    """The architecture of a tiny model written as GGUF too, refused before anything is built
    when `models.tiny_gguf` cannot write it."""
    if arch not in (None, "llama"):
        raise ValueError(f"a GGUF file is written of a llama model, not {arch}")
    if size in _PUBLIC:
        raise ValueError(f"a GGUF file is written of a test size (tiny, mini, small), not {size}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "writing a GGUF file needs the gguf package: pip install 'posttrain[gguf]'"
        )
    return "llama"


def default_cache_dir() -> Path:
    """`$POSTTRAIN_CACHE/tiny-models`, else `~/.cache/posttrain/tiny-models`."""
    return cache_root() / "tiny-models"


def tiny_model_path(
    cache_dir: str | Path | None = None,
    *,
    arch: Arch | None = None,
    size: Size = "tiny",
    seed: int = 0,
) -> Path:
    """Build the tiny model once into a cache directory keyed by its arguments, then reuse it.

    The model is written to a temporary sibling directory and renamed into place, so concurrent
    processes (pytest-xdist workers) never see a half-written model.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{resolve_arch(arch, size)}-{size}-seed{seed}-v{FORMAT_VERSION}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    apply_umask(tmp)  # a cache another user or a container may read
    try:
        make_tiny_model(tmp, arch=arch, size=size, seed=seed)
        try:
            tmp.rename(final)
        except OSError:
            # Another process won the race; its copy is complete and identical.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
