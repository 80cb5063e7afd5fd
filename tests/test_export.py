"""Exported pruning steps: plain-transformers loading, no removed tensors, cache consistency, hashes."""

import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import build_tiny_drafter
from models.drafter import save_drafter
from models.surgery import remove_layers
from prune.export import REPORT_NAME, export_step, verify_export


def test_export_is_complete_loadable_and_hashed(tmp_path):
    source = tmp_path / "source"
    base = build_tiny_drafter(num_hidden_layers=4, block_size=4)
    save_drafter(base, source)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    pruned = remove_layers(base, [1, 2])
    history = [{"step": 1, "removed_original": [1, 2], "layers": 2, "tau_before_heal": 2.0, "tau": 2.5,
                "retention": 0.97, "predicted_speedup": 1.4}]
    folder = export_step(pruned, tmp_path / "step-01", source, {"settings": {"seed": 0}}, history,
                         dtype=torch.bfloat16)
    assert verify_export(folder) == []
    report = json.loads((folder / REPORT_NAME).read_text())
    assert set(report["files"]) >= {"config.json", "model.safetensors", "README.md", "generation_config.json"}
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 3
    assert "| 1 | [1, 2] | 2 |" in (folder / "README.md").read_text()
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        layers = {name.split(".")[2] for name in handle.keys() if name.startswith("model.layers.")}
    assert layers == {"0", "1"}

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert model.config.original_layer_indices == [0, 3]
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], cache=cache)
        step = model(ids[:, 8:], cache=cache).logits
    assert (step - full[:, 8:]).abs().max() < 1e-4

    (folder / "README.md").write_text("tampered")
    assert verify_export(folder) == ["README.md"]


def test_export_removes_layers_named_by_their_original_index(tmp_path, capsys):
    from prune.cli import main

    source = tmp_path / "source"
    base = build_tiny_drafter(num_hidden_layers=4, block_size=4)
    save_drafter(base, source)
    assert main(["export", str(source), str(tmp_path / "minus2"), "--remove-layers", "2,0"]) == 0
    minus2 = tmp_path / "minus2"
    kept = AutoModelForCausalLM.from_pretrained(str(minus2), dtype=torch.float32)
    assert kept.config.original_layer_indices == [1, 3] and kept.config.num_hidden_layers == 2
    for new, old in ((0, 1), (1, 3)):
        assert torch.equal(kept.model.layers[new].mlp.down_proj.weight, base.model.layers[old].mlp.down_proj.weight)
    report = json.loads((minus2 / REPORT_NAME).read_text())
    # the row says what was removed; the source is recorded so that `prune heal` finds its teacher
    assert report["history"] == [{"step": "export", "removed_original": [2, 0], "layers": 2}]
    assert report["source"] == str(source.resolve()) and verify_export(minus2) == []

    # Indices stay those of the unpruned drafter when the source is itself pruned.
    assert main(["export", str(minus2), str(tmp_path / "minus3"), "--remove-layers", "3"]) == 0
    minus3 = json.loads((tmp_path / "minus3" / REPORT_NAME).read_text())
    assert minus3["source"] == str(source.resolve()) and [h["removed_original"] for h in minus3["history"]] == [[2, 0], [3]]
    assert json.loads((tmp_path / "minus3" / "config.json").read_text())["original_layer_indices"] == [1]

    capsys.readouterr()
    assert main(["export", str(minus2), str(tmp_path / "gone"), "--remove-layers", "0"]) == 1
    assert "original layer 0 is not in this drafter (already removed or out of range)" in capsys.readouterr().err
    assert main(["export", str(minus2), str(tmp_path / "gone"), "--remove-layers", "1,3"]) == 1
    assert "cannot remove all 2 layers" in capsys.readouterr().err
    assert not (tmp_path / "gone").exists()
