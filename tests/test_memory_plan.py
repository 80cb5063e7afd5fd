"""The memory plan (prune/memory_plan.py, models/sizes.py): exact parameter counts from configs, the sizes of the
derived forms models/lean.py keeps, the training activations autograd keeps, and `prune validate`'s plan."""

import json

import pytest
import torch
from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from _pairs import save_tiny_pair
from conftest import build_tiny_drafter
from models.sizes import Shapes
from prune import memory_plan
from prune.cli import main
from prune.config import HealConfig
from prune.memory_plan import GIB, PHASES, Workload, plan_memory, training_activations, warnings_for


def qwen3(hidden, layers, intermediate, heads, tied, **extra) -> Qwen3Config:
    """A Qwen3 config with the public values every released size shares (8 KV heads of 128, 151936 ids)."""
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, tie_word_embeddings=tied,
                       **extra)


# Qwen/Qwen3-1.7B, -8B and -32B config.json
QWEN3_1_7B = qwen3(2048, 28, 6144, 16, tied=True)
QWEN3_8B = qwen3(4096, 36, 12288, 32, tied=False)
QWEN3_32B = qwen3(5120, 64, 25600, 64, tied=False)
# D3D-8B: a drafter of Qwen3-8B's shape (its block keys as the tool reads them)
D3D_8B = qwen3(4096, 36, 12288, 32, tied=False, block_size=16, mask_token_id=151669)


def real_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter, listed once


def test_parameter_counts_of_the_public_qwen3_configs():
    assert Shapes.of(QWEN3_8B).parameters == 8_190_735_360  # "8.19 B"
    assert Shapes.of(QWEN3_32B).parameters == 32_762_123_264  # "32.8 B"
    small = Shapes.of(QWEN3_1_7B)
    assert small.parameters == 1_720_574_976  # one tensor for the tied embedding and head
    assert small.parameters + small.embedding == 2_031_739_904  # "2.03 B": the hub counts the tied head again


TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("config", [
    Qwen3Config(**TINY, tie_word_embeddings=True),
    Qwen3Config(**TINY, tie_word_embeddings=False, attention_bias=True),
    LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    LlamaConfig(**TINY, tie_word_embeddings=True),
    Qwen2Config(**TINY, tie_word_embeddings=False),
    MistralConfig(**TINY, tie_word_embeddings=False),
    GemmaConfig(**TINY),  # outside the Llama family: counted on the meta device
], ids=["qwen3-tied", "qwen3-biases", "llama-biases", "llama-tied", "qwen2", "mistral", "gemma"])
def test_the_count_is_that_of_a_real_model_built_from_the_config(config):
    from transformers import AutoModelForCausalLM

    assert Shapes.of(config).parameters == real_parameters(AutoModelForCausalLM.from_config(config))


def test_the_derived_forms_are_the_sizes_lean_keeps():
    from models.lean import LeanDecoder

    drafter = build_tiny_drafter(num_hidden_layers=3)
    shapes = Shapes.of(drafter.config)
    fused = LeanDecoder(drafter, fused=True, copies=True).layers  # a CPU's setting
    tensors = [t for layer in fused for t in layer if t is not None]
    assert sum(t.numel() for t in tensors) == 3 * shapes.fused_layer
    weights = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    assert not weights & {t.untyped_storage().data_ptr() for t in tensors}  # a copy of the weights
    assert not LeanDecoder(drafter, fused=True, copies=False).fused  # a GPU's: the drafter's own weights
    plain = LeanDecoder(drafter, packed_from=None, copies=True).layers
    assert sum(layer[i].plain.numel() for layer in plain for i in (1, 3, 5, 6)) == 3 * shapes.products


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors autograd keeps for backward of the drafter loss (parameters excluded)."""
    from prune.training.loss import drafter_loss

    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        drafter_loss(model, batch)
    return sum(size for pointer, size in seen.items() if pointer not in parameters)


@pytest.mark.parametrize("train,dtype", [("lora", torch.float32), ("lora", torch.bfloat16), ("full", torch.float32),
                                         ("full", torch.bfloat16)])
def test_training_activations_match_what_autograd_keeps(train, dtype):
    from prune.heal import TRAINERS
    from prune.training.loss import Example, build_batch

    sizes = dict(vocab_size=500, mask_token_id=498, draft_vocab_size=498, block_size=8, hidden_size=128,
                 intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    drafter = build_tiny_drafter(num_hidden_layers=3, **sizes).to(dtype)
    model = TRAINERS[train].prepare(drafter, HealConfig()).train()
    examples = [Example.from_prompt_response(list(range(1, 61)), list(range(100, 200))) for _ in range(2)]
    batch = build_batch(examples, 8, 498, 8, generator=torch.Generator().manual_seed(0), mask_dtype=dtype)
    estimate = training_activations(Shapes.of(drafter.config), batch.input_ids.numel(), dtype.itemsize, train)
    assert estimate == pytest.approx(saved_bytes(model, batch), rel=0.15)


def test_d3d_8b_with_qwen3_32b_fits_80_gib_as_one_copy_not_two():
    card = 80 * GIB
    one, two = (plan_memory(D3D_8B, QWEN3_32B, "cuda", "bfloat16", runtime=0, workload=Workload(batch_size=1),
                            drafter_copies=copies) for copies in (1, 2))
    assert one.weight_bytes == {"drafter": 2 * 8_190_735_360, "target": 2 * 32_762_123_264}

    def without_fast_path(plan):
        return plan.peaks["score"] - plan.parts["score"]["drafter_fast_path"]

    assert without_fast_path(one) < card < without_fast_path(two)
    # on a GPU the lean forward runs the drafter's own weights (models/lean.py): no fast-path form
    assert one.parts["score"]["drafter_fast_path"] == 0 and one.peaks["score"] < card < two.peaks["score"]


def peaks(**changes) -> dict[str, int]:
    arguments = dict(drafter_config=D3D_8B, target_config=QWEN3_8B, device="cpu", dtype="bfloat16", runtime=0)
    return plan_memory(**{**arguments, **changes}).peaks


def test_the_plan_grows_with_what_is_held():
    base = peaks()
    assert set(base) == set(PHASES) and base["score"] < base["run"]
    deeper = peaks(drafter_config=qwen3(4096, 40, 12288, 32, tied=False, block_size=16, mask_token_id=151669))
    assert all(deeper[phase] > base[phase] for phase in PHASES)
    larger_target = peaks(target_config=QWEN3_32B)
    assert larger_target["score"] > base["score"] and larger_target["run"] > base["run"]
    assert larger_target["heal_full"] == base["heal_full"]  # prune heal loads no target
    wider = peaks(workload=Workload(batch_size=32))
    assert wider["score"] > base["score"]
    on_gpu = peaks(device="cuda")  # no target fast path, the drafter in the target's dtype
    assert on_gpu["score"] < base["score"]
    assert peaks(device="cuda", dtype="float32")["score"] > on_gpu["score"]
    assert peaks(target_config=None)["score"] < base["score"]
    # a full heal holds three float32 drafters (source, trainable copy, teacher) and AdamW's states at least
    assert base["heal_full"] > 3 * Shapes.of(D3D_8B).parameters * 4


def test_a_heal_trains_more_than_its_adapters():
    shapes = Shapes.of(D3D_8B)
    lora = memory_plan.lora_parameters(shapes, HealConfig())
    assert lora == 36 * 8 * (2 * 4096 + 4096 + 1024 + 4096 + 1024 + 4096 + 4096 + 2 * (4096 + 12288)
                             + 12288 + 4096)
    assert training_activations(shapes, 100, 2, "full") > training_activations(shapes, 100, 4, "lora") / 2


def test_a_phase_over_the_available_memory_warns_once():
    plan = plan_memory(D3D_8B, QWEN3_32B, "cuda", "bfloat16", runtime=0)
    lines = warnings_for(plan, plan.peaks["score"] + 1, "a mocked GPU")
    over = [phase for phase in PHASES if plan.peaks[phase] > plan.peaks["score"] + 1]
    assert len(lines) == len(over) == 2 and all("a mocked GPU" in line for line in lines)
    assert "prune run" in lines[0] and "prune heal --train full" in lines[1]
    assert warnings_for(plan, None, "unknown") == [] and warnings_for(plan, 1 << 60, "plenty") == []


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    1000000 kB\n")
    available, source = memory_plan.device_memory("cpu", str(meminfo))
    assert available == 1_024_000_000 + memory_plan.runtime_bytes("cpu") and source == "MemAvailable"
    (tmp_path / "empty").write_text("")
    assert memory_plan.device_memory("cpu", str(tmp_path / "empty"))[0] is None


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=2)


def test_validate_reports_the_plan(pair_dirs, capsys, monkeypatch):
    from models.drafter import load_drafter

    args = ["validate", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
            "--dtype", "float32"]
    assert main([*args, "--json", "-"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert captured.err == ""
    assert set(summary["estimated_peak_bytes"]) == set(PHASES)
    for phase, peak in summary["estimated_peak_bytes"].items():
        assert isinstance(peak, int) and peak == sum(summary["peak_parts"][phase].values())
    assert summary["parameters"]["drafter"] == real_parameters(load_drafter(pair_dirs / "drafter"))
    assert summary["bytes"]["drafter"] == 4 * summary["parameters"]["drafter"]
    assert summary["device"] == "cpu" and summary["available_source"] == "MemAvailable"

    monkeypatch.setattr(memory_plan, "device_memory", lambda device: (1, "a mocked machine"))
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: ") and "estimated peak: prune score" in captured.out
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == len(PHASES) and all(line.startswith("warning: ") for line in warnings)


def test_validate_plans_for_a_gpu_it_does_not_have(pair_dirs, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["validate", "--drafter", str(pair_dirs / "drafter"), "--device", "cuda", "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "bfloat16" and summary["available_bytes"] is None
    assert summary["parameters"]["target"] is None and "target_weights" not in summary["peak_parts"]["score"]
