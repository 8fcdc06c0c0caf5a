"""`posttrain doctor`: is this machine ready? A pass / warn / fail table; non-zero on a fail."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["pass", "warn", "fail"]
OPTIONAL = {
    "ray": "ray",
    "fastapi": "server",
    "uvicorn": "server",
    "tinker": "tinker",
    "openai": "server",
}
MIN_FREE_GB = 5.0


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("doctor", help="check Python, torch, extras, storage, server")
    parser.add_argument("--storage", default=".posttrain", help="where checkpoints will be written")
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


def check_optional() -> list[Check]:
    checks = []
    for module, extra in OPTIONAL.items():
        found = importlib.util.find_spec(module) is not None
        detail = "installed" if found else f"missing: pip install 'posttrain[{extra}]'"
        checks.append(Check(f"optional: {module}", "pass" if found else "warn", detail))
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


def check_server(url: str, timeout: float) -> Check:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout) as response:
            return Check("server", "pass", f"{url} answered {response.status}")
    except urllib.error.HTTPError as exc:
        return Check("server", "pass" if exc.code < 500 else "fail", f"{url} answered {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        return Check("server", "fail", f"{url} unreachable within {timeout}s: {exc}")


def run_checks(storage: Path, server: str | None, timeout: float) -> list[Check]:
    checks = [check_python(), check_torch(), *check_optional(), *check_storage(storage)]
    if server:
        checks.append(check_server(server, timeout))
    if os.environ.get("POSTTRAIN_LOG_TO"):
        checks.append(Check("POSTTRAIN_LOG_TO", "pass", os.environ["POSTTRAIN_LOG_TO"]))
    return checks


def run(args: argparse.Namespace) -> int:
    checks = run_checks(Path(args.storage), args.server, args.timeout)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status.upper():5s} {c.name:{width}s}  {c.detail}")
    failed = [c for c in checks if c.status == "fail"]
    print(f"\n{len(checks) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0
