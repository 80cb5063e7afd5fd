"""Checkpoint folders: atomic writing, strict safetensors validation, hashing.

A checkpoint folder is written to a temporary sibling (same parent, so the final rename is atomic on
one file system) and renamed into place only when complete: a killed save leaves at most a hidden
`.NAME.partial-*` folder, never a half-written folder under the real name. Loading reads safetensors
only (never pickle) and never needs `trust_remote_code`.
"""

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def ensure_writable_output(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse an existing non-empty output folder unless `overwrite`; return the resolved path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"output {path} exists and is not a folder; choose another output path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(
            f"output folder {path} exists and is not empty; choose another output path or pass --overwrite"
        )
    return path


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder that replaces `path` only if the block completes without error.

    The temporary folder sits in the same parent as `path`. On any exception (or KeyboardInterrupt) it
    is removed and `path` is left exactly as it was.
    """
    path = ensure_writable_output(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; an export should get the usual permissions
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            # Move the old folder aside first so that `path` is never missing a complete version for long.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def read_config_json(folder: str | os.PathLike) -> dict:
    """Read `config.json` of a checkpoint folder, with clear errors for a missing folder or bad JSON."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist; pass the path of a model folder")
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; it is not a transformers checkpoint folder")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def read_safetensors_shapes(file: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Return `{tensor name: shape}` from a safetensors header, raising CheckpointError if it is corrupt."""
    from safetensors import safe_open

    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file.parent} has no {file.name}; only safetensors checkpoints are supported")
    try:
        with safe_open(str(file), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        # The header can be intact while the data is truncated: check that the sizes add up.
        check_data_length(file)
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises several error types for damaged files
        raise CheckpointError(f"{file} is not a valid safetensors file ({exc}); re-export or re-download it") from None
    return shapes


def check_data_length(file: Path) -> None:
    with open(file, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
    actual = file.stat().st_size - 8 - header_len
    if actual != end:
        raise CheckpointError(
            f"{file} is truncated or padded ({actual} data bytes, header says {end}); re-export or re-download it"
        )


def sha256_file(file: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def folder_hashes(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file in `folder` (recursive), keyed by relative path, sorted."""
    folder = Path(folder)
    return {
        str(file.relative_to(folder)): sha256_file(file)
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


def copy_tokenizer_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files that exist in `source` into `destination`; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        file = Path(source) / name
        if file.is_file():
            shutil.copy2(file, Path(destination) / name)
            copied.append(name)
    return copied
