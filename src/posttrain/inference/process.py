"""`ProcessEngine`: an engine in a worker process of its own (`host.py`), for vLLM and for
posttrain's sampler in split mode.

One request at a time crosses a Unix socket; weights cross as files (`WeightSnapshot`), so the
two processes may run different interpreters and torch builds. The process is the engine's
sandbox: its RNG, thread pool and process group are not the trainer's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, cast

from posttrain.data.seeds import prompt_seed
from posttrain.inference.engines import DISTRIBUTION_FIELDS, EngineSpec
from posttrain.inference.protocol import EngineCapabilities, WeightSnapshot
from posttrain.types import SampledSequence, SampleResponse, SamplingParams


class EngineProcessError(RuntimeError):
    """The engine's process failed a request, or died; the message has its log's tail."""


class ProcessEngine:
    """A sampling engine answering from a child process started with `python`."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        python: str,
        options: dict[str, Any],
        capabilities: EngineCapabilities,
        version: int,
        start_timeout_s: float,
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        if spec.runner is None:
            raise ValueError(f"the {spec.name} engine has no worker process to run")
        self.spec = spec
        self.name = spec.name
        self.capabilities = capabilities
        self._version = version
        self.adapters: list[str] = []  # the LoRA adapters the engine holds, newest last
        self.log_path = log_path
        self._lock = threading.Lock()
        self._socket_dir = tempfile.mkdtemp(prefix="posttrain-engine-")
        address = os.path.join(self._socket_dir, "socket")
        key = secrets.token_bytes(32)
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, **(env or {}), POSTTRAIN_ENGINE_KEY=key.hex(), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_source_root(), env.get("PYTHONPATH")]))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - open while the process runs
        self.process = subprocess.Popen(
            [python, "-m", "posttrain.inference.host", address, spec.runner],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the parent, which closes it
        )
        try:
            self._conn = self._accept(start_timeout_s)
            self._call({"op": "start", "options": options}, timeout_s=start_timeout_s)
        except BaseException:
            self._kill()
            raise

    @property
    def version(self) -> int:
        return self._version

    async def sample_many(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        refused = self.spec.refused_sampling(params)
        if refused is not None:
            raise ValueError(refused)
        request = {
            "op": "sample",
            "prompts": [list(p) for p in prompts],
            "n": num_samples,
            "params": params_dict(params),
            # Each prompt's own seed, for an engine that seeds per request (vLLM).
            "seeds": [prompt_seed(params.seed, i) for i in range(len(prompts))],
        }
        version = self._version
        rows = await asyncio.to_thread(self._call, request)
        return [
            SampleResponse([SampledSequence(**s) for s in row], policy_version=version)
            for row in cast(list[list[dict[str, Any]]], rows)
        ]

    async def update_weights(self, snapshot: WeightSnapshot | None, version: int) -> None:
        if snapshot is None:
            raise ValueError(f"the {self.name} engine holds its own weights: give it a snapshot")
        if snapshot.kind == "model":
            request: dict[str, Any] = {"op": "load", "path": str(snapshot.path)}
        else:
            request = {
                "op": "update",
                "kind": snapshot.kind,
                "version": snapshot.version,
                "adapter": None if snapshot.adapter is None else str(snapshot.adapter),
                "tensors": None if snapshot.tensors is None else str(snapshot.tensors),
                "lora_scale": snapshot.lora_scale,
            }
        held = await asyncio.to_thread(self._call, request)
        self.adapters = list(cast(list[str], held or []))
        self._version = version

    async def close(self) -> None:
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        if self.process.poll() is None:
            try:
                self._call({"op": "close"}, timeout_s=30)
                self.process.wait(timeout=30)
            except Exception:
                pass
        self._kill()

    def _accept(self, timeout_s: float) -> Connection:
        accepted: list[Connection] = []
        thread = threading.Thread(
            target=lambda: accepted.append(self._listener.accept()), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not accepted:
            if self.process.poll() is not None:
                raise EngineProcessError(self._died("while starting"))
            if time.monotonic() > deadline:
                raise EngineProcessError(self._died(f"did not connect within {timeout_s:.0f} s"))
            thread.join(0.05)
        return accepted[0]

    def _call(self, request: dict[str, Any], timeout_s: float | None = None) -> object:
        with self._lock:
            if self.process.poll() is not None:
                raise EngineProcessError(self._died(f"before {request['op']!r}"))
            self._conn.send(request)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._conn.poll(0.2):
                if self.process.poll() is not None:
                    raise EngineProcessError(self._died(f"during {request['op']!r}"))
                if deadline is not None and time.monotonic() > deadline:
                    self._kill()
                    raise EngineProcessError(
                        self._died(f"{request['op']!r} took over {timeout_s:.0f} s")
                    )
            reply = self._conn.recv()
        if not reply["ok"]:
            raise EngineProcessError(
                f"the {self.name} engine failed {request['op']!r}: {reply['error']}\n{reply['trace']}"
            )
        return reply["result"]

    def _died(self, when: str) -> str:
        code = self.process.poll()
        state = f"exited with code {code}" if code is not None else "is stuck"
        return f"the {self.name} engine process {state} {when}; its log ({self.log_path}) ends:\n{_tail(self.log_path)}"

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._listener.close()
        self._log.close()
        for name in os.listdir(self._socket_dir):
            os.unlink(os.path.join(self._socket_dir, name))
        os.rmdir(self._socket_dir)


def _source_root() -> str:
    """The directory holding this `posttrain` package, so the child imports the same code
    even from an interpreter where posttrain is not installed (vLLM's own venv)."""
    return str(Path(__file__).resolve().parents[2])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """`params` as plain data for the worker, which rebuilds them with `SamplingParams(**d)`."""
    stop = params.stop
    return {
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "stop": list(stop) if isinstance(stop, tuple | list) else stop,
        "temperature": params.temperature,
        **{name: getattr(params, name) for name in DISTRIBUTION_FIELDS},
        "entropies": params.entropies,
    }
