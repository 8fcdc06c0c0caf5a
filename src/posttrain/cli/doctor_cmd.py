"""`posttrain doctor [--config JOB.toml]`: is this machine ready? A pass / warn / fail table.

Checks Python, torch, the optional dependencies (which extra installs each), write access and
free disk at the storage path, the configured task, backend and base model, the sampling
engines (vLLM imported by the interpreter the `vllm` engine would run), and the configured
server: `--server`, else the config's `[backend] base_url`, else `$TINKER_BASE_URL`, asked with
the configured API key (`[backend] api_key`, else `$TINKER_API_KEY`). Exit status 1 on any fail.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from posttrain.inference.engines import ENGINES, EngineSpec

if TYPE_CHECKING:
    from posttrain.inference import InferenceConfig
    from posttrain.jobs.backend import JobBackend
    from posttrain.jobs.config import JobConfig

Status = Literal["pass", "warn", "fail"]
MIN_FREE_GB = 5.0
DEFAULT_STORAGE = ".posttrain"
ENGINE_IMPORT_TIMEOUT_S = 60.0  # importing vLLM takes ~5-10 s


@dataclass(frozen=True)
class OptionalDependency:
    module: str
    distribution: str
    needed_by: str
    install: str


OPTIONAL = (
    OptionalDependency("ray", "ray", "RayBackend", "pip install 'posttrain[ray]'"),
    OptionalDependency("tinker", "tinker", "TinkerBackend", "pip install 'posttrain[tinker]'"),
    OptionalDependency("fastapi", "fastapi", "posttrain serve", "pip install 'posttrain[server]'"),
    OptionalDependency("uvicorn", "uvicorn", "posttrain serve", "pip install 'posttrain[server]'"),
    OptionalDependency(
        "google.protobuf",
        "protobuf",
        "posttrain serve (wire protocol)",
        "pip install 'posttrain[server]'",
    ),
    OptionalDependency(
        "zstandard", "zstandard", "posttrain serve (zstd bodies)", "pip install 'posttrain[server]'"
    ),
    OptionalDependency("openai", "openai", "TrainableModel.openai_client()", "pip install openai"),
    OptionalDependency(
        "gguf", "gguf", ".gguf files and packaged: models", "pip install 'posttrain[gguf]'"
    ),
    OptionalDependency(
        "datasets",
        "datasets",
        "CSV, Parquet, Arrow and hf: data files",
        "pip install 'posttrain[data]'",
    ),
    OptionalDependency("httpx", "httpx", 'reward = "judge"', "pip install 'posttrain[judge]'"),
)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass(frozen=True)
class Server:
    url: str
    source: str  # where the URL came from
    key: str | None
    key_source: str | None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("doctor", help="check Python, torch, extras, storage, server")
    parser.add_argument(
        "--config", type=Path, help="a job config: check its backend, storage and server"
    )
    parser.add_argument(
        "--storage",
        help=f"where checkpoints will be written (default: the config's output_dir, else {DEFAULT_STORAGE})",
    )
    parser.add_argument("--server", help="a posttrain/Tinker server URL to check")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the server")
    parser.set_defaults(handler=run)


def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", "pass" if ok else "fail", f"{platform.python_version()} (need >= 3.11)")


def check_torch() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", "fail", f"not importable: {exc}")
    device = (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"
        if torch.cuda.is_available()
        else "CPU only"
    )
    return Check(
        "torch", "pass", f"{torch.__version__}, {device}, {torch.get_num_threads()} threads"
    )


def check_threads() -> Check:
    """torch's thread settings; a warning for oversubscription (more threads than usable cores,
    or a load average above them), which makes compute several times slower."""
    try:
        from posttrain.cli.thread_report import thread_report

        report = thread_report()
    except ImportError as exc:
        return Check("threads", "fail", f"torch not importable: {exc}")
    if report.error:  # posttrain's commands refuse to start with it
        return Check("threads", "fail", report.error)
    warnings = report.warnings()
    return Check(
        "threads", "warn" if warnings else "pass", "; ".join([report.describe(), *warnings])
    )


def check_optional() -> list[Check]:
    checks = []
    for dep in OPTIONAL:
        name = f"optional: {dep.distribution}"
        if importlib.util.find_spec(dep.module) is None:
            checks.append(
                Check(name, "warn", f"missing (needed by {dep.needed_by}): {dep.install}")
            )
            continue
        try:
            version = importlib.metadata.version(dep.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "version unknown"
        checks.append(Check(name, "pass", f"{version} (for {dep.needed_by})"))
    return checks


def check_storage(path: Path) -> list[Check]:
    target = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    try:
        with tempfile.NamedTemporaryFile(dir=target):
            pass
        write = Check("storage writable", "pass", str(path))
    except OSError as exc:
        write = Check(
            "storage writable", "fail", f"{path}: {exc.strerror or exc}; choose another --storage"
        )
    free_gb = shutil.disk_usage(target).free / 2**30
    disk = Check(
        "free disk", "pass" if free_gb >= MIN_FREE_GB else "warn", f"{free_gb:.1f} GiB at {target}"
    )
    return [write, disk]


def check_server(server: Server, timeout: float) -> Check:
    """GET /healthz with the configured key; a 401/403 means the key is missing or wrong."""
    where = f"{server.url} ({server.source})"
    headers = {"X-API-Key": server.key} if server.key else {}
    request = urllib.request.Request(server.url.rstrip("/") + "/healthz", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            accepted = f", key from {server.key_source} accepted" if server.key else ""
            return Check("server", "pass", f"{where} answered {response.status}{accepted}")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403) and server.key:
            fix = f"the key from {server.key_source} was rejected; set it to a key this server accepts (tml-...)"
            return Check("server", "fail", f"{where} answered {exc.code}: {fix}")
        if exc.code in (401, 403):
            fix = "it needs an API key; set TINKER_API_KEY=tml-... (or api_key in the config's [backend])"
            return Check("server", "fail", f"{where} answered {exc.code}: {fix}")
        if exc.code >= 500:
            return Check("server", "fail", f"{where} answered {exc.code}: the server is failing")
        return Check(
            "server",
            "warn",
            f"{where} answered {exc.code} on /healthz: is it a posttrain or Tinker server?",
        )
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Check("server", "fail", f"{where} unreachable within {timeout}s: {exc}")


def configured_server(
    flag: str | None, backend: dict[str, object], config: Path | None
) -> Server | None:
    """The server to check and the key to send, each with where it came from."""
    key, key_source = os.environ.get("TINKER_API_KEY"), "$TINKER_API_KEY"
    if isinstance(backend.get("api_key"), str):
        key, key_source = str(backend["api_key"]), f"[backend] api_key in {config}"
    if flag:
        return Server(flag, "--server", key, key_source if key else None)
    if isinstance(backend.get("base_url"), str):
        return Server(
            str(backend["base_url"]),
            f"[backend] base_url in {config}",
            key,
            key_source if key else None,
        )
    if os.environ.get("TINKER_BASE_URL"):
        return Server(
            os.environ["TINKER_BASE_URL"], "$TINKER_BASE_URL", key, key_source if key else None
        )
    return None


def check_base_model(spec: str) -> Check:
    """The config's base model can be had here: a model directory, a hub id in the local
    cache or confirmed by the hub within seconds, a GGUF file or a known packaged model, and
    whether those two are converted yet (never downloaded)."""
    from posttrain.models import source as model_source
    from posttrain.models.cache import HubUnreachableError, ModelSourceError

    if spec.startswith("tiny:"):
        return Check("base model", "pass", f"{spec} (built by the job)")
    try:
        model_source.check_base_model(spec)
    except (
        FileNotFoundError,
        HubUnreachableError,
        ModelSourceError,
    ) as exc:
        return Check("base model", "fail", str(exc))
    note = model_source.cache_note(spec)
    if note is not None:
        return Check("base model", "pass", f"{spec} ({note})")
    if Path(spec).expanduser().exists():
        return Check("base model", "pass", f"{spec} (a model directory)")
    cached = model_source.in_hub_cache(spec)
    where = "in the Hugging Face cache" if cached else "on the hub, not yet downloaded"
    return Check("base model", "pass", f"{spec} ({where})")


def check_job_config(path: Path) -> tuple[list[Check], JobConfig | None]:
    """The config's task, backend and base model; an unreadable config fails (and is None)."""
    from posttrain.jobs.backend import job_problems
    from posttrain.jobs.config import load_config

    try:
        config = load_config(path)
    except (ValueError, FileNotFoundError) as exc:
        return [Check("config", "fail", str(exc))], None
    found, problems = job_problems(config, base_model=False)  # checked on its own row below
    backend_problems = [p for p in problems if p.call == "backend"]
    if backend_problems:
        check = Check("backend", "fail", "; ".join(str(p) for p in backend_problems))
    else:
        check = Check("backend", "pass", f"{config.run.backend} ({_capabilities_note(found)})")
    checks = [Check("config", "pass", str(path)), check_task(config), check]
    checks.append(check_base_model(config.model.base_model))
    family = check_family(config.model.base_model)
    if family is not None:
        checks.append(family)
    return checks, config


def check_family(spec: str) -> Check | None:
    """The base model's family and which paths apply to it (packing, shared prefix, vLLM), a
    warning for a family posttrain has not checked; None where its config needs a download."""
    from posttrain.jobs.backend import base_model_config
    from posttrain.models.families import describe, family_of

    found = base_model_config(spec)
    if found is None:
        return None
    return Check("model family", "pass" if family_of(found) else "warn", describe(found))


def _capabilities_note(found: JobBackend | None) -> str:
    """Where the backend's capabilities come from, and any hook that lost to another."""
    if found is None:
        return "capabilities: ?"
    hook = found.info.hooks.get("capabilities")
    note = f"capabilities: {found.info.capabilities_source}" + (f" {hook}" if hook else "")
    overridden = found.info.overridden_hooks
    return note + (f"; overridden: {', '.join(overridden)}" if overridden else "")


def check_task(config: JobConfig) -> Check:
    """The config's task resolves (imported, built, its data read) as `posttrain train`'s; or
    its environment, when it names one."""
    from posttrain.jobs.backend import environment_problems, task_problems

    if config.run.environment is not None:
        environment, problems = environment_problems(config)
        if environment is None:
            return Check("environment", "fail", "; ".join(str(p) for p in problems))
        found = f"{environment.spec} ({environment.kind}: {environment.target})"
        return Check("environment", "pass", found)
    resolved, problems = task_problems(config)
    if resolved is None:
        return Check("task", "fail", "; ".join(str(p) for p in problems))
    counts = ""
    if resolved.kind == "data":
        details = resolved.details
        counts = f", {details['train_problems']} training / {details['held_out_problems']} held-out problems"
    return Check("task", "pass", f"{resolved.spec} ({resolved.kind}: {resolved.target}{counts})")


def engine_interpreter(spec: EngineSpec, inference: InferenceConfig) -> tuple[str, str, bool]:
    """The interpreter to look for the engine's module in, where it came from, and whether the
    engine runs it as configured: [inference] python, else its ${python_env}, else this
    interpreter when it has the module, else ./.venv-<module> (found, but used only once named)."""
    python, source = spec.python(inference.python)
    venv = Path(f".venv-{spec.module}") / "bin" / "python"  # what the install hint makes
    missing = spec.module is not None and importlib.util.find_spec(spec.module) is None
    if source == "this interpreter" and missing and venv.exists():
        return str(venv), f"./.venv-{spec.module}", False
    return python, source, True


def check_engine_python(spec: EngineSpec, inference: InferenceConfig, required: bool) -> Check:
    """`import MODULE` in a subprocess of the interpreter the engine would run; a problem fails
    when the config samples with this engine (`required`), else warns."""
    module = spec.module or "posttrain"
    hint = spec.install_hint() if spec.install_hint else f"install {module}"
    python, source, used = engine_interpreter(spec, inference)
    name, problem = f"sampling engine: {spec.name}", "fail" if required else "warn"
    code = f"import {module}; print('\\nPOSTTRAIN_ENGINE_VERSION=' + {module}.__version__)"
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=ENGINE_IMPORT_TIMEOUT_S
        )
    except OSError as exc:
        return Check(name, problem, f"{python} ({source}): {exc.strerror or exc}; {hint}")
    except subprocess.TimeoutExpired:
        return Check(
            name, problem, f"import {module} took over {ENGINE_IMPORT_TIMEOUT_S:.0f} s in {python}"
        )
    versions = [
        line.partition("=")[2]
        for line in done.stdout.splitlines()
        if line.startswith("POSTTRAIN_ENGINE_VERSION=")
    ]
    if done.returncode != 0 or not versions:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(name, problem, f"not importable in {python} ({source}): {error}; {hint}")
    found = f"{module} {versions[-1]} in {python} ({source})"
    if used:
        return Check(name, "pass", found)
    use = f"set {spec.python_env}={python} (or [inference] python) for engine = {spec.name!r} to use it"
    return Check(name, problem, f"{found}; {use}")


def check_engine(spec: EngineSpec, config: JobConfig | None) -> Check:
    """One sampling engine: what it imports, in its own interpreter where it has one, and
    whether the job's base model suits it."""
    from posttrain.inference import InferenceConfig
    from posttrain.jobs.backend import engine_model_problem

    inference: InferenceConfig = getattr(config, "inference", None) or InferenceConfig()
    required = config is not None and inference.engine == spec.name
    name = f"sampling engine: {spec.name}"
    if spec.python_env is not None:
        check = check_engine_python(spec, inference, required)
    elif spec.module is not None and importlib.util.find_spec(spec.module) is None:
        needs = f"needs {spec.module}: {spec.install_hint() if spec.install_hint else ''}"
        check = Check(name, "fail" if required else "warn", needs)
    else:
        check = Check(name, "pass", spec.summary)
    if required and config is not None and (problem := engine_model_problem(config)) is not None:
        check = Check(name, "fail", f"{check.detail}; but {config.model.base_model}: {problem}")
    return check


def check_engines(config: JobConfig | None) -> list[Check]:
    """The sampling engines (`inference/engines.py`): pytorch is always there, vllm needs an
    interpreter with vLLM, the openai engine needs httpx (and a server, probed when a job
    starts)."""
    return [check_engine(spec, config) for spec in ENGINES.values()]


def run_checks(args: argparse.Namespace) -> list[Check]:
    checks = [check_python(), check_torch(), check_threads(), *check_optional()]
    config: JobConfig | None = None
    if args.config is not None:
        config_checks, config = check_job_config(args.config)
        checks += config_checks
    backend = dict(config.backend) if config is not None else {}
    output_dir = config.run.output_dir if config is not None else None
    checks += check_engines(config)
    checks += check_storage(Path(args.storage or output_dir or DEFAULT_STORAGE))
    server = configured_server(args.server, backend, args.config)
    if server is not None:
        checks.append(check_server(server, args.timeout))
    if os.environ.get("POSTTRAIN_LOG_TO"):
        checks.append(Check("POSTTRAIN_LOG_TO", "pass", os.environ["POSTTRAIN_LOG_TO"]))
    return checks


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status.upper():5s} {c.name:{width}s}  {c.detail}")
    failed = [c for c in checks if c.status == "fail"]
    warned = [c for c in checks if c.status == "warn"]
    print(
        f"\n{len(checks) - len(failed) - len(warned)} passed, {len(warned)} warned, {len(failed)} failed"
    )
    return 1 if failed else 0
