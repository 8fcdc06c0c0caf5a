"""`EngineSession`: one model's sampling engine, made from an `InferenceConfig`, and the weight
sync that follows each optimizer step."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.clients.protocol import ExportsWeights, TrainingClient
from posttrain.inference.adapter_export import AdapterExporter, check_carried
from posttrain.inference.adapters import lora_sync_problem, split_adapter
from posttrain.inference.config import InferenceConfig, head_problem
from posttrain.inference.live import LiveEngine
from posttrain.inference.process import ProcessEngine
from posttrain.inference.protocol import SamplingEngine
from posttrain.inference.updates import UpdateExporter
from posttrain.inference.weights import WeightExporter
from posttrain.models.lora import LoraSettings
from posttrain.models.source import resolve_model_source

log = logging.getLogger(__name__)


class EngineSession:
    """The engine a model samples with; `sync(version)` after each update of its weights."""

    def __init__(
        self,
        engine: SamplingEngine,
        exporter: WeightExporter | UpdateExporter | AdapterExporter | None = None,
        source: ExportsWeights | None = None,
    ) -> None:
        self.engine = engine
        self.exporter = exporter
        self.source = source  # where the exporter's weights come from
        # The last sync: sync_s (seconds, of which gathering the trainable weights, writing
        # them for the engine, the engine loading them), sync_bytes (the files written for
        # the engine), sync_version (the model step the engine now samples).
        self.last_sync: dict[str, float] = {}

    @classmethod
    async def open(
        cls,
        config: InferenceConfig,
        client: TrainingClient,
        *,
        base_model: str,
        lora: LoraSettings | None,
        version: int,
        log_dir: Path,
    ) -> EngineSession:
        """The engine for `config`. An engine in a worker process starts on the base model and
        takes, at each sync, only what training changes (`updates.py`), keeping the newest
        `config.versions_kept()` versions (an engine may serve an older one)."""
        keep = config.versions_kept()
        if config.placement == "here":
            return cls(LiveEngine(client, version=version))
        if config.placement == "server":
            exporter = functools.partial(_exporter, base_model, lora)
            return await _open_server(config, client, exporter, version, base_model, lora)
        source = _weights_source(config, client)
        base_dir = _base_dir(base_model)
        exporter = UpdateExporter(
            _weights_dir(),
            base_model=str(base_dir),
            lora=lora,
            route=config.lora_route(),
            dtype=config.dtype,
            keep=keep,
        )
        engine: ProcessEngine | None = None
        try:
            # Starting takes seconds (vLLM: 10-30 s): off the event loop.
            engine = await asyncio.to_thread(
                _start_process, config, base_dir, lora, keep, version, log_dir
            )
            session = cls(engine, exporter, source)
            await session.sync(version)  # the client's weights now (a resumed run's too)
        except BaseException:
            if engine is not None:
                await engine.close()
            exporter.close()
            raise
        return session

    async def sync(self, version: int) -> None:
        """Give the engine the weights of model step `version` (the client's current ones);
        nothing for an engine that samples a fixed policy (`policy_gap` reports how far)."""
        began = time.perf_counter()
        if self.engine.capabilities.weight_sync == "none":
            self.last_sync = {}
            return
        if self.exporter is None or self.source is None:
            await self.engine.update_weights(None, version)
            self.last_sync = {"sync_s": time.perf_counter() - began}
            return
        weights = await self.source.trainable_weights()
        gathered = time.perf_counter()
        snapshot = await asyncio.to_thread(self.exporter.export, weights, version)
        exported = time.perf_counter()
        await self.engine.update_weights(snapshot, version)
        done = time.perf_counter()
        self.last_sync = {
            "sync_s": done - began,
            "sync_gather_s": gathered - began,
            "sync_write_s": exported - gathered,
            "sync_load_s": done - exported,
            "sync_bytes": float(snapshot.bytes or _bytes(snapshot.path)),
            "sync_version": float(version),
        }

    def policy_gap(self, version: int) -> dict[str, float]:
        """For an engine that samples a fixed policy, how many steps model step `version` is
        past the policy it samples (`sampler_steps_behind`); {} for one that follows."""
        if self.engine.capabilities.weight_sync != "none":
            return {}
        return {"sampler_steps_behind": float(version - self.engine.version)}

    async def close(self) -> None:
        try:
            await self.engine.close()
        finally:
            if self.exporter is not None:
                self.exporter.close()


async def _open_server(
    config: InferenceConfig,
    client: TrainingClient,
    exporter: Callable[[], WeightExporter],
    version: int,
    base_model: str,
    lora: LoraSettings | None,
) -> EngineSession:
    """The openai engine. With sync = 'none' it samples the server's fixed policy (explicitly
    off-policy). Otherwise the server takes the model's current weights now, before any work:
    a server that cannot (no dev-mode endpoints, no runtime LoRA, or it cannot read this
    machine's files) is refused here, never after an optimizer step has been applied.

    A LoRA model (`lora`) under 'lora', and 'auto' where the adapter fits vLLM's LoRA, sends
    the adapter alone; 'auto' falls back to whole weights if the server refuses it."""
    from posttrain.inference.openai_engine import OpenAIEngine, OpenAIServerError

    # The server reads the weights from this machine's files, so it must run here.
    source = None if config.fixed_policy else _weights_source(config, client)
    adapters = await _adapter_route(config, source, lora.rank if lora else None)
    remote = OpenAIEngine(config, version=version, keep=config.versions_kept())
    await remote.start()
    if source is None:
        log.warning(
            "the openai engine at %s samples its own fixed weights (sync = 'none'): training "
            "on its samples goes off-policy as the model moves away from them; each step "
            "reports the gap (sampler_steps_behind, kl_sample_train_v1/v2)",
            config.url,
        )
        return EngineSession(remote)
    session = EngineSession(remote, None, source)
    refused: Exception | None = None
    try:
        if adapters and lora is not None:
            directory = _weights_dir()
            session.exporter = AdapterExporter(base_model, directory, lora=lora)
            try:
                await session.sync(version)
                return session
            except OpenAIServerError as exc:
                if config.sync == "lora":
                    raise
                refused = exc  # 'auto': the server takes no adapter; whole weights, then
                session.exporter.close()
                session.exporter = None
                log.warning("%s: sync = 'auto' sends whole weights instead", exc)
        session.exporter = exporter()
        await session.sync(version)
    except BaseException as exc:
        await session.close()
        if isinstance(exc, Exception):
            _note_refusal(exc, config, adapters and config.sync == "lora", refused)
        raise
    return session


async def _adapter_route(
    config: InferenceConfig, source: ExportsWeights | None, rank: int | None
) -> bool:
    """Whether the openai engine's weights go as a LoRA adapter: sync = 'lora' (refused for
    what vLLM's LoRA cannot carry), or 'auto' on a LoRA model whose adapter it can."""
    if source is None or config.sync not in ("lora", "auto"):
        return False
    if not rank:
        if config.sync == "lora":
            check_carried(split_adapter({}))  # refused: full fine-tuning
        return False
    split = split_adapter(await source.trainable_weights())
    if config.sync == "lora":
        check_carried(split)
        return True
    return lora_sync_problem(split.adapted, split.whole) is None


def _note_refusal(
    exc: Exception, config: InferenceConfig, adapters: bool, refused: Exception | None
) -> None:
    what = "LoRA adapters" if adapters else "the model's weights"
    exc.add_note(
        f"[inference] sync = {config.sync!r}: the server at {config.url} must load {what} "
        "from this machine's files (vLLM on this machine, with VLLM_SERVER_DEV_MODE=1 for "
        "whole weights); to sample its own fixed weights instead (off-policy training), set "
        "sync = 'none'"
    )
    if refused is not None:
        exc.add_note(f"it refused the LoRA adapter too: {refused}")


def _weights_source(config: InferenceConfig, client: TrainingClient) -> ExportsWeights:
    if not isinstance(client, ExportsWeights):
        raise TypeError(
            f"[inference] engine = {config.engine!r} needs the training client's weights, "
            f"which {type(client).__name__} cannot hand over; use engine = 'pytorch'"
        )
    return client


def _exporter(base_model: str, lora: LoraSettings | None) -> WeightExporter:
    return WeightExporter(base_model, _weights_dir(), lora=lora)


def _base_dir(base_model: str) -> Path:
    base_dir = Path(resolve_model_source(base_model))
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"base_model {base_model!r} is not a model directory; an engine with its own "
            "copy of the model needs a local directory (config.json and safetensors)"
        )
    return base_dir


def _start_process(
    config: InferenceConfig,
    base_dir: Path,
    lora: LoraSettings | None,
    keep: int,
    version: int,
    log_dir: Path,
) -> ProcessEngine:
    """The engine's worker process (vLLM, or pytorch split), on the base model in `base_dir`."""
    problem = head_problem(config, json.loads((base_dir / "config.json").read_text()))
    if problem is not None:  # else vLLM starts (10-30 s) and fails at the first sample
        raise ValueError(f"[inference] {problem}")
    spec = config.spec
    devices = config.split_devices()
    device = devices[0] if devices else "cpu"
    adapter = lora is not None and config.lora_route() == "adapter"
    options = {
        "model_dir": str(base_dir),
        "dtype": config.dtype,
        "kv_cache_mb": config.kv_cache_mb,
        "max_model_len": config.max_model_len or _max_positions(base_dir),
        "threads": config.threads or torch.get_num_threads(),
        "device": device,
        "lora_slots": max(keep, 1) if adapter else 0,
        "lora_rank": lora.rank if lora else 0,
    }
    return ProcessEngine(
        spec,
        python=spec.python(config.python)[0],
        options=options,
        capabilities=config.mode.capabilities,
        version=version,
        start_timeout_s=config.start_timeout_s,
        log_path=log_dir / f"{spec.name}-engine.log",
        env=_visible_gpu(device) if spec.sees_one_gpu else None,
    )


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _weights_dir() -> Path:
    """A fresh directory for weight snapshots: in memory (/dev/shm) where there is one."""
    shm = Path("/dev/shm")
    root = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="posttrain-weights-", dir=root))


def _visible_gpu(device: str) -> dict[str, str] | None:
    """vLLM takes its GPU from CUDA_VISIBLE_DEVICES: "cuda:1" makes GPU 1 its only one."""
    kind, _, index = device.partition(":")
    return {"CUDA_VISIBLE_DEVICES": index or "0"} if kind == "cuda" else None


def _max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
