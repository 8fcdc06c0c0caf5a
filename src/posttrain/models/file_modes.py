"""Weight files and written directories with the modes the process's umask gives, as `open()` and
`mkdir()` make every other file.

safetensors' `save_file` (and so `save_pretrained`) writes a temporary file and renames it, which
leaves `model.safetensors` 0600 beside its 0644 siblings, and `tempfile.mkdtemp` makes a
directory 0700: an export, a checkpoint or a cached model meant for a hub, another user or a
container under another uid could not be read there. Each writer of weights goes through here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by modules that load torch only when they convert a model
    import torch

_UMASK_LOCK = threading.Lock()
_STATUS = Path("/proc/self/status")  # Linux's "Umask:" line


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:
        # Only os.umask reads it elsewhere, by setting it: set a stricter one meanwhile, so a
        # file another thread creates in that instant is never more open than it would be.
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def apply_umask(*paths: Path) -> None:
    """Give each file mode 0o666 and each directory 0o777, less the umask."""
    mask = umask()
    for path in paths:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def apply_umask_to_weights(directory: Path) -> None:
    """The safetensors files `save_pretrained` wrote in `directory` (one, or its shards)."""
    apply_umask(*directory.glob("*.safetensors"))


def save_tensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None
) -> None:
    """safetensors' `save_file`, the file then given the umask's mode."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata is not None else None)
    apply_umask(path)
