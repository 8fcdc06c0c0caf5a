"""Whether Ray workers see this process's storage directory: a marker file written here, read
back on each worker.

Rank 0 writes checkpoints and exported weights under the storage directory, and with full
replicas every rank reads checkpoints from it, while this process (the driver) lists, prunes
and reads them. On a cluster, a worker whose node has no such directory, or one of the same
name on its own disk, would write where the driver never looks. Comparing Ray node ids cannot
tell: two nodes may mount the same network storage, and one node may hide a path behind a
mount of its own. So the check is the thing itself: a file holding a fresh random token,
written here, must read back with that token on the worker. Its name is fresh too, so a
network filesystem's cache of an earlier lookup cannot answer for it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

MARKER_PREFIX = ".posttrain-storage-check-"


class StorageNotShared(ValueError):
    """A worker that reads or writes checkpoint files does not see the driver's storage."""


def write_marker(directory: Path) -> tuple[Path, str]:
    """A marker file under `directory` (made if missing) and the token it holds."""
    directory.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    path = directory / f"{MARKER_PREFIX}{token}"
    path.write_text(token)
    return path, token


def read_marker(path: str) -> str | None:
    """The marker's text as this process sees it; None if there is no such file here."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def not_shared_message(directory: Path, blind: Sequence[tuple[int, str]]) -> str:
    """Why `directory` is refused: `blind` lists (rank, Ray node id) that do not see it."""
    ranks = ", ".join(f"rank {rank} on Ray node {node[:12]}" for rank, node in blind)
    return (
        f"the storage directory {directory} is not shared with the Ray workers: a file this "
        f"process wrote there is not visible to {ranks}, so checkpoints and exported weights "
        "would be written to, or read from, that node's own disk. Give the backend a path on "
        "storage every node mounts at the same place (NFS, a shared volume): "
        "RayBackend(path=...) or create_training_client(storage_dir=...)"
    )
