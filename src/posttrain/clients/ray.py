"""RayTrainingClient: the TrainingClient protocol over Ray actor workers (data parallel)."""

from __future__ import annotations

from pathlib import Path

from posttrain.clients.futures import APIFuture
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.ray_executor import RayExecutor


class RayTrainingClient(LocalTrainingClient):
    """LocalTrainingClient's calls, run by `Dispatch` on a `RayExecutor`'s actors.

    Only the executor differs, so results match the local client's; `close()` also frees
    the actors and the local Ray it started.
    """

    def __init__(
        self, executor: RayExecutor, *, storage_dir: str | Path, base_model: str = ""
    ) -> None:
        super().__init__(Dispatch(executor), storage_dir=storage_dir, base_model=base_model)
        self.executor = executor

    def weight_digests(self) -> APIFuture[list[str]]:
        """A digest of each rank's trainable weights (all equal while replicas are in sync)."""
        return self._runner.submit(self.executor.weight_digests)

    def close(self) -> None:
        super().close()
        self.executor.close()
