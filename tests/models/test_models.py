"""Tests for dtype parsing, model and tokenizer loading, and LoRA wrapping."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from posttrain.models.load import (
    apply_lora,
    load_hf_model,
    load_tokenizer,
    parse_dtype,
)
from posttrain.models.lora import ATTN_MODULES, MLP_MODULES, LoraSettings


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_parse_dtype(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype
    assert parse_dtype(dtype) is dtype


@pytest.mark.parametrize("bad", ["fp8", "float64", "fp32", torch.float64, torch.int8])
def test_parse_dtype_rejects_with_choices(bad: str | torch.dtype) -> None:
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        parse_dtype(bad)


def test_load_hf_model(tiny_model_dir: Path) -> None:
    model = load_hf_model(tiny_model_dir)
    assert not model.training
    assert model.config._attn_implementation == "posttrain_sdpa"  # SDPA (models.attention)
    assert next(model.parameters()).dtype == torch.float32
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.attention_dropout == 0.0
    with torch.no_grad():
        logits_BTV = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits_BTV.shape == (1, 3, 260)


def test_load_hf_model_bfloat16_from_str_path(tiny_model_dir: Path) -> None:
    model = load_hf_model(str(tiny_model_dir), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_dropout_zeroed_even_in_train_mode(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    # A copy of the tiny model whose config asks for attention dropout 0.5.
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"attention_dropout": 0.5}))
    model = load_hf_model(tmp_path / "m")
    assert model.config.attention_dropout == 0.0
    model.train()
    ids_BT = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        first, second = model(input_ids=ids_BT).logits, model(input_ids=ids_BT).logits
    assert torch.equal(first, second)  # no randomness left in train mode


@pytest.mark.parametrize("missing", ["/no/such/model", "./no-such-model", "~/no-such-model"])
def test_missing_local_path_names_it(missing: str) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_hf_model(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_tokenizer(missing)


def test_missing_path_object_and_nested_relative(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="a/b/c"):
        load_hf_model("a/b/c")  # two slashes: not a hub id


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_hf_model(tmp_path)


def test_load_tokenizer(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.pad_token_id == 258
    assert tokenizer.decode(tokenizer("3+4=7")["input_ids"]) == "3+4=7"


def test_lora_settings_defaults_and_checks() -> None:
    default = LoraSettings()
    assert (default.rank, default.alpha, default.dropout) == (32, 32.0, 0.0)
    assert default.target_modules() == [*ATTN_MODULES, *MLP_MODULES, "lm_head"]
    assert LoraSettings.default_alpha(8) == 32.0
    assert LoraSettings.default_alpha(64) == 64.0
    for kwargs, match in [
        (dict(rank=0), "rank must be >= 1"),
        (dict(alpha=0.0), "alpha must be > 0"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(train_attn=False, train_mlp=False, train_unembed=False), "at least one"),
    ]:
        with pytest.raises(ValueError, match=match):
            LoraSettings(**kwargs)


FLAGS = [
    (True, True, True),
    (True, False, False),
    (False, True, False),
    (False, False, True),
    (True, False, True),
]


@pytest.mark.parametrize(("attn", "mlp", "unembed"), FLAGS)
def test_apply_lora_trains_exactly_the_flagged_modules(
    tiny_model_dir: Path, attn: bool, mlp: bool, unembed: bool
) -> None:
    settings = LoraSettings(rank=4, alpha=8, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
    model = apply_lora(load_hf_model(tiny_model_dir), settings, seed=0)
    assert isinstance(model, PeftModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layer_modules = [
        *(f"self_attn.{m}" for m in ATTN_MODULES if attn),
        *(f"mlp.{m}" for m in MLP_MODULES if mlp),
    ]
    expected = {
        f"base_model.model.model.layers.{layer}.{module}.lora_{ab}.default.weight"
        for layer in range(2)
        for module in layer_modules
        for ab in "AB"
    }
    if unembed:
        expected |= {f"base_model.model.lm_head.lora_{ab}.default.weight" for ab in "AB"}
    assert trainable == expected
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert all(4 in shape for shape in shapes.values())  # rank 4 on one side of A and B
    config = model.peft_config["default"]
    assert isinstance(config, LoraConfig)
    assert config.lora_alpha == 8


def test_apply_lora_starts_equal_to_base_and_seed_is_deterministic(tiny_model_dir: Path) -> None:
    ids_BT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        base_BTV = load_hf_model(tiny_model_dir)(input_ids=ids_BT).logits
        before = torch.random.get_rng_state()
        a = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=7)
        assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
        b = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=7)
        c = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=8)
        # B = 0 at init, so the adapter adds exact zeros: bit-identical logits.
        assert torch.equal(a(input_ids=ids_BT).logits, base_BTV)
    a_state, b_state, c_state = (m.state_dict() for m in (a, b, c))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(a_state[name], b_state[name])
    assert not torch.equal(a_state[name], c_state[name])


def test_seeded_apply_lora_on_the_cpu_never_touches_cuda(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU machine a CPU run must not initialise CUDA (nor seed its generators): make
    this machine look like one with a GPU whose every RNG entry point fails if called. The
    adapters still come out as a plain torch.manual_seed(seed) before get_peft_model makes them."""

    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("apply_lora touched CUDA for a model on the CPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("_lazy_init", "get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        monkeypatch.setattr(torch.cuda, name, touched)
    before = torch.random.get_rng_state()
    ours = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    monkeypatch.undo()  # the reference below seeds the (absent) GPUs as well
    settings = LoraSettings(rank=4)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # pyright: ignore[reportArgumentType]
        target_modules=settings.target_modules(),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        reference = get_peft_model(load_hf_model(tiny_model_dir), config)
    expected = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
