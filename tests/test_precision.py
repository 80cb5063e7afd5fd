"""`--dtype auto`: bfloat16 where the CPU computes it natively, float32 elsewhere (detection mocked)."""

import torch

from models import precision
from prune.commands._common import torch_dtype

CPU = torch.device("cpu")


def test_auto_dtype_follows_the_reported_cpu_flags(monkeypatch):
    monkeypatch.delenv(precision.AUTO_DTYPE_ENV, raising=False)
    assert precision.auto_dtype_name(CPU, {"avx2", "fma"}) == "float32"
    assert precision.auto_dtype_name(CPU, {"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert precision.auto_dtype_name(CPU, {"amx_bf16", "amx_tile"}) == "bfloat16"
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"amx_bf16"})
    assert torch_dtype("auto", CPU) is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2"})
    assert torch_dtype("auto", CPU) is torch.float32
    assert torch_dtype("float16", CPU) is torch.float16  # an explicit dtype is never changed


def test_cpu_flags_reads_proc_cpuinfo_and_survives_its_absence(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert precision.cpu_flags(info) == {"fpu", "sse2", "avx2", "avx512_bf16"}
    assert precision.cpu_flags(tmp_path / "missing") == set()


def test_the_environment_overrides_auto(monkeypatch):
    monkeypatch.setenv(precision.AUTO_DTYPE_ENV, "float32")
    assert precision.auto_dtype_name(CPU, {"amx_bf16"}) == "float32"
