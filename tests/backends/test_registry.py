"""Backend registry: built-ins, plugins with and without hooks (on the class or the module),
the `posttrain.backends` entry-point group, `posttrain.backends.load`, and the --json schema."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

import posttrain.backends
from posttrain.backends.capabilities import CONSERVATIVE, LOCAL
from posttrain.backends.options import (
    HELP,
    LocalRLOptions,
    LocalSFTOptions,
    SFTOptions,
    option_names,
)
from posttrain.backends.plugins import registry
from posttrain.cli.main import main

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "backends.schema.json").read_text())

# A package installed the way pip installs one: the module, and a dist-info directory whose
# entry_points.txt is what importlib.metadata reads for the `posttrain.backends` group.
MODULE = '''
"""A plugin whose hooks live on the module, next to a factory function."""


class Remote:
    def __init__(self, path, *, endpoint: str, retries: int = 3):
        self.path, self.endpoint, self.retries = path, endpoint, retries


def make_backend(path=".posttrain", *, endpoint: str, retries: int = 3):
    return Remote(path, endpoint=endpoint, retries=retries)


def posttrain_capabilities():
    return {
        "reports_sync_loss": False,
        "preserves_token_advantages": True,
        "supports_checkpoint_resume": False,
        "resume_runtime_dependent": True,
        "supports_sft": False,
        "supports_kl_reference": False,
        "supports_sampling": True,
        "device_kinds": ["remote"],
    }


def posttrain_option_schema():
    return {"train": [{"name": "learning_rate", "type": "float", "default": 1e-5,
                       "choices": None, "description": "step size"}]}
'''


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """`acme_backends` installed into a directory on sys.path, under the entry-point name 'acme'."""
    (tmp_path / "acme_backends").mkdir()
    (tmp_path / "acme_backends" / "__init__.py").write_text("")
    (tmp_path / "acme_backends" / "remote.py").write_text(textwrap.dedent(MODULE))
    dist = tmp_path / "acme_backends-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-backends\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[posttrain.backends]\nacme = acme_backends.remote:make_backend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("acme_backends")]:
        del sys.modules[name]


def test_local_backend_is_described_from_its_typed_options():
    info = registry.describe("local")
    assert info.importable and info.capabilities == LOCAL and info.capabilities_source == "declared"
    names = {o.name for o in info.train_options}
    assert names == set(option_names(LocalRLOptions))
    lr = next(o for o in info.train_options if o.name == "learning_rate")
    assert lr.default == 1e-5 and lr.type == "float" and lr.description == HELP["learning_rate"]
    loss = next(o for o in info.train_options if o.name == "loss")
    assert loss.choices == ("ppo", "cispo", "importance_sampling", "dro", "gspo")
    assert {o.name for o in info.train_sft_options} == set(option_names(LocalSFTOptions))
    tinker = registry.describe("tinker")
    assert {o.name for o in tinker.train_sft_options} == set(option_names(SFTOptions))
    assert [p.name for p in info.constructor][:1] == ["path"]


@pytest.mark.parametrize("name", list(registry.BUILTINS))
def test_every_option_of_every_builtin_has_a_description(name):
    info = registry.describe(name)
    for option in [*info.train_options, *info.train_sft_options]:
        assert option.description.strip(), f"{name}: {option.name} has no description"


def test_help_lists_only_options_that_exist():
    # A description for an option no backend has any more is a stale second copy.
    known = set().union(
        *(
            {o.name for o in [*i.train_options, *i.train_sft_options]}
            for i in map(registry.describe, registry.BUILTINS)
        )
    )
    assert set(HELP) <= known, sorted(set(HELP) - known)


def test_tinker_declares_only_the_losses_its_protocol_carries():
    info = registry.describe("tinker")
    loss = next(o for o in info.train_options if o.name == "loss")
    assert loss.choices == ("ppo", "cispo", "importance_sampling")
    assert "kl_penalty_coef" not in {o.name for o in info.train_options}


def test_plugin_with_class_hooks_and_without():
    hooked = registry.describe("plugin_example:HookedBackend")
    assert hooked.source == "plugin" and hooked.capabilities_source == "hook"
    assert hooked.capabilities.device_kinds == ("remote",)
    assert not hooked.capabilities.preserves_token_advantages
    assert [o.name for o in hooked.train_options] == ["learning_rate"]
    assert hooked.train_sft_options == []  # the hook left train_sft out
    plain = registry.describe("plugin_example:PlainBackend")
    assert plain.capabilities == CONSERVATIVE and plain.capabilities_source == "default"
    assert plain.train_options == [] and plain.train_sft_options == []


def test_entry_point_plugin_with_module_hooks(installed_plugin):
    assert registry.entry_points()["acme"] == "acme_backends.remote:make_backend"
    info = registry.describe("acme")
    assert (info.source, info.target, info.capabilities_source) == (
        "entry_point",
        "acme_backends.remote:make_backend",
        "hook",
    )
    # The hooks are on the module, the factory is a function: both were found.
    assert info.capabilities.preserves_token_advantages and not info.capabilities.supports_sft
    assert [(o.name, o.description) for o in info.train_options] == [("learning_rate", "step size")]
    assert [(p.name, p.required) for p in info.constructor] == [
        ("path", False),
        ("endpoint", True),
        ("retries", False),
    ]
    # posttrain.backends.load, by entry-point name and by dotted path, gives the factory itself.
    factory = posttrain.backends.load("acme")
    assert factory is posttrain.backends.load("acme_backends.remote:make_backend")
    backend = factory("/tmp/x", endpoint="http://h")
    assert type(backend).__name__ == "Remote" and vars(backend)["retries"] == 3
    assert "acme" in [i.name for i in registry.all_backends()]
    with pytest.raises(ValueError, match=r"known backends: local, ray, tinker, acme;"):
        registry.resolve("acne")


def test_importing_the_package_is_light():
    # `posttrain.backends` loads the registry only when `load`/`describe` is first used, and
    # adds nothing to what `import posttrain` already imports.
    code = (
        "import sys, posttrain; before = set(sys.modules); import posttrain.backends; "
        "print(sorted(set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['posttrain.backends']"


def test_bad_specs_give_clear_errors():
    with pytest.raises(
        ValueError,
        match=r"unknown backend 'locl'; did you mean 'local'\? \(known backends: local, ray, tinker;",
    ):
        registry.resolve("locl")
    with pytest.raises(ValueError, match="is not a dotted path"):
        registry.resolve("pkg:")
    with pytest.raises(
        ImportError, match=r"module 'no_such_pkg\.mod' does not import: ModuleNotFoundError"
    ):
        registry.load("no_such_pkg.mod:Backend")
    with pytest.raises(ImportError, match="has no attribute 'Missing'"):
        registry.load("plugin_example:Missing")
    with pytest.raises(ImportError, match="is a str, not a class or factory"):
        registry.load("plugin_example:__doc__")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "BrokenBackend",
            r"posttrain_capabilities\(\) returned malformed capabilities: missing keys",
        ),
        (
            "RaisingBackend",
            r"posttrain_option_schema\(\) raised RuntimeError: schema server unreachable",
        ),
        ("BadSchemaBackend", r"option 'learning_rate' needs a description"),
    ],
)
def test_malformed_hooks_are_errors_naming_the_plugin(target, message):
    with pytest.raises(ValueError, match=message) as info:
        registry.describe(f"plugin_example:{target}")
    assert f"plugin_example:{target}" in str(info.value)
    reported = registry.describe_or_report(f"plugin_example:{target}")
    assert reported.error == str(info.value) and reported.capabilities == CONSERVATIVE


def test_backends_json_matches_the_documented_schema(capsys, installed_plugin):
    plugins = ["plugin_example:HookedBackend", "plugin_example:LocalPlugin"]
    assert main(["backends", "--json", *(a for p in plugins for a in ("--plugin", p))]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    names = [b["name"] for b in data["backends"]]
    assert names == ["local", "ray", "tinker", "acme", *plugins]
    assert data["plugins"]["default_capabilities"]["preserves_token_advantages"] is False
    # The schema really constrains: an option without a description does not validate.
    data["backends"][0]["options"]["train"][0]["description"] = ""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


def test_backends_text(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "local  [builtin]" in out and "kl_penalty_coef" in out
    assert "constructor ([backend] table): path='.posttrain'" in out
    assert HELP["kimi_k2_tau"] in out
