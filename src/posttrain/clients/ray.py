"""RayTrainingClient: the TrainingClient protocol over Ray actor workers (data parallel)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from posttrain.clients.futures import APIFuture
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.local_sampling import LocalSamplingClient
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.ray_executor import RayExecutor
from posttrain.engine.worker import Worker


class RayTrainingClient(LocalTrainingClient):
    """LocalTrainingClient's calls, run by `Dispatch` on a `RayExecutor`'s actors.

    Only the executor differs, so results match the local client's; `close()` also frees
    the actors and the local Ray it started. Sampling clients (`create_sampling_client`,
    `save_weights_and_get_sampling_client`) hold their replica in this process, built by
    `worker_factory`.
    """

    def __init__(
        self,
        executor: RayExecutor,
        *,
        storage_dir: str | Path,
        base_model: str = "",
        worker_factory: Callable[[], Worker] | None = None,
    ) -> None:
        super().__init__(
            Dispatch(executor),
            storage_dir=storage_dir,
            base_model=base_model,
            worker_factory=worker_factory,
        )
        self.executor = executor

    def save_weights_and_get_sampling_client(self) -> APIFuture[LocalSamplingClient]:
        """As the local client's: rank 0's actor writes the snapshot and this process reads it,
        so rank 0 must run on this machine (always so on the local Ray started here).

        On a cluster where it does not, a ValueError names the way that works there.
        """
        if not self.executor.rank0_is_local():
            raise ValueError(
                "save_weights_and_get_sampling_client builds its replica in this process from "
                "files rank 0 writes, but rank 0 runs on another node of the Ray cluster: use "
                "save_weights_for_sampler(name) and create the sampling client from that path "
                "in a process on the cluster that sees it"
            )
        return super().save_weights_and_get_sampling_client()

    def weight_digests(self) -> APIFuture[list[str]]:
        """A digest of each rank's trainable weights (all equal while replicas are in sync)."""
        return self._runner.submit(self.executor.weight_digests)

    def close(self) -> None:
        super().close()
        self.executor.close()
