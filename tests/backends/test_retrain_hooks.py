"""retrain's plugin hooks: its names (`retrain_backend_capabilities` / `RETRAIN_BACKEND_CAPABILITIES`,
`retrain_backend_option_schema` / `RETRAIN_BACKEND_OPTION_SCHEMA`), as functions or constants,
on the factory or its module; its formats (a BackendCapabilities or a dict of its four flags; an
option schema of `{type|value_type, default, choices?, validator?}`); which hook wins; what a
job, preflight, `posttrain backends --json` and `posttrain doctor` make of them; and errors for
every malformed format, naming the hook, the key and the fix."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from posttrain.backends.capabilities import CONSERVATIVE, Capabilities
from posttrain.backends.plugins import registry
from posttrain.backends.plugins.backend_options import with_backend_options
from posttrain.backends.plugins.hooks import read_declarations
from posttrain.backends.plugins.schema import constructor_schema
from posttrain.cli.main import main
from posttrain.jobs.backend import job_problems
from posttrain.jobs.config import parse_config

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "backends.schema.json").read_text())
FLAGS = {
    "reports_sync_loss": True,
    "preserves_token_advantages": True,
    "supports_checkpoint_resume": True,
    "resume_runtime_dependent": False,
}


@pytest.fixture(autouse=True)
def plugins_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _rows(info: registry.BackendInfo) -> dict[str, dict[str, object]]:
    return {p.name: p.as_dict() for p in info.constructor}


def test_dict_hooks_as_functions_on_the_class():
    info = registry.describe("retrain_plugins:RetrainFunctions")
    # retrain's four flags as given; posttrain's others conservative (no SFT, no sampling...).
    assert info.capabilities == replace(CONSERVATIVE, **FLAGS)
    assert (info.capabilities_source, info.hooks["capabilities"]) == (
        "hook",
        "retrain_backend_capabilities",
    )
    assert info.hooks["backend_options"] == "retrain_backend_option_schema"
    assert info.hooks["option_schema"] is None and info.train_options == []
    rows = _rows(info)
    assert rows["workers"] == {
        "name": "workers",
        "type": "int",
        "default": 2,
        "required": False,
        "choices": None,
        "has_validator": True,
    }
    assert rows["mode"]["choices"] == ["fast", "safe"] and not rows["mode"]["has_validator"]


def test_retrain_objects_as_constants():
    info = registry.describe("retrain_plugins:RetrainObjects")
    assert info.capabilities == replace(
        CONSERVATIVE,
        reports_sync_loss=False,
        preserves_token_advantages=False,
        supports_checkpoint_resume=True,
        resume_runtime_dependent=True,
    )  # supports_echo_shared_forward is retrain's own: read, and not a posttrain flag
    assert info.hooks["capabilities"] == "RETRAIN_BACKEND_CAPABILITIES"
    # The declared options sit before **options, which they close (see the job test).
    assert [(p.name, p.default) for p in info.constructor] == [
        ("path", None),
        ("workers", 2),
        ("transport", "filesystem"),
        ("**options", None),
    ]
    assert _rows(info)["transport"]["choices"] == ["filesystem", "zmq"]


def test_module_hooks_follow_retrains_lookup_order():
    info = registry.describe("retrain_module_plugin:make_backend")
    # The lowercase name on the module beats the uppercase one on the factory, as in retrain.
    assert info.hooks["capabilities"] == "retrain_backend_capabilities"
    assert info.overridden_hooks == ("RETRAIN_BACKEND_CAPABILITIES",)
    assert info.capabilities.reports_sync_loss and info.capabilities.device_kinds == ("remote",)
    # checkpoint_resume_mode="adapter_only" brings weights back without the optimizer: not
    # posttrain's exact resume, whatever supports_checkpoint_resume says.
    assert not info.capabilities.supports_checkpoint_resume
    assert info.hooks["backend_options"] == "RETRAIN_BACKEND_OPTION_SCHEMA"
    assert _rows(info)["endpoint"]["default"] == "http://127.0.0.1:8000"


def test_posttrain_hook_wins_over_retrains():
    info = registry.describe("retrain_plugins:BothHooks")
    assert info.hooks["capabilities"] == "posttrain_capabilities"
    assert not info.capabilities.preserves_token_advantages  # retrain's hook said True
    assert info.capabilities.supports_sft and info.overridden_hooks == (
        "RETRAIN_BACKEND_CAPABILITIES",
    )
    # A declared `capabilities` attribute beats both hooks.
    declared = type(
        "Declared",
        (),
        {"capabilities": CONSERVATIVE, "retrain_backend_capabilities": staticmethod(dict)},
    )
    found = read_declarations(declared, "x:Declared")
    assert found.capabilities_source == "declared" and found.overridden == (
        "retrain_backend_capabilities",
    )


def test_a_hook_taking_an_argument_gets_the_backend_options():
    target = "retrain_plugins:OptionDependent"
    assert registry.describe(target).capabilities.preserves_token_advantages  # listing: {}
    assert not registry.describe(target, {"strict": False}).capabilities.preserves_token_advantages


def _job(tmp_path: Path, backend: str, table: dict[str, object], **rl: object):
    return parse_config(
        {
            "run": {"task": "reverse", "output_dir": str(tmp_path), "backend": backend},
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "rl": {"learning_rate": 1e-5, **rl},
            "backend": table,
        }
    )


def test_a_job_checks_declared_options_and_passes_their_defaults(tmp_path):
    found, _ = job_problems(_job(tmp_path, "retrain_plugins:RetrainObjects", {"transport": "zmq"}))
    # `workers` is declared with a default the constructor (**options) does not have: passed.
    assert found is not None and found.kwargs == {
        "path": tmp_path,
        "workers": 2,
        "transport": "zmq",
    }
    found, _ = job_problems(_job(tmp_path, "retrain_plugins:RetrainFunctions", {"mode": "safe"}))
    assert found is not None and found.kwargs == {
        "path": tmp_path,
        "mode": "safe",
    }  # `workers`: the constructor's own default, the same as the declared one
    where = "declared by retrain_plugins:RetrainObjects: RETRAIN_BACKEND_OPTION_SCHEMA"
    cases = [
        ({"transport": "tcp"}, f"transport='tcp' is invalid: must be one of ['filesystem', 'zmq'] ({where})"),
        ({"workers": 0}, f"workers=0 is invalid: must be > 0 ({where})"),
        ({"workers": "3"}, f"workers='3' is invalid: expected int, got str ({where})"),
        ({"worker": 3}, "unknown key 'worker' for backend 'retrain_plugins:RetrainObjects'; did you mean 'workers'?"),
    ]  # fmt: skip
    for table, message in cases:
        found, problems = job_problems(_job(tmp_path, "retrain_plugins:RetrainObjects", table))
        assert found is not None and found.kwargs is None
        backend = [p for p in problems if p.option == "[backend]"]
        assert len(backend) == 1 and message in backend[0].message, (table, problems)


def test_preflight_reads_token_advantages_from_the_retrain_hook(tmp_path):
    target = "retrain_plugins:OptionDependent"
    _, problems = job_problems(_job(tmp_path, target, {"strict": True}, kimi_k2_tau=0.5))
    assert problems == []
    _, problems = job_problems(_job(tmp_path, target, {"strict": False}, kimi_k2_tau=0.5))
    assert [(p.call, p.option) for p in problems] == [("train", "kimi_k2_tau")]
    assert "does not preserve token-level advantages" in problems[0].message


class _Spec:  # a BackendOptionSpec-like object without a type: read as retrain reads it
    value_type = "str"
    default = 5


def _caps(value: object) -> dict[str, object]:
    return {"retrain_backend_capabilities": staticmethod(lambda: value)}


def _schema(value: object) -> dict[str, object]:
    return {"RETRAIN_BACKEND_OPTION_SCHEMA": value, "__init__": lambda self, path, **kw: None}


BAD = [
    (
        _caps({k: v for k, v in FLAGS.items() if k != "resume_runtime_dependent"}),
        r"retrain_backend_capabilities\(\) returned capabilities without "
        r"\['resume_runtime_dependent'\]; return a dict with retrain's four flags",
    ),
    (
        _caps({**FLAGS, "supports_sampler": True}),
        r"unknown capability 'supports_sampler' \(did you mean 'supports_sampling'\?\)",
    ),
    (_caps({**FLAGS, "reports_sync_loss": "yes"}), r"reports_sync_loss must be true or false"),
    (
        _caps({**FLAGS, "checkpoint_resume_mode": "partial"}),
        r"checkpoint_resume_mode='partial'; use one of \['unsupported', 'adapter_only', 'exact'\]",
    ),
    (_caps([True, True, True, False]), r"returned list without \['reports_sync_loss'"),
    (
        {"retrain_backend_capabilities": staticmethod(lambda a, b: FLAGS)},
        r"must take no argument or one \(the backend options\)",
    ),
    (
        {"posttrain_capabilities": staticmethod(lambda: FLAGS)},
        r"posttrain_capabilities\(\) returned malformed capabilities: missing keys .*"
        r"declare them through retrain_backend_capabilities",
    ),
    (_schema([("workers", int)]), r"RETRAIN_BACKEND_OPTION_SCHEMA must return a mapping"),
    (_schema({"workers": 2}), r"\['workers'\]: got a int; give a dict"),
    (
        _schema({"workers": {"type": "int", "defualt": 2}}),
        r"\['workers'\]: unknown key 'defualt' \(did you mean 'default'\?\)",
    ),
    (
        _schema({"workers": {"type": "int32"}}),
        r"\['workers'\]: type 'int32' is not one of bool, int, float, str",
    ),
    (
        _schema({"workers": {"type": int, "value_type": "str"}}),
        r"type and value_type disagree",
    ),
    (_schema({"w": _Spec()}), r"\['w'\]: default 5 is not a str; make it one, or change the type"),
    (
        _schema({"mode": {"default": "slow", "choices": ["fast", "safe"]}}),
        r"\['mode'\]: the default 'slow' is refused: must be one of \['fast', 'safe'\]",
    ),
    (
        _schema({"workers": {"type": "int", "default": 0, "validator": lambda v: "must be > 0"}}),
        r"\['workers'\]: the default 0 is refused: must be > 0",
    ),
    (
        _schema({"workers": {"type": "int", "validator": "positive"}}),
        r"\['workers'\]: validator must be a function",
    ),
    (_schema({"not a name": {}}), r"key 'not a name' is not a valid keyword argument name"),
]


@pytest.mark.parametrize(("attrs", "message"), BAD)
def test_malformed_retrain_formats_name_the_hook_the_key_and_the_fix(attrs, message):
    plugin = type("Bad", (), attrs)
    with pytest.raises(ValueError, match=message) as info:
        read_declarations(plugin, "pkg.mod:Bad")
    assert str(info.value).startswith("pkg.mod:Bad: ")


def test_declared_options_must_match_the_constructor():
    class Fixed:
        def __init__(self, path: str, *, workers: int = 2) -> None: ...

        RETRAIN_BACKEND_OPTION_SCHEMA = {"workers": {"type": "int", "default": 4}}  # noqa: RUF012

    found = read_declarations(Fixed, "pkg.mod:Fixed")
    params = constructor_schema(Fixed)
    with pytest.raises(ValueError, match=r"default 4 differs from Fixed's own default 2"):
        with_backend_options(params, found.backend_options, "Fixed")
    Fixed.RETRAIN_BACKEND_OPTION_SCHEMA = {"retries": {"type": "int", "default": 1}}
    found = read_declarations(Fixed, "pkg.mod:Fixed")
    with pytest.raises(
        ValueError, match=r"Fixed\(\.\.\.\) has no parameter 'retries' and takes no \*\*kwargs"
    ):
        with_backend_options(params, found.backend_options, "Fixed")


def test_a_capabilities_object_from_posttrains_own_hook():
    caps = replace(CONSERVATIVE, supports_sampling=True)
    found = read_declarations(type("P", (), {"posttrain_capabilities": caps}), "x:P")
    assert found.capabilities is caps and isinstance(found.capabilities, Capabilities)


def test_backends_json_and_text(capsys):
    plugins = [
        "retrain_plugins:RetrainFunctions",
        "retrain_plugins:BothHooks",
        "retrain_module_plugin:make_backend",
    ]
    args = [a for p in plugins for a in ("--plugin", p)]
    assert main(["backends", "--json", *args]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["retrain_plugins:BothHooks"]["hooks"] == {
        "capabilities": "posttrain_capabilities",
        "option_schema": None,
        "backend_options": None,
        "overridden": ["RETRAIN_BACKEND_CAPABILITIES"],
    }
    assert by_name["local"]["hooks"]["capabilities"] is None  # declared by the class
    functions = by_name["retrain_plugins:RetrainFunctions"]
    mode = next(p for p in functions["constructor"] if p["name"] == "mode")
    assert mode["choices"] == ["fast", "safe"] and mode["default"] == "fast"
    assert data["plugins"]["retrain_option_schema_hooks"] == [
        "retrain_backend_option_schema",
        "RETRAIN_BACKEND_OPTION_SCHEMA",
    ]
    assert main(["backends", *args]) == 0
    out = capsys.readouterr().out
    assert "hooks overridden: RETRAIN_BACKEND_CAPABILITIES" in out
    assert "mode='fast' {fast, safe}" in out


def test_backends_reports_a_malformed_retrain_hook(capsys):
    assert main(["backends", "--json", "--plugin", "retrain_plugins:MisspeltFlag"]) == 1
    err = capsys.readouterr().err
    assert (
        "retrain_plugins:MisspeltFlag: retrain_backend_capabilities returned an unknown "
        "capability 'preserves_token_advantage' (did you mean 'preserves_token_advantages'?)"
    ) in err


def test_doctor_names_the_hook_that_won(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[run]\nbackend = "retrain_plugins:BothHooks"\n')
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "backend" in line and "PASS" in line)
    assert (
        "retrain_plugins:BothHooks (capabilities: hook posttrain_capabilities; "
        "overridden: RETRAIN_BACKEND_CAPABILITIES)"
    ) in line
