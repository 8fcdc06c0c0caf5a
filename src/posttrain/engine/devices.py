"""Which device a model runs on: "auto" (CUDA where there is CUDA, else the CPU) or explicit.

Resolved when a backend or client is constructed, so a device the machine lacks is an error
naming the option and the fix there, before any model loads.
"""

from __future__ import annotations

import os

import torch

AUTO = "auto"
FIX = "use device='auto' (CUDA when available, else the CPU) or device='cpu'"


def resolve_device(device: str, *, option: str) -> str:
    """The device to build on in this process: "auto" is "cuda" when CUDA is available, else
    "cpu". An explicit CUDA device this machine lacks raises ValueError naming `option`."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    parsed = _parse(device, option)
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{option} is {device!r}, but CUDA is not available here ({_why_no_cuda()}); {FIX}"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"{option} is {device!r}, but this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1}); choose one of them, or {FIX}"
            )
    return device


def resolve_worker_device(device: str, gpus_per_worker: float, *, option: str) -> str:
    """The device of Ray workers, which may run on other machines than this one: "auto" is
    "cuda" when each worker is given a GPU share, else "cpu"; an explicit CUDA device without a
    GPU share raises ValueError naming `option`."""
    if device == AUTO:
        return "cuda" if gpus_per_worker > 0 else "cpu"
    if _parse(device, option).type == "cuda" and gpus_per_worker <= 0:
        raise ValueError(
            f"{option} is {device!r}, but the workers get no GPU: give resources_per_worker a "
            f"'GPU' share > 0 (e.g. {{'CPU': 1, 'GPU': 1}}), or {FIX}"
        )
    return device


def _parse(device: str, option: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{option} is {device!r}, which is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"no GPU is visible with CUDA_VISIBLE_DEVICES={visible!r}"
    return "no GPU is visible to torch"
