"""Which floating-point format a device computes fastest: the resolution of `--dtype auto`.

bfloat16 halves the weights' memory traffic, but a CPU without native bf16 arithmetic (AMX or
AVX512-BF16) converts every operand and runs small matrix products several times slower than in
float32 (measured on an AVX2-only EPYC: 5-9x for 16-token products). So `auto` takes bfloat16 on a CPU
that reports one of those instruction sets and on a GPU that supports it, float32 elsewhere.
`D3D_PRUNE_AUTO_DTYPE` (float32, bfloat16 or float16) overrides the choice, e.g. for a test suite that
must run float32 on every machine.

The drafter need not compute in the target's dtype: greedy output is the target's whatever the drafter's
numbers, so only speed and acceptance depend on it. On a CPU a small drafter's pass is bound by the fixed
cost of each of its many small operations, which bfloat16 raises (conversions, unfused norms): the demo
drafter's sync-draft pass took 1.14-1.37x as long in bfloat16 as in float32 on 2 AVX512-BF16 cores, right
after a bfloat16 target pass as in decoding. So `auto` gives a drafter float32 on a CPU and the target's
dtype elsewhere (`drafter_dtype`).
"""

import os
import platform
from pathlib import Path

import torch

from .errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
AUTO_DTYPE_ENV = "D3D_PRUNE_AUTO_DTYPE"


def _cpuinfo_value(cpuinfo: str | os.PathLike, field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo (or of the file `cpuinfo`), None where the file
    does not exist or has no such line."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags the CPU reports (empty where /proc/cpuinfo does not exist)."""
    return set((_cpuinfo_value(cpuinfo, "flags") or "").split())


def cpu_name(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's model name as the kernel reports it ("AMD EPYC", "Intel(R) Xeon(R) ..."), else the
    platform's machine name ("x86_64", "arm64") where /proc/cpuinfo does not exist or does not say."""
    return _cpuinfo_value(cpuinfo, "model name") or platform.processor() or platform.machine()


def auto_dtype_name(device: torch.device, flags: set[str] | None = None) -> str:
    """"bfloat16" where `device` computes it natively, else "float32" (see the module docstring)."""
    override = os.environ.get(AUTO_DTYPE_ENV)
    if override:
        return override
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        return "bfloat16" if any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS) else "float32"
    return "float32"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype of `dtype`: a torch dtype as is, a name of DTYPE_NAMES, or "auto" (auto_dtype_name)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = auto_dtype_name(device) if dtype == "auto" else dtype
    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPE_NAMES)} or a torch dtype")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ...: a torch dtype as reports, keys and flags name it."""
    return str(dtype).removeprefix("torch.")


def drafter_dtype(dtype: str | torch.dtype | None, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The drafter's compute dtype: `dtype` as `resolve_dtype` reads it, or for "auto" (and None) float32 on
    a CPU and `target_dtype` elsewhere (see the module docstring)."""
    if dtype is not None and dtype != "auto":
        return resolve_dtype(dtype, device)
    return torch.float32 if device.type == "cpu" else target_dtype
