"""A base model that cannot be had here is refused up front by `explain`, `doctor`, `train` and
`register`, with an error naming the path, or naming HF_HUB_OFFLINE for a hub id with no local
copy. It used to pass `explain` ("preflight: ok"), then `train` spent a minute on hub retries.
A .gguf file or a packaged model passes, and `explain` and `doctor` say whether it is converted.

No test here touches the network: the hub is off (HF_HUB_OFFLINE=1) and the cache is an empty
(or hand-made) directory; asking the hub at all fails the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import huggingface_hub
import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.cli.main import main
from posttrain.clients.create import create_training_client
from posttrain.models.cache import HubUnreachableError
from posttrain.models.gguf import cached_gguf
from posttrain.models.source import check_base_model, is_path_like

HUB_ID = "posttrain-tests/no-such-model"


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path):
    """The hub switched off, an empty cache, and any request to the hub a test failure."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was asked: tests must not touch the network")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    return cache


def job(tmp_path: Path, base_model: str) -> Path:
    config = tmp_path / "job.toml"
    config.write_text(
        f'[run]\ntask = "reverse"\noutput_dir = "{tmp_path / "runs"}"\n'
        f"[model]\nbase_model = {json.dumps(base_model)}\nlora_rank = 0\n"
    )
    return config


@pytest.mark.parametrize(
    ("spec", "path_like"),
    [
        ("/abs/model", True),
        ("./model", True),
        ("../model", True),
        ("~/model", True),
        ("models/", True),
        ("runs/demo/base_model", True),  # three parts: no hub id has them
        ("Qwen/Qwen3-0.6B", False),
        ("gpt2", False),
        ("models/mine", False),  # could be either: asked of the cache, the error says both
    ],
)
def test_path_like(spec, path_like):
    assert is_path_like(spec) is path_like


def test_a_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope" / "model"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"base_model path '{missing}' does not exist")
    ):
        check_base_model(str(missing))
    with pytest.raises(FileNotFoundError, match=r"does not exist.*make-tiny-model.*hub id"):
        check_base_model("runs/demo/base_model")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        check_base_model(str(tmp_path))


def test_a_hub_id_offline_names_hf_hub_offline_unless_cached(offline_hub):
    with pytest.raises(HubUnreachableError) as caught:
        check_base_model(HUB_ID)
    message = str(caught.value)
    assert f"base_model {HUB_ID!r} is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and f"hf download {HUB_ID}" in message
    assert f"./{HUB_ID} does not exist" in message  # it could have been a relative directory
    # The same id with a copy in the cache (laid out as huggingface_hub lays it out) passes.
    repo = offline_hub / "models--posttrain-tests--no-such-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    check_base_model(HUB_ID)


@pytest.mark.parametrize("kind", ["path", "hub"])
def test_explain_and_doctor_refuse_it(tmp_path, capsys, kind):
    spec = str(tmp_path / "no-such-model") if kind == "path" else HUB_ID
    expected = f"path {spec!r} does not exist" if kind == "path" else "HF_HUB_OFFLINE is set"
    config = job(tmp_path, spec)
    assert main(["explain", str(config)]) == 1
    out = capsys.readouterr().out
    assert "preflight: problems" in out and "[model] base_model: base_model" in out
    assert expected in out
    assert main(["explain", str(config), "--json"]) == 1
    [problem] = json.loads(capsys.readouterr().out)["preflight"]["problems"]
    assert (problem["call"], problem["option"]) == ("model", "[model] base_model")
    assert main(["doctor", "--config", str(config), "--storage", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith("FAIL  base model")]
    assert expected in row
    assert "PASS  backend" in out  # reported once, on its own row


def test_doctor_passes_a_model_directory_and_a_tiny_spec(tmp_path, capsys, tiny_model_dir):
    for spec, detail in ((str(tiny_model_dir), "a model directory"), ("tiny:qwen2:tiny", "built")):
        config = job(tmp_path, spec)
        main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
        [row] = [x for x in capsys.readouterr().out.splitlines() if "base model" in x]
        assert row.startswith("PASS") and detail in row


def test_train_refuses_it_before_writing_anything(tmp_path, capsys):
    config = job(tmp_path, str(tmp_path / "no-such-model"))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "preflight: [model] base_model: base_model path" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


async def test_register_refuses_a_hub_id_with_no_local_copy(tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=HUB_ID, lora_rank=8)
    with pytest.raises(HubUnreachableError, match=r"cannot register model 'm'.*HF_HUB_OFFLINE"):
        await model.register(backend)
    assert not (tmp_path / "p" / "models" / "m" / "model.json").exists()
    await backend.close()


# A .gguf file or a packaged model (`models.gguf`, `models.packaged`): checked up
# front too, and `explain` and `doctor` say whether it is converted yet.


@pytest.mark.usefixtures("posttrain_cache")
async def test_a_trainable_model_registers_with_a_gguf_base(tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    backend = LocalBackend(tmp_path / "runs")
    model = TrainableModel(name="m", project="p", base_model=str(gguf_path), lora_rank=4)
    await model.register(backend)
    assert cached_gguf(gguf_path) is not None  # converted on first load, into the cache
    saved = json.loads((tmp_path / "runs" / "p" / "models" / "m" / "model.json").read_text())
    assert saved["base_model"] == str(gguf_path)  # the spec as given, not the cache path
    await backend.close()


@pytest.mark.usefixtures("posttrain_cache")
def test_explain_and_doctor_say_whether_it_is_converted(tiny_gguf, tmp_path, capsys):
    gguf_path, _ = tiny_gguf
    config = job(tmp_path, str(gguf_path))
    assert main(["explain", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["base_model"]["spec"] == str(gguf_path)
    assert report["base_model"]["cache"].startswith("not converted yet")
    assert report["plan"]["rl_prompt_tokens_per_step_estimate"] is None  # no tokenizer yet
    main(["import-model", str(gguf_path), str(tmp_path / "own")])  # leaves the cache empty
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    [row] = [x for x in capsys.readouterr().out.splitlines() if "  base model" in x]
    assert row.startswith("PASS") and "not converted yet" in row
    create_training_client(gguf_path, lora_rank=None)  # converts it into the cache
    entry = cached_gguf(gguf_path)
    assert main(["explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"cache = 'cached at {entry}'" in out
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    [row] = [x for x in capsys.readouterr().out.splitlines() if "  base model" in x]
    assert row.startswith("PASS") and f"cached at {entry}" in row


@pytest.mark.usefixtures("posttrain_cache")
def test_explain_refuses_a_file_that_is_not_gguf(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    assert main(["explain", str(job(tmp_path, str(fake)))]) == 1
    assert "does not start with the GGUF magic bytes" in capsys.readouterr().out


@pytest.mark.usefixtures("posttrain_cache")
def test_explain_and_doctor_refuse_a_truncated_gguf(tiny_gguf, tmp_path, capsys):
    gguf_path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:-1])  # one byte short: the last tensor's
    config = job(tmp_path, str(cut))
    assert main(["explain", str(config)]) == 1
    assert "cut.gguf is truncated or damaged" in capsys.readouterr().out
    assert main(["doctor", "--config", str(config), "--storage", str(tmp_path)]) == 1
    [row] = [x for x in capsys.readouterr().out.splitlines() if "  base model" in x]
    assert row.startswith("FAIL") and "cut.gguf is truncated or damaged" in row


@pytest.mark.usefixtures("posttrain_cache")
def test_a_job_config_names_a_packaged_model(tmp_path, capsys):
    config = job(tmp_path, "packaged:smollm2-135m-instruct")
    assert main(["explain", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "not fetched yet" in report["base_model"]["cache"]
    assert "posttrain fetch-model smollm2-135m-instruct" in report["base_model"]["cache"]
    assert main(["explain", str(job(tmp_path, "packaged:smollm3"))]) == 2
    assert "unknown packaged model 'smollm3'" in capsys.readouterr().err
