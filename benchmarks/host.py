"""The machine a benchmark ran on, for its header: a ratio of two implementations moves with the
CPU's vector and matrix units as much as with the code. The same `vs_trl.py --rounds 3` gave
1.96x on a 2-core AMD EPYC with AVX2 and 1.58x on an Intel Xeon with AVX-512 and AMX, where
the older code measured the same 1.59x (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The flags that decide which matmul and attention kernels run: x86's AVX2/FMA, AVX-512 and its
# bf16/VNNI/fp16 parts, AMX tiles; ARM's NEON (asimd), SVE and SME.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sme",
)


def describe_cpu(cpuinfo: str, cpus: int) -> str:
    """'MODEL (N CPUs; ISA flags: ...)' from /proc/cpuinfo's text: the first processor's model
    name and the flags of ISA_FLAGS it has (x86 `flags`, ARM `Features`)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    present = set((fields.get("flags") or fields.get("features") or "").split())
    flags = [flag for flag in ISA_FLAGS if flag in present]
    return f"{model} ({cpus} CPUs; ISA flags: {', '.join(flags) or 'none of those listed'})"


def describe_host(device: str = "cpu") -> str:
    """This machine: its CPU (model, usable CPUs, ISA flags) and the kernels torch picked for it,
    and the GPU's name when `device` is a CUDA one."""
    import torch

    path = Path("/proc/cpuinfo")
    cpuinfo = path.read_text() if path.exists() else ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    host = f"{describe_cpu(cpuinfo, cpus or 1)}, torch CPU kernels {torch.backends.cpu.get_cpu_capability()}"
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        host = f"{torch.cuda.get_device_name(torch.device(device))}; {host}"
    return host


def host_line(device: str = "cpu") -> str:
    """The header line every benchmark prints first."""
    return f"host: {describe_host(device)}"
