"""The server's sampling models: the base model or saved weights, loaded once and kept, the
most recently used last, at most `size` of them (each an adapter on the base model's shared
weights, `models.shared_base`).

`get` runs on the compute thread only (sampling jobs run there; `Runtime.sampler` sends it
there), so the lock, held through a load, is never held by a thread waiting for compute.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from posttrain.clients.local import LocalTrainingClient

# Loads the sampling model of saved weights (None: the base model) with its LoRA settings.
Load = Callable[[str | None, dict[str, int | bool] | None], LocalTrainingClient]


class SamplerCache:
    """Sampling models by the directory of their weights, least recently used dropped first."""

    def __init__(
        self, size: int, load: Load, on_drop: Callable[[str], None] = lambda key: None
    ) -> None:
        self.size = size
        self.load = load
        self.on_drop = on_drop  # told the key of each sampler that leaves (`server.residency`)
        self._samplers: OrderedDict[str, LocalTrainingClient] = OrderedDict()
        # Re-entrant: a load may make room by evicting other samplers (`server.residency`).
        self._lock = threading.RLock()

    def get(
        self, weights_dir: str | None, lora: dict[str, int | bool] | None
    ) -> LocalTrainingClient:
        key = _cache_key(weights_dir)
        with self._lock:
            client = self._samplers.get(key)
            if client is not None:
                self._samplers.move_to_end(key)
                return client
            client = self.load(weights_dir, lora)
            self._samplers[key] = client
            while len(self._samplers) > self.size:
                # Dropped, not closed: a request that already holds it finishes on it, and the
                # model is freed with the last reference.
                self.on_drop(self._samplers.popitem(last=False)[0])
            return client

    def evict(self, weights_dir: str) -> None:
        """Forget the sampler loaded from `weights_dir`.

        Loads hold the same lock, so a sampler being loaded from the old files is evicted
        too, once loaded. A request that already holds it finishes on it.
        """
        with self._lock:
            self._forget(_cache_key(weights_dir))

    def drop(self, weights_dir: str) -> None:
        """Evict the sampler of `weights_dir`, then delete the directory (the caller's thread).

        The directory is renamed away under the lock, so no request loads it again between
        the eviction and the deletion; the slow part, deleting, runs outside.
        """
        with self._lock:
            self._forget(_cache_key(weights_dir))
            hidden = hide_dir(Path(weights_dir))
        if hidden is not None:
            shutil.rmtree(hidden, ignore_errors=True)

    def _forget(self, key: str) -> None:
        if self._samplers.pop(key, None) is not None:
            self.on_drop(key)


def hide_dir(directory: Path) -> Path | None:
    """Rename `directory` to a hidden sibling (None if there is none), for deletion: a crash
    mid-delete leaves a hidden directory, not a half checkpoint."""
    if not directory.is_dir():
        return None
    hidden = directory.with_name(f".{directory.name}.deleting-{uuid.uuid4().hex}")
    directory.rename(hidden)
    return hidden


def _cache_key(weights_dir: str | None) -> str:
    return "" if weights_dir is None else str(Path(weights_dir))
