"""Tests for `posttrain make-tiny-model`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from posttrain.cli.main import main
from posttrain.models.tiny import make_tiny_model


def test_make_tiny_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "llama-seed3"
    assert (
        main(["make-tiny-model", str(out), "--arch", "llama", "--size", "tiny", "--seed", "3"]) == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.hidden_size, config.vocab_size) == ("llama", 64, 260)
    # The command writes exactly what the function writes for the same arguments.
    same = load_file(make_tiny_model(tmp_path / "ref", arch="llama", seed=3) / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert written.keys() == same.keys()
    assert all(torch.equal(written[k], same[k]) for k in same)


def test_defaults(tmp_path: Path) -> None:
    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.model_type, config.num_hidden_layers) == ("qwen2", 2)


def test_tied_and_untied_embeddings(tmp_path: Path) -> None:
    for flag, tied in (("--tied", True), ("--no-tied", False)):
        out = tmp_path / flag
        assert main(["make-tiny-model", str(out), "--arch", "gemma3", flag]) == 0
        assert AutoConfig.from_pretrained(out).tie_word_embeddings is tied


@pytest.mark.parametrize("bad", [["--arch", "gpt2"], ["--size", "huge"], ["--seed", "x"]])
def test_bad_choices_exit_2(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["make-tiny-model", str(tmp_path), *bad])
    assert exc.value.code == 2


def test_size_choices_are_the_engine_sizes() -> None:
    from typing import get_args

    from posttrain.cli.tiny_cmd import ARCHES, SIZES
    from posttrain.models.tiny import Arch, Size

    assert get_args(Size) == SIZES
    assert get_args(Arch) == ARCHES


def test_real_size_with_another_arch_is_refused(tmp_path: Path) -> None:
    args = ["make-tiny-model", str(tmp_path / "m"), "--arch", "llama", "--size", "qwen2.5-0.5b"]
    assert main(args) == 2
    assert not (tmp_path / "m").exists()


@pytest.mark.usefixtures("posttrain_cache")
def test_gguf_writes_the_same_model_as_a_gguf_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gguf_files import logits

    out, gguf_file = tmp_path / "tiny-llama", tmp_path / "tiny.gguf"
    assert main(["make-tiny-model", str(out), "--gguf", str(gguf_file)]) == 0
    assert capsys.readouterr().out.split() == [str(out), str(gguf_file)]
    assert AutoConfig.from_pretrained(out).model_type == "llama"  # the default with --gguf
    # F32 weights, Q/K rows permuted and read back unpermuted: the same floats, equal logits.
    ids = [256, 259, 72, 105, 10, 257]
    assert torch.equal(logits(gguf_file, ids), logits(out, ids))


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--arch", "qwen2"], "a GGUF file is written of a llama model, not qwen2"),
        (["--size", "llama3.2-1b"], "of a test size (tiny, mini, small), not llama3.2-1b"),
    ],
)
def test_gguf_refuses_what_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], error: str
) -> None:
    args = ["make-tiny-model", str(tmp_path / "m"), "--gguf", str(tmp_path / "m.gguf"), *flags]
    assert main(args) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.gguf").exists()
