"""Sharded checkpoints (the hub's model-0000i-of-0000N.safetensors + index) and where a config keeps the drafter
keys: loading, validation with one-line errors naming the shard, sharded exports and runs, nested keys and the
--block-size / --mask-token-id flags (models/shards.py, models/drafter_config.py)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from _pairs import prompt_ids, tiny_target
from conftest import build_tiny_drafter, export_interrupted_at
from models.drafter import load_drafter, save_drafter, validate_checkpoint
from models.errors import CheckpointError, ConfigError
from models.checkpoint import sha256_file
from models.shards import INDEX_NAME, stored_dtype, weight_files, weights_sha256
from prune.cli import main
from prune.export import REPORT_NAME, verify_export

SHARD = 40_000  # bytes: a tiny 3-layer float32 drafter (106 kB) in at least 3 shards
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 7]])


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's weight files, whatever their layout."""
    return {name: tensor for file in weight_files(folder) for name, tensor in load_file(str(file)).items()}


def shard_names(folder) -> list[str]:
    return [file.name for file in weight_files(folder)]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """(model, its single-file folder, the same model as a sharded folder)."""
    root = tmp_path_factory.mktemp("shards")
    model = build_tiny_drafter(num_hidden_layers=3)
    return model, save_drafter(model, root / "single"), save_drafter(model, root / "sharded", max_shard_size=SHARD)


@pytest.fixture
def sharded(drafters, tmp_path):
    """A copy of the sharded drafter to damage."""
    return shutil.copytree(drafters[2], tmp_path / "drafter")


def outcome(capsys, argv) -> tuple[int, str]:
    """(exit code, the last line of stderr) of the CLI in-process; stderr must be that one line."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return code, err


# ----------------------------------------------------------------------------------------------------
# Round trip
# ----------------------------------------------------------------------------------------------------


def test_a_sharded_drafter_validates_and_loads_as_its_single_file_save(drafters, capsys):
    model, single, sharded = drafters
    assert shard_names(single) == ["model.safetensors"] and not (single / INDEX_NAME).exists()
    names = shard_names(sharded)
    assert len(names) >= 3 and names == [f"model-{i:05d}-of-{len(names):05d}.safetensors"
                                         for i in range(1, len(names) + 1)]
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / INDEX_NAME).read_text())
    tensors = stored_tensors(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"].values()) == set(names)
    assert tensors.keys() == load_file(str(single / "model.safetensors")).keys()

    assert validate_checkpoint(sharded).to_dict() == validate_checkpoint(single).to_dict()
    a, b = load_drafter(single), load_drafter(sharded)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    with torch.no_grad():
        assert torch.equal(b(IDS).logits, model(IDS).logits)
    assert main(["validate", "--drafter", str(sharded), "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["weight_files"] == len(names) and summary["layers"] == 3


def test_a_sharded_bfloat16_save_keeps_its_dtype(drafters, tmp_path):
    folder = save_drafter(drafters[0], tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size=SHARD // 2)
    assert len(shard_names(folder)) >= 3 and stored_dtype(folder) == "bfloat16"
    assert {t.dtype for t in stored_tensors(folder).values()} == {torch.bfloat16}


def test_one_sha256_names_a_folders_weights_in_either_layout(drafters, sharded, tmp_path):
    """What distillation data records of its target (prune.training.data): a single file's own sha256; the
    shards' together, changed by a change in any shard; nothing for a folder without safetensors weights."""
    _, single, _ = drafters
    assert weights_sha256(single) == sha256_file(single / "model.safetensors")
    before = weights_sha256(sharded)
    assert before is not None and before != weights_sha256(single)
    last = weight_files(sharded)[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    last.write_bytes(bytes(data))
    assert weights_sha256(sharded) != before
    (tmp_path / "gguf-only").mkdir()
    assert weights_sha256(tmp_path / "gguf-only") is None and weights_sha256(tmp_path / "t.gguf") is None


def test_prune_export_writes_a_sharded_folder_that_plain_transformers_loads(drafters, tmp_path, capsys):
    _, _, sharded = drafters
    out = tmp_path / "export"
    assert main(["export", str(sharded), str(out), "--remove-layers", "1", "--max-shard-size", "30KB",
                 "--json", "-"]) == 0
    record = json.loads(capsys.readouterr().out)
    names = shard_names(out)
    assert len(names) >= 2 and record["weight_files"] == names and record["layers"] == 2
    # The export's record hashes every shard and the index; the folder verifies as exported.
    files = json.loads((out / REPORT_NAME).read_text())["files"]
    assert set(names) | {INDEX_NAME} <= set(files) and verify_export(out) == []
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert model.config.original_layer_indices == [0, 2]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():  # a prefill, then one token at a time: every kept layer reads its own cache entry
        full = model(IDS, use_cache=False).logits
        cached = [model(IDS[:, :4], cache=cache, use_cache=True).logits]
        cached += [model(IDS[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(4, IDS.shape[1])]
    assert (torch.cat(cached, 1) - full).abs().max() < 1e-5
    # Below the size the same export is one file, as before.
    assert main(["export", str(sharded), str(tmp_path / "single"), "--remove-layers", "1"]) == 0
    assert shard_names(tmp_path / "single") == ["model.safetensors"]
    a, b = stored_tensors(out), stored_tensors(tmp_path / "single")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# Damaged, missing and extra shards; an index that does not match them
# ----------------------------------------------------------------------------------------------------


def truncate(folder):
    shard = folder / shard_names(folder)[1]
    shard.write_bytes(shard.read_bytes()[:-7])
    return shard.name, "not a valid safetensors file"


def bad_header(folder):
    shard = folder / shard_names(folder)[1]
    data = bytearray(shard.read_bytes())
    data[8:30] = b"\x00\x01 not json at all }{"
    shard.write_bytes(bytes(data))
    return shard.name, "not a valid safetensors file"


def missing(folder):
    shard = folder / shard_names(folder)[-1]
    shard.unlink()
    return shard.name, "is missing"


def extra(folder):
    count = len(shard_names(folder))
    name = f"model-{count + 1:05d}-of-{count + 1:05d}.safetensors"
    shutil.copy(folder / shard_names(folder)[0], folder / name)
    return name, "does not name"


def phantom_tensor(folder):
    """The index maps a tensor to a shard that does not hold it."""
    index = json.loads((folder / INDEX_NAME).read_text())
    shard = shard_names(folder)[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return shard, "does not hold tensor model.layers.9.mlp.up_proj.weight"


def moved_tensor(folder):
    """The index maps a tensor to the wrong shard."""
    index = json.loads((folder / INDEX_NAME).read_text())
    name = "model.norm.weight"
    holder = index["weight_map"][name]
    index["weight_map"][name] = next(s for s in shard_names(folder) if s != holder)
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return holder, f"holds tensor {name}"


def both_layouts(folder):
    shutil.copy(folder / shard_names(folder)[0], folder / "model.safetensors")
    return "model.safetensors", "keep one layout"


def index_not_json(folder):
    (folder / INDEX_NAME).write_text('{"weight_map": {')
    return INDEX_NAME, "not a readable JSON index"


@pytest.mark.parametrize("damage", [truncate, bad_header, missing, extra, phantom_tensor, moved_tensor, both_layouts,
                                    index_not_json])
def test_a_damaged_sharded_checkpoint_is_one_line_naming_the_shard(sharded, damage, capsys):
    name, words = damage(sharded)
    for call in (validate_checkpoint, load_drafter):
        with pytest.raises(CheckpointError) as info:
            call(sharded)
        assert name in str(info.value) and words in str(info.value) and "\n" not in str(info.value)
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded)])
    assert code == 1 and line.startswith("Error: ") and name in line and words in line


def test_the_weight_map_is_checked_against_config_json(sharded, capsys):
    """A config with a layer more than the index maps: the error names the index and the missing tensors."""
    edit_config(sharded, lambda c: c.update(num_hidden_layers=4, original_layer_indices=[0, 1, 2, 3],
                                            layer_types=["full_attention"] * 4))
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded)])
    assert code == 1 and INDEX_NAME in line and "missing model.layers.3." in line


# ----------------------------------------------------------------------------------------------------
# Where the drafter keys are: top level, nested (DFlash-style), or given by flags
# ----------------------------------------------------------------------------------------------------


def edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def nest(config):
    config["dflash_config"] = {"mask_token_id": config.pop("mask_token_id"), "target_layer_ids": [1, 2]}


def nest_both(config):
    nest(config)
    config["dflash_config"]["block_size"] = config.pop("block_size")


@pytest.mark.parametrize("edit", [nest, nest_both], ids=["mask-nested", "both-nested"])
def test_nested_drafter_keys_load_and_export_at_the_top_level(drafters, sharded, edit, tmp_path, capsys):
    edit_config(sharded, edit)
    config = validate_checkpoint(sharded)
    assert (config.block_size, config.mask_token_id) == (4, 97)
    model = load_drafter(sharded)
    assert (model.config.block_size, model.config.mask_token_id) == (4, 97)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, drafters[0](IDS).logits)
    assert main(["export", str(sharded), str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["block_size"], exported["mask_token_id"]) == (4, 97)
    assert exported["dflash_config"]["target_layer_ids"] == [1, 2]  # the rest of the block comes along


def test_a_checkpoint_without_drafter_keys_needs_the_flags(sharded, tmp_path, capsys):
    edit_config(sharded, lambda c: (c.pop("block_size"), c.pop("mask_token_id")))
    # The command line: a usage error naming both flags (as for a target passed as the drafter).
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded)])
    assert code == 2 and "is not a block-diffusion drafter" in line
    assert "--block-size and --mask-token-id" in line
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded), "--block-size", "4"])
    assert code == 2 and "no mask_token_id" in line and "pass --mask-token-id" in line
    assert main(["validate", "--drafter", str(sharded), "--block-size", "4", "--mask-token-id", "97",
                 "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["block_size"], summary["mask_token_id"]) == (4, 97)
    assert main(["export", str(sharded), str(tmp_path / "out"), "--block-size", "4", "--mask-token-id", "97"]) == 0
    capsys.readouterr()
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["block_size"], exported["mask_token_id"]) == (4, 97)  # the export describes itself
    # Python: the same keys, and an error naming the flag when one is missing.
    assert load_drafter(sharded, drafter_keys={"block_size": 4, "mask_token_id": 97}).config.block_size == 4
    with pytest.raises(ConfigError, match="missing key 'mask_token_id'.*--mask-token-id"):
        validate_checkpoint(sharded, {"block_size": 4})


def test_a_flag_fills_a_missing_key_and_never_overrides_one(sharded, capsys):
    edit_config(sharded, nest)
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded), "--mask-token-id", "5"])
    assert code == 1 and "dflash_config.mask_token_id = 97" in line and "drop --mask-token-id" in line
    assert main(["validate", "--drafter", str(sharded), "--mask-token-id", "97"]) == 0
    capsys.readouterr()
    edit_config(sharded, lambda c: c.update(mask_token_id=96))
    code, line = outcome(capsys, ["validate", "--drafter", str(sharded)])
    assert code == 1 and "mask_token_id = 96, dflash_config.mask_token_id = 97 disagree" in line


def test_bench_block_size_fills_a_missing_block_size_and_otherwise_caps_the_verify_width(sharded, drafters):
    from prune.cli import build_parser
    from prune.commands._checkpoint_args import drafter_keys

    lacking = sharded
    edit_config(lacking, lambda c: c.pop("block_size"))
    args = build_parser().parse_args(["bench", "--drafter", str(lacking), "--drafter", str(drafters[2]),
                                      "--block-size", "3"])
    assert drafter_keys(args, lacking) == {"block_size": 3}
    assert drafter_keys(args, drafters[2]) == {}  # its own block_size stays; --block-size caps the verify width
    score = build_parser().parse_args(["score", "--drafter", str(lacking), "--block-size", "3"])
    assert drafter_keys(score, drafters[2]) == {"block_size": 3}  # score's flag only fills: refused there
    with pytest.raises(ConfigError, match="has block_size = 4, but 3 is given .--block-size.; drop --block-size"):
        validate_checkpoint(drafters[2], drafter_keys(score, drafters[2]))


# ----------------------------------------------------------------------------------------------------
# prune run on a sharded drafter: sharded steps, resumed after a kill
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    target = tiny_target()
    target.config.eos_token_id = 3
    target.save_pretrained(root / "target")
    save_drafter(build_tiny_drafter(num_hidden_layers=3), root / "drafter", max_shard_size=SHARD)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": prompt_ids(4 + i, seed=i)})
                                                + "\n" for i in range(3)))
    return root


def run_args(pair, out, *extra):
    return ["run", "--drafter", str(pair / "drafter"), "--target", str(pair / "target"), "--prompts",
            str(pair / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(out), "--layers-to-remove", "2",
            "--min-retention", "0.01", "--no-stop-on-speedup", "--heal-steps", "0", "--speed-prompts", "0",
            "--no-wandb", "--cache-dir", str(pair / "cache"), "--max-shard-size", "30KB", *extra]


def test_prune_run_on_a_sharded_drafter_writes_sharded_steps_and_resumes_after_a_kill(pair, tmp_path, monkeypatch):
    assert main(run_args(pair, tmp_path / "full")) == 0
    state = json.loads((tmp_path / "full" / "state.json").read_text())
    assert [h["layers"] for h in state["history"]] == [2, 1]
    for step in ("step-01", "step-02"):
        assert len(shard_names(tmp_path / "full" / step)) >= 2 and verify_export(tmp_path / "full" / step) == []

    resumed = tmp_path / "resumed"
    with export_interrupted_at(monkeypatch, 2):
        assert main(run_args(pair, resumed)) == 130  # killed while step 2 was written
    assert (resumed / "step-01").is_dir() and not (resumed / "step-02").exists()
    assert main(run_args(pair, resumed, "--resume")) == 0  # continues from the sharded step 1
    ours = json.loads((resumed / "state.json").read_text())
    assert [h["removed_original"] for h in ours["history"]] == [h["removed_original"] for h in state["history"]]
    a, b = stored_tensors(tmp_path / "full" / "final"), stored_tensors(resumed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
