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


def test_cpu_name_reads_the_model_name_and_falls_back_to_the_platform(tmp_path):
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    assert precision.cpu_name(info) == "AMD EPYC 9R14"
    assert precision.cpu_name(tmp_path / "missing") == (platform.processor() or platform.machine())


def test_the_environment_overrides_auto(monkeypatch):
    monkeypatch.setenv(precision.AUTO_DTYPE_ENV, "float32")
    assert precision.auto_dtype_name(CPU, {"amx_bf16"}) == "float32"


def test_the_drafter_computes_in_float32_on_a_cpu_and_as_the_target_elsewhere():
    cuda = torch.device("cuda")  # only named: nothing here runs on it
    assert precision.drafter_dtype("auto", torch.bfloat16, CPU) is torch.float32
    assert precision.drafter_dtype(None, torch.float16, CPU) is torch.float32
    assert precision.drafter_dtype("auto", torch.bfloat16, cuda) is torch.bfloat16
    assert precision.drafter_dtype("bfloat16", torch.float32, CPU) is torch.bfloat16  # asked for: kept
    assert precision.drafter_dtype(torch.float16, torch.float32, cuda) is torch.float16


def test_a_pair_loads_its_drafter_in_the_drafter_dtype(tmp_path):
    from _pairs import save_tiny_pair
    from models.pair import load_pair, pair_with_target

    root = save_tiny_pair(tmp_path)
    pair = load_pair(root / "drafter", root / "target", torch.bfloat16, "cpu")
    assert next(pair.target.parameters()).dtype is torch.bfloat16
    assert next(pair.drafter.parameters()).dtype is torch.float32
    asked = load_pair(root / "drafter", root / "target", torch.float32, "cpu", drafter_compute="bfloat16")
    assert next(asked.drafter.parameters()).dtype is torch.bfloat16
    around = pair_with_target(root / "drafter", pair.target)
    assert next(around.drafter.parameters()).dtype is torch.float32
