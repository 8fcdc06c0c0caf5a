"""The engine worker process: `python -m posttrain.inference.host ADDRESS MODULE:CLASS`.

It connects back to its parent on a Unix socket (`multiprocessing.connection`, authenticated
with the key in $POSTTRAIN_ENGINE_KEY) and answers requests one at a time, each a dict with an
`op`: "start", "sample", "load" (whole weights), "update" (what changed), "close". Replies are {"ok": True, "result": ...} or
{"ok": False, "error": ..., "kind": ...}. Only plain Python data crosses: the parent and this
process may run different interpreters (vLLM in a venv of its own).

Running an engine here keeps everything it changes in its process: vLLM reseeds torch's global
RNG, makes `torch.set_num_threads` a no-op and initialises `torch.distributed` in the process
that builds it. This process takes its own thread budget (`threads`) before torch loads.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any, Protocol


class _Runner(Protocol):
    def sample(self, request: dict[str, Any]) -> list[list[dict[str, Any]]]: ...

    def load(self, path: str) -> None: ...

    def update(self, request: dict[str, Any]) -> list[str]: ...


def _set_threads(threads: int) -> None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _make_runner(runner: str, options: dict[str, Any]) -> _Runner:
    """The engine's runner (`EngineSpec.runner`), imported once this process has its threads."""
    _set_threads(int(options["threads"]))
    module, _, name = runner.partition(":")
    return getattr(importlib.import_module(module), name)(options)


def serve(address: str, runner_name: str) -> None:
    key = bytes.fromhex(os.environ.pop("POSTTRAIN_ENGINE_KEY"))
    with Client(address, family="AF_UNIX", authkey=key) as conn:
        runner: _Runner | None = None
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return  # the parent is gone
            op = request.get("op")
            try:
                if op == "start":
                    runner = _make_runner(runner_name, request["options"])
                    result: object = None
                elif op == "close":
                    conn.send({"ok": True, "result": None})
                    return
                elif runner is None:
                    raise RuntimeError(f"{op!r} before the engine started")
                elif op == "sample":
                    result = runner.sample(request)
                elif op == "load":
                    runner.load(request["path"])
                    result = None
                elif op == "update":
                    result = runner.update(request)  # the adapters it holds
                else:
                    raise ValueError(f"unknown op {op!r}")
                conn.send({"ok": True, "result": result})
            except Exception as exc:  # the parent re-raises it with the engine's traceback
                conn.send(
                    {
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc(),
                        "op": op,
                    }
                )


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
