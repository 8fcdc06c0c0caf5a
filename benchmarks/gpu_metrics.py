"""GPU figures for the step benchmarks: peak memory per side, model FLOPs and MFU.

MFU (model FLOP utilisation, PaLM's definition) is the model's useful arithmetic per second over
the chip's dense peak for the dtype that does the work. Useful arithmetic counts each token once
however an implementation batches it: a group's prompt once (its completions share it), every
completion token, and N, the weights of every linear layer (the unembedding included; an
embedding lookup is no matmul). Per token, sampling does 2N FLOPs; training does a forward and
a backward, 6N with every weight trained and 4N with LoRA (the frozen weights get no weight
gradient; the adapters' own FLOPs are under 1%). Attention's T^2 term is left out: at the
benchmark's ~50-token sequences it is under 1% of 2N at 0.5B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Dense peak FLOP/s from NVIDIA's datasheets (without sparsity), by dtype of the arithmetic.
# fp32 is the CUDA-core rate: torch keeps TF32 off for float32 matmuls unless a user enables it.
PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "H100 PCIe": {"bfloat16": 756.0e12, "float32": 51.2e12},
    "H200": {"bfloat16": 989.4e12, "float32": 66.9e12},
}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The datasheet peak for a device name as torch reports it, or None when unknown."""
    if "H200" in device_name:
        return PEAKS["H200"][dtype]
    if "H100" in device_name:
        return PEAKS["H100 PCIe" if "PCIe" in device_name else "H100 SXM"][dtype]
    return None


def matmul_parameters(model: torch.nn.Module) -> int:
    """N: the weights of every nn.Linear (a tied unembedding counts once, as its matmul)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one RL step (sampling and training apart)."""

    sampling: float
    training: float

    @classmethod
    def of(cls, n: int, unique_tokens: int, full_fine_tuning: bool) -> StepFlops:
        per_token = 6 if full_fine_tuning else 4
        return cls(sampling=2.0 * n * unique_tokens, training=per_token * n * unique_tokens)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    return None if peak is None or seconds <= 0 else flops / seconds / peak


class PeakMemory:
    """Each side's own peak GPU memory during its steps, with several sides resident at once.

    The allocator's peak is global, so a side's step peak is the global peak during its step
    less what the other sides hold resident; a side's resident bytes are what allocation grew
    by while it was built and warmed up (measured with the others idle).
    """

    def __init__(self, device: str) -> None:
        self.enabled = torch.device(device).type == "cuda"
        self.resident: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._before = 0

    def start_building(self) -> None:
        if self.enabled:
            torch.cuda.synchronize()
            self._before = torch.cuda.memory_allocated()

    def built(self, side: str) -> None:
        if self.enabled:
            torch.cuda.synchronize()
            self.resident[side] = torch.cuda.memory_allocated() - self._before

    def start_step(self) -> None:
        if self.enabled:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def end_step(self, side: str) -> None:
        if not self.enabled:
            return
        torch.cuda.synchronize()
        others = sum(v for k, v in self.resident.items() if k != side)
        own = torch.cuda.max_memory_allocated() - others
        self.peaks[side] = max(self.peaks.get(side, 0), own)


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
