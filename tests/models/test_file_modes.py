"""Weight files and written directories get the modes the umask gives, as open() and mkdir()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models import file_modes
from posttrain.models.file_modes import save_tensors, umask


@pytest.mark.parametrize("proc", [True, False], ids=["proc", "os.umask"])
def test_umask_is_what_was_set_and_reading_it_changes_nothing(
    proc: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not proc:  # as where no /proc reports it
        monkeypatch.setattr(file_modes, "_STATUS", tmp_path / "missing")
    old = os.umask(0o027)
    try:
        assert umask() == 0o027
        assert umask() == 0o027
    finally:
        os.umask(old)


def test_saved_tensors_have_the_umasks_mode(tmp_path: Path, wrong_modes) -> None:
    directory = tmp_path / "out"
    directory.mkdir()
    save_tensors({"w": torch.arange(3.0)}, directory / "w.safetensors", {"format": "pt"})
    assert wrong_modes(directory) == {}  # safetensors' save_file alone writes 0600
    assert torch.equal(load_file(str(directory / "w.safetensors"))["w"], torch.arange(3.0))
