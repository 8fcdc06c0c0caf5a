"""Backend registry: built-ins, plugins with and without hooks, and the --json schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from posttrain.backends import registry
from posttrain.backends.capabilities import CONSERVATIVE, LOCAL
from posttrain.cli.main import main

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "backends.schema.json").read_text())


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_local_backend_is_described_from_its_typed_options():
    info = registry.describe("local")
    assert info.importable and info.capabilities == LOCAL and info.capabilities_source == "declared"
    names = {o.name for o in info.train_options}
    assert {"learning_rate", "kl_penalty_coef", "plot_tensors"} <= names
    lr = next(o for o in info.train_options if o.name == "learning_rate")
    assert lr.default == 1e-5 and lr.type == "float" and lr.description
    loss = next(o for o in info.train_options if o.name == "loss")
    assert loss.choices == ("ppo", "cispo", "importance_sampling", "dro", "gspo")


def test_plugin_with_hooks_and_without():
    hooked = registry.describe("plugin_example:HookedBackend")
    assert hooked.source == "plugin" and hooked.capabilities_source == "hook"
    assert hooked.capabilities.device_kinds == ("remote",)
    assert not hooked.capabilities.preserves_token_advantages
    assert [o.name for o in hooked.train_options] == ["learning_rate"]
    plain = registry.describe("plugin_example:PlainBackend")
    assert plain.capabilities == CONSERVATIVE and plain.capabilities_source == "default"
    assert plain.train_options == []


def test_bad_specs_give_clear_errors():
    with pytest.raises(ValueError, match=r"unknown backend 'locl'.*known backends: local, ray.*Did you mean 'local'"):
        registry.resolve("locl")
    with pytest.raises(ImportError, match=r"cannot import module 'no_such_pkg\.mod'"):
        registry.load("no_such_pkg.mod:Backend")
    with pytest.raises(ImportError, match="has no attribute 'Missing'"):
        registry.load("plugin_example:Missing")
    with pytest.raises(ValueError, match=r"malformed capabilities.*missing keys"):
        registry.describe("plugin_example:BrokenBackend")


def test_backends_json_matches_the_documented_schema(capsys):
    assert main(["backends", "--json", "--plugin", "plugin_example:HookedBackend"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    names = [b["name"] for b in data["backends"]]
    assert names[:2] == ["local", "ray"] and names[-1] == "plugin_example:HookedBackend"


def test_backends_text(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "local  [builtin]" in out and "kl_penalty_coef" in out
