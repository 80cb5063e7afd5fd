"""Checkpoint I/O: atomic saves, loading, validation, and clear errors for bad input (docs/design.md)."""

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from models.checkpoint import atomic_folder, folder_hashes
from models.drafter import load_drafter, save_drafter, validate_checkpoint
from models.errors import CheckpointError, CompatibilityError, ConfigError, D3DError
from models.target import check_pair

REPO = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89]])


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def raises_clearly(error_type, call, *words):
    """Run `call`, expect `error_type` (a D3DError) with a one-line message containing every word."""
    assert issubclass(error_type, D3DError)
    with pytest.raises(error_type) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, f"multi-line message: {message!r}"
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def hidden_entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def saved_names(folder: Path) -> list[str]:
    """Files of a saved folder, less the generation_config.json that save_pretrained may add."""
    return sorted(p.name for p in folder.iterdir() if p.name != "generation_config.json")


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


# ----------------------------------------------------------------------------------------------------
# Round trip
# ----------------------------------------------------------------------------------------------------


def test_load_valid_folder(saved_tiny_drafter):
    model, folder = saved_tiny_drafter
    config = validate_checkpoint(folder)
    assert (config.block_size, config.mask_token_id, config.num_hidden_layers) == (4, 97, 2)
    loaded = load_drafter(folder)
    assert not loaded.training
    assert loaded.config._attn_implementation == "sdpa"
    assert (loaded.config.block_size, loaded.config.mask_token_id, loaded.config.draft_vocab_size) == (4, 97, 97)
    assert loaded.config.original_layer_indices == [0, 1]
    assert next(loaded.parameters()).dtype == torch.float32
    assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    assert saved_names(folder) == ["config.json", "model.safetensors"]
    assert hidden_entries(folder.parent) == []


def test_save_options_dtype_tokenizer_and_extra_files(make_tiny_drafter, tmp_path):
    model = make_tiny_drafter()
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (source / "unrelated.bin").write_text("x")
    folder = save_drafter(
        model, tmp_path / "out", tokenizer_source=source, dtype=torch.bfloat16, extra_files={"NOTES.md": "hello"}
    )
    assert saved_names(folder) == ["NOTES.md", "config.json", "model.safetensors", "tokenizer_config.json"]
    assert (folder / "NOTES.md").read_text() == "hello"
    assert next(model.parameters()).dtype == torch.float32  # the in-memory model keeps its dtype
    stored = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert torch.equal(stored["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------------
# Bad folders and configs
# ----------------------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    missing = tmp_path / "no-such-drafter"
    raises_clearly(CheckpointError, lambda: load_drafter(missing), str(missing), "does not exist")
    raises_clearly(CheckpointError, lambda: validate_checkpoint(missing), "does not exist")


def test_folder_without_config_or_weights(saved_tiny_drafter):
    _, folder = saved_tiny_drafter
    (folder / "model.safetensors").unlink()
    raises_clearly(CheckpointError, lambda: load_drafter(folder), "model.safetensors", "safetensors")
    (folder / "config.json").unlink()
    raises_clearly(CheckpointError, lambda: load_drafter(folder), "config.json")


def test_config_not_json(saved_tiny_drafter):
    _, folder = saved_tiny_drafter
    (folder / "config.json").write_text('{"model_type": "qwen3",\n "block_size": ')
    raises_clearly(CheckpointError, lambda: load_drafter(folder), "config.json", "not valid JSON")


@pytest.mark.parametrize("key", ["block_size", "mask_token_id"])
def test_missing_config_key(saved_tiny_drafter, key):
    _, folder = saved_tiny_drafter
    edit_config(folder, lambda c: c.pop(key))
    raises_clearly(ConfigError, lambda: load_drafter(folder), "config.json", "missing", key)
    raises_clearly(ConfigError, lambda: validate_checkpoint(folder), key)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda c: c.update(block_size=1), ["block_size", "1"]),
        (lambda c: c.update(mask_token_id=99), ["mask_token_id", "99"]),
        (lambda c: c.update(model_type="llama"), ["model_type", "llama"]),
        (lambda c: c.update(layer_types=["full_attention"] * 3), ["layer_types", "3", "num_hidden_layers"]),
        (lambda c: c.update(original_layer_indices=[4, 2]), ["original_layer_indices"]),
    ],
    ids=["block_size", "mask_id", "model_type", "layer_types", "provenance"],
)
def test_invalid_config_values(saved_tiny_drafter, edit, words):
    _, folder = saved_tiny_drafter
    edit_config(folder, edit)
    raises_clearly(ConfigError, lambda: validate_checkpoint(folder), *words)


# ----------------------------------------------------------------------------------------------------
# Damaged safetensors
# ----------------------------------------------------------------------------------------------------


def truncate(keep):
    def damage(file: Path):
        data = file.read_bytes()
        file.write_bytes(data[: keep(len(data))])

    return damage


def overwrite(offset, garbage):
    def damage(file: Path):
        data = bytearray(file.read_bytes())
        data[offset : offset + len(garbage)] = garbage
        file.write_bytes(bytes(data))

    return damage


@pytest.mark.parametrize(
    "damage",
    [
        truncate(lambda n: n - 1),
        truncate(lambda n: n // 2),
        truncate(lambda n: 200),  # inside the JSON header
        truncate(lambda n: 5),  # not even the header length
        truncate(lambda n: 0),
        overwrite(0, b"\xff\x13\x9a\x00garbage"),  # the header length
        overwrite(8, b"\x00\x01 this is not json }{"),  # the header itself
        lambda f: f.write_bytes(f.read_bytes() + b"\x00" * 16),  # padded
    ],
    ids=["minus-1", "half", "in-header", "5-bytes", "empty", "header-length", "header-json", "padded"],
)
def test_damaged_safetensors(saved_tiny_drafter, damage):
    _, folder = saved_tiny_drafter
    damage(folder / "model.safetensors")
    message = raises_clearly(CheckpointError, lambda: validate_checkpoint(folder), "model.safetensors")
    assert any(word in message for word in ("truncated", "not a valid safetensors")), message
    raises_clearly(CheckpointError, lambda: load_drafter(folder), "model.safetensors")


# ----------------------------------------------------------------------------------------------------
# Tensor names and shapes
# ----------------------------------------------------------------------------------------------------


def rewrite_weights(folder: Path, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_wrong_tensor_shape(saved_tiny_drafter):
    _, folder = saved_tiny_drafter
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(folder, lambda t: t.update({name: torch.zeros(36, 32)}))
    raises_clearly(CheckpointError, lambda: validate_checkpoint(folder), name, "[36, 32]", "[37, 32]")
    raises_clearly(CheckpointError, lambda: load_drafter(folder), name)


def test_missing_tensor(saved_tiny_drafter):
    _, folder = saved_tiny_drafter
    name = "model.layers.0.self_attn.k_norm.weight"
    rewrite_weights(folder, lambda t: t.pop(name))
    raises_clearly(CheckpointError, lambda: validate_checkpoint(folder), "missing", name)


def test_unexpected_tensor(saved_tiny_drafter):
    _, folder = saved_tiny_drafter
    name = "model.layers.2.mlp.up_proj.weight"  # a tensor of a layer the config does not have
    rewrite_weights(folder, lambda t: t.update({name: torch.zeros(37, 32)}))
    raises_clearly(CheckpointError, lambda: validate_checkpoint(folder), "unexpected", name)


def test_config_with_fewer_layers_than_the_file(saved_tiny_drafter):
    # The layer-surgery pitfall in reverse: layers dropped from the config but left in the file.
    _, folder = saved_tiny_drafter

    def drop_layer(config):
        config.update(num_hidden_layers=1, layer_types=["full_attention"], original_layer_indices=[0])

    edit_config(folder, drop_layer)
    message = raises_clearly(CheckpointError, lambda: validate_checkpoint(folder), "unexpected", "model.layers.1.")
    assert "more" in message  # 11 tensors, the first three are named


# ----------------------------------------------------------------------------------------------------
# Drafter / target pairing
# ----------------------------------------------------------------------------------------------------


def target_config(vocab_size):
    return Qwen3Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=37)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)


def test_check_pair_accepts_a_matching_target(make_tiny_drafter):
    drafter = make_tiny_drafter()  # 97 real ids, mask 97, padding 98
    check_pair(drafter.config, target_config(97))
    # a target whose embedding is padded beyond its tokenizer
    vocab = {f"t{i}": i for i in range(97)}
    check_pair(drafter.config, target_config(128), FakeTokenizer(vocab), FakeTokenizer(vocab))


def test_check_pair_vocabulary_mismatch(make_tiny_drafter):
    drafter = make_tiny_drafter()
    raises_clearly(CompatibilityError, lambda: check_pair(drafter.config, target_config(200)), "vocabulary", "200")
    # the drafter proposes ids the target does not have
    wide = make_tiny_drafter(draft_vocab_size=99, mask_token_id=98)
    raises_clearly(CompatibilityError, lambda: check_pair(wide.config, target_config(90)), "vocabulary")


def test_check_pair_mask_id_is_a_real_target_token(make_tiny_drafter):
    drafter = make_tiny_drafter()
    raises_clearly(
        CompatibilityError, lambda: check_pair(drafter.config, target_config(98)), "mask_token_id", "97", "real"
    )
    vocab = {f"t{i}": i for i in range(98)}
    raises_clearly(
        CompatibilityError,
        lambda: check_pair(drafter.config, target_config(128), FakeTokenizer(vocab), FakeTokenizer(vocab)),
        "mask_token_id",
    )


def test_check_pair_tokenizer_mismatch(make_tiny_drafter):
    drafter = make_tiny_drafter()
    target_vocab = {f"t{i}": i for i in range(97)}
    drafter_vocab = dict(target_vocab, t5=6, t6=5)
    raises_clearly(
        CompatibilityError,
        lambda: check_pair(drafter.config, target_config(97), FakeTokenizer(drafter_vocab), FakeTokenizer(target_vocab)),
        "tokenizer mismatch",
        "2 target tokens",
    )


# ----------------------------------------------------------------------------------------------------
# Output folders and atomic writes
# ----------------------------------------------------------------------------------------------------


def test_save_refuses_non_empty_folder(make_tiny_drafter, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = folder_hashes(out)
    raises_clearly(
        CheckpointError, lambda: save_drafter(make_tiny_drafter(), out), str(out), "not empty", "--overwrite"
    )
    assert folder_hashes(out) == before
    assert hidden_entries(tmp_path) == []


def test_save_refuses_a_file_in_the_way(make_tiny_drafter, tmp_path):
    out = tmp_path / "out"
    out.write_text("a file")
    raises_clearly(CheckpointError, lambda: save_drafter(make_tiny_drafter(), out, overwrite=True), "not a folder")
    assert out.read_text() == "a file"


def test_save_into_existing_empty_folder(make_tiny_drafter, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    save_drafter(make_tiny_drafter(), out)
    validate_checkpoint(out)


def test_save_with_overwrite_replaces(saved_tiny_drafter, make_tiny_drafter):
    old_model, folder = saved_tiny_drafter
    (folder / "stale.txt").write_text("from the old folder")
    new_model = make_tiny_drafter(seed=7)
    assert not torch.equal(new_model(IDS).logits, old_model(IDS).logits)
    save_drafter(new_model, folder, overwrite=True)
    assert saved_names(folder) == ["config.json", "model.safetensors"]  # stale.txt is gone
    assert torch.equal(load_drafter(folder)(IDS).logits, new_model(IDS).logits)
    assert hidden_entries(folder.parent) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_atomic_folder_cleans_up_on_error(tmp_path, error, existing):
    path = tmp_path / "ckpt"
    if existing:
        path.mkdir()
        (path / "config.json").write_text("{}")
        (path / "sub").mkdir()
        (path / "sub" / "x.txt").write_text("old")
    before = folder_hashes(path) if existing else None
    seen = {}
    with pytest.raises(type(error)):
        with atomic_folder(path, overwrite=True) as tmp:
            seen["tmp"] = tmp
            assert tmp.parent == path.parent and tmp.name.startswith(".ckpt.partial-")
            (tmp / "config.json").write_text('{"new": true}')
            raise error
    assert not seen["tmp"].exists()
    assert hidden_entries(tmp_path) == []
    if existing:
        assert folder_hashes(path) == before
    else:
        assert not path.exists()


def test_atomic_folder_success(tmp_path):
    path = tmp_path / "nested" / "ckpt"
    with atomic_folder(path) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not path.exists()
    assert (path / "a.txt").read_text() == "a"
    assert hidden_entries(path.parent) == []


KILLED_SAVE = textwrap.dedent(
    """
    import sys, threading, time
    from transformers import Qwen3ForCausalLM
    from models.drafter import create_drafter, save_drafter

    original_save = Qwen3ForCausalLM.save_pretrained
    lock = threading.Lock()

    def save_then_hang(self, path, *args, **kwargs):
        original_save(self, path, *args, **kwargs)
        with lock:
            sys.stdout.write(f"WRITTEN {path}\\n")
            sys.stdout.flush()
        time.sleep(300)

    Qwen3ForCausalLM.save_pretrained = save_then_hang
    model = create_drafter(vocab_size=99, mask_token_id=97, block_size=4, num_hidden_layers=2, hidden_size=32,
                           intermediate_size=37, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    threads = [threading.Thread(target=save_drafter, args=(model, target), kwargs=dict(overwrite=True))
               for target in sys.argv[1:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("RENAMED", flush=True)
    """
)


def test_killed_save_leaves_no_folder_under_the_name(tmp_path):
    # One subprocess saves to a new name and over an existing folder (two threads), and is SIGKILLed
    # once both are inside atomic_folder with their files written but not yet renamed.
    fresh, existing = tmp_path / "fresh" / "drafter", tmp_path / "existing" / "drafter"
    fresh.parent.mkdir()
    existing.mkdir(parents=True)
    (existing / "config.json").write_text('{"old": true}')
    before = folder_hashes(existing)

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_SAVE, str(fresh), str(existing)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        )
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        written = []
        while len(written) < 2:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail("the save subprocess did not reach the write in 60 s")
            assert line.startswith("WRITTEN"), f"unexpected output {line!r}: {stderr.read_text()[-2000:]}"
            written.append(Path(line.split(maxsplit=1)[1].strip()))
        for folder in written:
            assert folder.name.startswith(".drafter.partial-")
            assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        reader.join(timeout=10)  # EOF once the process is gone
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    # New name: nothing under the final name, only the hidden partial folder.
    assert not fresh.exists()
    leftovers = [p.name for p in fresh.parent.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".drafter.partial-"), leftovers
    # Existing name with overwrite: the old folder is untouched.
    assert folder_hashes(existing) == before
    others = [p.name for p in existing.parent.iterdir() if p.name != "drafter"]
    assert len(others) == 1 and others[0].startswith(".drafter.partial-"), others
