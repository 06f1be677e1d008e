"""What this machine's CPU is, for the choices and caches that depend on it (kernels, cost curves, native builds)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU's model name ("model name" in /proc/cpuinfo; the platform's processor elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags, sorted (x86 "flags", Arm "Features"); empty where /proc/cpuinfo is unreadable."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return tuple(sorted(line.split(":", 1)[1].split()))
    return ()


def hardware_name(device) -> str:
    """The GPU's name for a CUDA `device` (a torch.device), else the CPU's."""
    if device.type != "cuda":
        return cpu_name()
    import torch  # only for a CUDA device: this module stays free of torch (llama.cpp's build reads it)

    return torch.cuda.get_device_name(device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower
    than fp32."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def vector_flags() -> str:
    """The flags that decide which kernels run fast here (AVX, AVX-512, AMX, bf16, VNNI), for people."""
    wanted = ("avx", "fma", "amx", "bf16", "vnni", "neon", "sve")
    return " ".join(f for f in cpu_flags() if any(f.startswith(w) or w in f for w in wanted)) or "none known"
