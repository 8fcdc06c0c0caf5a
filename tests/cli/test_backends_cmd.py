"""`posttrain backends`: bad plugins and names are clear errors with a non-zero exit, never a
traceback; run both in-process and as the real command. The sampling engines and which
backends take `inference=` are listed, in text and in JSON that the documented schema admits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import jsonschema
import pytest

from posttrain.cli.engine_table import ENGINE_MODES, mode_of
from posttrain.cli.main import main
from posttrain.inference import InferenceConfig
from posttrain.inference.engines import SPLIT_PYTORCH, VLLM
from posttrain.inference.live import LIVE
from posttrain.inference.openai_engine import OpenAIEngine

PLUGINS = Path(__file__).parents[1] / "backends"
SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "backends.schema.json").read_text())
# A plugin whose constructor takes `inference=`, and one whose does not.
ENGINE_PLUGIN = """
class WithEngines:
    def __init__(self, path=".posttrain", *, inference=None):
        pass

class WithoutEngines:
    def __init__(self, path=".posttrain"):
        pass
"""


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (
            "plugin_example:BrokenBackend",
            "plugin_example:BrokenBackend: posttrain_capabilities() returned malformed "
            "capabilities: missing keys ['device_kinds', 'preserves_token_advantages'",
        ),
        (
            "locl",
            "unknown backend 'locl'; did you mean 'local'? (known backends: local, ray, tinker;",
        ),
        (
            "no_such_pkg.backends:Mine",
            "backend 'no_such_pkg.backends:Mine': module 'no_such_pkg.backends' does not import: "
            "ModuleNotFoundError: No module named 'no_such_pkg'",
        ),
        (
            "plugin_example:Nope",
            "backend 'plugin_example:Nope': 'plugin_example' has no attribute 'Nope'",
        ),
        ("plugin_example:", "is not a dotted path; write it as 'package.module:ClassName'"),
        (
            "plugin_example:RaisingBackend",
            "posttrain_option_schema() raised RuntimeError: schema server unreachable",
        ),
    ],
)
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bad_plugins_exit_1_with_the_reason(plugin, message, json_flag, capsys):
    assert main(["backends", "--plugin", plugin, *json_flag]) == 1
    captured = capsys.readouterr()
    assert "posttrain backends: error: " in captured.err and message in captured.err
    assert "Traceback" not in captured.out + captured.err
    assert (
        "local  [builtin]" in captured.out or '"name": "local"' in captured.out
    )  # the rest still listed


def test_good_plugins_exit_0(capsys):
    assert (
        main(
            [
                "backends",
                "--plugin",
                "plugin_example:HookedBackend",
                "--plugin",
                "plugin_example:PlainBackend",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plugin_example:HookedBackend  [plugin]" in out and "capabilities (hook)" in out
    assert (
        "plugin_example:PlainBackend  [plugin]" in out
        and "capabilities (default): resume_runtime_dependent" in out
    )


@pytest.mark.slow
def test_the_real_command_reports_without_a_traceback():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.cli.main",
            "backends",
            "--plugin",
            "plugin_example:BrokenBackend",
            "--plugin",
            "locl",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "malformed capabilities" in done.stderr and "unknown backend 'locl'" in done.stderr


def test_the_engines_are_listed_with_their_capabilities(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    engines = out.split("sampling engines (")[1]
    assert engines.startswith("[inference] table; a backend takes it as inference=: local, ray)")
    assert "pytorch  engine = 'pytorch' (the default)" in engines
    assert (
        "returns_token_ids=True, returns_logprobs=True, weight_sync=live, own_process=False, "
        "provides_token_entropies=True"
    ) in engines
    assert "vllm     engine = 'vllm'" in engines and "weight_sync=none" in engines
    assert "openai: capabilities probed from the server at start" in engines
    # Each backend says whether [inference] reaches it.
    tinker = out.split("tinker  [builtin]")[1]
    assert "sampling engines: its own (no inference= argument)" in tinker.split("\n\n")[0]
    assert "sampling engines: any ([inference] -> inference=)" in out.split("ray  [builtin]")[1]


def test_engines_json_matches_the_schema_and_the_engines(tmp_path, capsys, monkeypatch):
    (tmp_path / "engine_plugin.py").write_text(ENGINE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = ["engine_plugin:WithEngines", "engine_plugin:WithoutEngines"]
    assert main(["backends", "--json", *(a for p in plugins for a in ("--plugin", p))]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    assert data["schema_version"] == SCHEMA["properties"]["schema_version"]["const"] == 6
    accepts = {b["name"]: b["accepts_inference"] for b in data["backends"]}
    assert accepts == {"local": True, "ray": True, "tinker": False} | dict(
        zip(plugins, [True, False], strict=True)
    )
    rows = [(e["engine"], e["runs"], e["capabilities_source"]) for e in data["engines"]]
    assert rows == [
        ("pytorch", "in-process", "declared"),
        ("pytorch", "worker process", "declared"),
        ("vllm", "worker process", "declared"),
        ("openai", "server", "probed"),
        ("openai", "server", "probed"),
    ]
    # The capabilities are the engines' own constants, not copies.
    expected = [LIVE, SPLIT_PYTORCH, VLLM]
    assert [e["capabilities"] for e in data["engines"][:3]] == [asdict(c) for c in expected]
    assert [e["capabilities"]["weight_sync"] for e in data["engines"][3:]] == ["full", "none"]
    # The schema really constrains: an engine without its weight sync does not validate.
    del data["engines"][0]["capabilities"]["weight_sync"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


@pytest.mark.parametrize("sync", ["auto", "none", "reload"])
def test_the_openai_rows_match_the_engine_before_its_probe(sync):
    config = InferenceConfig(engine="openai", url="http://127.0.0.1:9/v1", sync=sync)
    declared = mode_of(config).capabilities
    engine = OpenAIEngine(config).capabilities  # nothing is asked of the server until start()
    assert (declared.weight_sync, declared.own_process, declared.provides_token_entropies) == (
        engine.weight_sync,
        engine.own_process,
        engine.provides_token_entropies,
    )
    # What the probe requires: token ids always, logprobs unless allowed to go without.
    assert declared.returns_token_ids and declared.returns_logprobs


def test_every_inference_config_selects_a_listed_mode():
    configs = [
        InferenceConfig(),
        InferenceConfig(devices="cpu,cpu"),
        InferenceConfig(engine="vllm"),
        InferenceConfig(engine="openai", url="http://h/v1"),
        InferenceConfig(engine="openai", url="http://h/v1", sync="none"),
    ]
    assert [mode_of(c) for c in configs] == list(ENGINE_MODES)
