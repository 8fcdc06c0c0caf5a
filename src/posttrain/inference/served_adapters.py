"""`ServedAdapters`: the versioned LoRA adapters a vLLM server holds for one openai engine
(`[inference] sync = "lora"`).

Each sync loads the step's adapter under a new name, `<base>-posttrain-v<N>`, and every request
made from then on names it as its model. vLLM keys its prefix cache by adapter name, so a new
name per version never reuses prompt KV computed with an older adapter (vLLM #42125: a stale
prefix cache after an adapter is swapped in place under its old name).

A request made with an older name (async RL samples ahead of training) keeps it loaded until it
returns; then the name is unloaded and its directory deleted. At most `keep` names are loaded:
a sync that would need one more waits for the oldest requests to return instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.inference.adapter_export import discard

Post = Callable[[str, dict[str, Any] | None], Awaitable[dict[str, Any]]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    version: int


class ServedAdapters:
    """Loads, names and unloads one engine's adapters on the server at `root` (no /v1)."""

    def __init__(self, post: Post, root: str, base: str, keep: int) -> None:
        if keep < 2:
            raise ValueError(
                f"keep must be >= 2 (the adapter served and the one replacing it), got {keep}"
            )
        self._post = post
        self.root = root
        self.base = base
        self.keep = keep
        self.loaded: list[Adapter] = []  # oldest first; the last one is served
        self._in_flight: Counter[str] = Counter()
        self._loads: Counter[int] = Counter()  # per version: a re-sync gets a name of its own
        self._changed = asyncio.Condition()

    def acquire(self) -> Adapter | None:
        """The adapter a request about to be sent uses, counted in flight until `release`."""
        if not self.loaded:
            return None
        adapter = self.loaded[-1]
        self._in_flight[adapter.name] += 1
        return adapter

    async def release(self, adapter: Adapter) -> None:
        """Its request returned: unload what no request uses any more."""
        self._in_flight[adapter.name] -= 1
        if self._in_flight[adapter.name] <= 0:
            del self._in_flight[adapter.name]
        await self.unload_idle()
        async with self._changed:
            self._changed.notify_all()

    async def load(self, path: Path, version: int) -> Adapter:
        """Load version `version`'s adapter from `path` under a new name and serve it."""
        self._loads[version] += 1
        count = self._loads[version]
        name = f"{self.base}-posttrain-v{version}" + (f"-{count}" if count > 1 else "")
        await self.unload_idle()
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.loaded) < self.keep)
        body = {"lora_name": name, "lora_path": str(path)}
        await self._post(f"{self.root}/v1/load_lora_adapter", body)
        adapter = Adapter(name, path, version)
        self.loaded.append(adapter)
        return adapter

    async def unload_idle(self) -> None:
        """Unload every adapter but the served one that no request in flight uses."""
        for adapter in self.loaded[:-1]:
            if self._in_flight[adapter.name] == 0 and adapter in self.loaded:
                await self._unload(adapter)

    async def unload_all(self) -> None:
        for adapter in list(self.loaded):
            await self._unload(adapter)

    async def _unload(self, adapter: Adapter) -> None:
        self.loaded.remove(adapter)  # before the request: never unloaded twice
        try:
            await self._post(f"{self.root}/v1/unload_lora_adapter", {"lora_name": adapter.name})
        except Exception as exc:  # a name left loaded costs server memory only
            log.warning("could not unload LoRA adapter %s: %s", adapter.name, exc)
        discard(adapter.path)
