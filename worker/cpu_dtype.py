"""The dtype `dtype="auto"` picks on CPU: bf16 where the CPU computes it natively, else fp32.

A CPU with native bf16 instructions (x86 `avx512_bf16` or `amx_bf16`, Arm's `bf16`) runs the
model's matrix products in bf16 several times faster than in fp32; without them torch emulates
bf16 by converting to fp32 and back, which is slower than fp32 itself. The flags are read from
`/proc/cpuinfo` (Linux); elsewhere the CPU counts as without native bf16. (No torch here: the
test suite pins the choice without importing it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""cpuinfo flags (x86 `flags`, Arm `Features`) of CPUs that compute bf16 natively."""
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuDtypeChoice:
    """What "auto" resolves to on this CPU, and why (for the start-up log)."""

    dtype: str
    """"bfloat16" or "float32"."""
    reason: str


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first CPU listed in a `/proc/cpuinfo` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def auto_cpu_dtype(cpuinfo: str | None = None) -> CpuDtypeChoice:
    """bf16 when the CPU has a native bf16 flag, else fp32; `cpuinfo` defaults to this
    machine's `/proc/cpuinfo`."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    found = sorted(cpu_flags(cpuinfo).intersection(NATIVE_BF16_FLAGS))
    if found:
        return CpuDtypeChoice("bfloat16", f"the CPU has native bf16 ({', '.join(found)})")
    names = ", ".join(NATIVE_BF16_FLAGS)
    return CpuDtypeChoice("float32", f"the CPU has no native bf16 (none of {names})")
