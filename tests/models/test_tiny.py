"""Tests for the locally built tiny models and their byte-level tokenizer."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from posttrain.models import tiny as tiny_model
from posttrain.models.tiny import (
    VOCAB_SIZE,
    build_config,
    build_tokenizer,
    make_tiny_model,
    tiny_model_path,
)

MESSAGES = [
    {"role": "system", "content": "Add numbers."},
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Now 1+1, é?"},
    {"role": "assistant", "content": "2"},
]


def _ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_loads_through_auto_classes(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == VOCAB_SIZE == model.config.vocab_size == 260
    ids_BT = torch.tensor([tokenizer("1+2=3")["input_ids"]])
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT).logits
    assert logits_BTV.shape == (1, 5, VOCAB_SIZE)
    assert logits_BTV.dtype == torch.float32
    assert torch.isfinite(logits_BTV).all()


def test_files_and_special_ids(tiny_model_dir: Path) -> None:
    assert (tiny_model_dir / "model.safetensors").is_file()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.convert_ids_to_tokens([256, 257, 258, 259]) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|im_start|>",
    ]
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        256,
        257,
        258,
    )
    assert tokenizer.unk_token is None


def test_one_token_per_byte(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Ids are the UTF-8 bytes: "1" = 0x31 = 49, "+" = 43, "é" = C3 A9 = 195, 169; no BOS added.
    assert tokenizer("1+é")["input_ids"] == [49, 43, 195, 169]
    assert tokenizer.decode([49, 43, 195, 169]) == "1+é"


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40))
def test_round_trip(text: str) -> None:
    import unicodedata

    tokenizer = build_tokenizer()
    # The NFC normaliser is the one transformation applied (as in Qwen2's tokenizer).
    expected = unicodedata.normalize("NFC", text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not any(special in text for special in tokenizer.all_special_tokens):
        assert ids == list(expected.encode("utf-8"))
    assert tokenizer.decode(ids) == expected


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_both_archs_tokenise_identically_after_loading(tmp_path: Path, arch: str) -> None:
    # transformers swaps in Qwen2Tokenizer for any qwen2 directory; the ids must not change.
    path = make_tiny_model(tmp_path, arch=arch)  # pyright: ignore[reportArgumentType]
    loaded = AutoTokenizer.from_pretrained(path)
    fresh = build_tokenizer()
    text = "Ünïcode  spaces\n\tand 's 're 123 <|eos|>"
    assert loaded(text)["input_ids"] == fresh(text)["input_ids"]
    assert _ids(loaded, MESSAGES) == _ids(fresh, MESSAGES)


def test_chat_template_rendering(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template(
        MESSAGES[1:3], tokenize=False, add_generation_prompt=False
    )
    assert rendered == ("<|bos|><|im_start|>user\n12+30=<|eos|><|im_start|>assistant\n42<|eos|>")
    prompt = tokenizer.apply_chat_template(
        MESSAGES[1:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|bos|><|im_start|>user\n12+30=<|eos|><|im_start|>assistant\n"
    encoded = tokenizer.apply_chat_template(MESSAGES[1:3], tokenize=True)
    assert encoded["input_ids"] == _ids(tokenizer, MESSAGES[1:3])
    assert encoded["input_ids"][-1] == tokenizer.eos_token_id


def test_chat_template_prefix_property(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = _ids(tokenizer, MESSAGES)
    for k in range(1, len(MESSAGES)):
        prefix = _ids(tokenizer, MESSAGES[:k])
        assert full[: len(prefix)] == prefix
        if MESSAGES[k]["role"] == "assistant":
            # Prompt + the sampled completion (content then EOS) is exactly the longer rendering.
            prompt = _ids(tokenizer, MESSAGES[:k], add_generation_prompt=True)
            completion = tokenizer(MESSAGES[k]["content"])["input_ids"] + [tokenizer.eos_token_id]
            assert prompt + completion == _ids(tokenizer, MESSAGES[: k + 1])


def test_same_seed_same_bits_other_seed_differs(tmp_path: Path) -> None:
    before = torch.random.get_rng_state()
    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG left untouched
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert "lm_head.weight" in a  # untied: the unembedding is saved as its own matrix


@pytest.mark.parametrize(
    ("arch", "size", "expected"),
    [
        ("qwen2", "tiny", 107_584),
        ("llama", "tiny", 107_328),
        ("qwen2", "mini", 510_592),
        ("llama", "mini", 509_824),
        ("qwen2", "small", 29_778_432),
        ("llama", "small", 29_768_192),
    ],
)
def test_parameter_counts_match_docstring(arch: str, size: str, expected: int) -> None:
    config = build_config(arch, size)  # pyright: ignore[reportArgumentType]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert f"{expected:,}" in (make_tiny_model.__doc__ or "")


def test_the_cached_model_has_the_umasks_modes(tmp_path: Path, wrong_modes) -> None:
    assert wrong_modes(tiny_model_path(cache_dir=tmp_path)) == {}


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path, arch="gpt2")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="size must be one of"):
        make_tiny_model(tmp_path, size="huge")  # pyright: ignore[reportArgumentType]


def test_cache_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    first = tiny_model_path(seed=1)
    assert first.parent == tmp_path / "tiny-models"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path(seed=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny_model_path(seed=2) != first
    # Only the finished directories remain: no temporary leftovers.
    assert sorted(p.name for p in (tmp_path / "tiny-models").iterdir()) == [
        first.name,
        tiny_model_path(seed=2).name,
    ]


def test_cache_loses_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_make = tiny_model.make_tiny_model

    def make_while_another_process_finishes(path: Path, **kwargs) -> Path:
        # Another builder renames its complete copy into place while we are still writing.
        real_make(tmp_path / "other", **kwargs).rename(tmp_path / "qwen2-tiny-seed6-v1")
        return real_make(path, **kwargs)

    monkeypatch.setattr(tiny_model, "make_tiny_model", make_while_another_process_finishes)
    path = tiny_model_path(tmp_path, seed=6)
    assert path == tmp_path / "qwen2-tiny-seed6-v1"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # our temporary copy is gone


def _build_in_child(cache_dir: str) -> str:
    return str(tiny_model_path(cache_dir, seed=5))


@pytest.mark.slow
def test_cache_concurrent_processes_agree(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        paths = pool.map(_build_in_child, [str(tmp_path)] * 2)
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]
    assert AutoModelForCausalLM.from_pretrained(paths[0]).config.vocab_size == VOCAB_SIZE
