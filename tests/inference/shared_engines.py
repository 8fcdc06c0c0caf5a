"""vLLM engine processes shared by the tests of one test process.

A vLLM engine takes 20-35 s to start here (2 cores), and the engine tests start eight with
only two settings between them. `SharedEngines.start` stands in for `ProcessEngine(...)` in
`posttrain.inference.session`: an engine started with the same options (the model directory,
dtype, cache, threads, LoRA slots and rank) and not in use is handed out again instead of a
new one (a second is started while the first is in use), after a whole reload of the base model's weights (which also drops its LoRA
adapters), so each test starts from the engine `_start_process` would have started. A test's
`close()` hands the engine back; the engines stop at the end of the session.

Every check a test makes still runs against a real vLLM process: the reload goes through the
same route as an engine's "model" sync, and each test compares what vLLM samples after its own
syncs with the trainer (1e-5), which a weight the reload missed would fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from posttrain.inference import session
from posttrain.inference.engines import EngineSpec
from posttrain.inference.process import ProcessEngine
from posttrain.inference.protocol import WeightSnapshot


class SharedEngines:
    def __init__(self) -> None:
        self.engines: dict[str, list[ProcessEngine]] = {}  # by start options
        self.in_use: set[int] = set()  # id() of the engines handed out

    def start(self, spec: EngineSpec, *, options: dict[str, Any], version: int, **kwargs: Any):
        """`ProcessEngine(spec, options=..., version=..., ...)`, or an idle one like it."""
        if spec.name != "vllm":
            return ProcessEngine(spec, options=options, version=version, **kwargs)
        pool = self.engines.setdefault(_key(options, kwargs["python"]), [])
        for dead in [e for e in pool if e.process.poll() is not None]:
            pool.remove(dead)
            dead.close_now()
        engine = next((e for e in pool if id(e) not in self.in_use), None)
        if engine is None:
            engine = ProcessEngine(spec, options=options, version=version, **kwargs)
            pool.append(engine)
        else:
            base = WeightSnapshot(Path(options["model_dir"]), version=version, kind="model")
            engine._call({"op": "load", "path": str(base.path)})
            engine.adapters = []
            engine._version = version
        self.in_use.add(id(engine))

        async def hand_back() -> None:
            self.in_use.discard(id(engine))

        engine.close = hand_back
        return engine

    def close(self) -> None:
        for pool in self.engines.values():
            for engine in pool:
                engine.close_now()
        self.engines.clear()


def _key(options: dict[str, Any], python: str) -> str:
    """What the engine was started with; the LoRA rank counts only where LoRA slots are."""
    chosen = dict(options, python=python)
    if not chosen.get("lora_slots"):
        chosen.pop("lora_rank", None)
    return json.dumps(chosen, sort_keys=True)


@contextmanager
def shared_engines(engines: SharedEngines) -> Iterator[SharedEngines]:
    """`posttrain.inference.session` starts its vLLM engines through `engines` meanwhile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "ProcessEngine", engines.start)
        yield engines
