"""Checkpoint folders and files: atomic writing, strict safetensors validation, hashing.

A checkpoint folder (`atomic_folder`) or a single file (`atomic_file`, the one atomic file writer of
the tool) is written to a temporary sibling (same parent, so the final rename is atomic on one file
system) and renamed into place only when complete: a killed save leaves at most a hidden
`.NAME.partial-*` entry, never a half-written one under the real name (`remove_partials` clears them), and
a full disk is one DiskFullError naming the path and the fix. What is renamed into place has
the permissions the user's umask gives a new file or folder, whichever temporary-file mechanism wrote
it (mkstemp, and libraries that write through it, make 0600 files). Loading reads safetensors only
(never pickle) and never needs `trust_remote_code`; where a folder keeps its weight files (one file or
shards) is models/shards.py.
"""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CheckpointError, DiskFullError
from .faults import fault_point

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
# safetensors dtype codes of floating-point tensors -> torch dtype names
SAFETENSORS_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


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
def write_errors_named(path: str | os.PathLike):
    """Within the block, the OSErrors of writing become one-line errors naming `path` and the fix: a full disk
    or quota (ENOSPC, EDQUOT) a DiskFullError, a refused write (EACCES, EPERM, EROFS) a CheckpointError.
    Every atomic write goes through here, so the translation lives in one place."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"disk full while writing {path} ({exc.strerror}); what was saved before is intact: free disk "
                "space, then rerun the same command (prune run: with --resume) to continue"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CheckpointError(f"cannot write {path} ({exc.strerror}); choose an output folder you can write to")
        raise


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder that replaces `path` only if the block completes without error.

    The temporary folder sits in the same parent as `path`. On any exception (or KeyboardInterrupt) it
    is removed and `path` is left exactly as it was; a full disk raises DiskFullError (write_errors_named).
    """
    with write_errors_named(path):
        path = ensure_writable_output(path, overwrite)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
        try:
            yield tmp
            _commit_folder(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _commit_folder(tmp: Path, path: Path) -> None:
    """Rename the complete temporary folder `tmp` into place as `path` (see atomic_folder)."""
    make_readable(tmp)
    _fsync_tree(tmp)
    fault_point(f"write:{path.name}")
    if path.exists():
        # Move the old folder aside first so that `path` is never missing a complete version for long.
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, old / path.name)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary file path that replaces file `path` only if the block completes without error.

    The block writes the temporary file (it exists, empty, next to `path`); the file is then given the
    umask's permissions, flushed to disk and renamed over `path`. On any exception it is removed and
    `path` is left as it was; a full disk raises DiskFullError (write_errors_named). Temporary names are
    unique, so concurrent writers of one path never mix.
    """
    path = Path(path)
    with write_errors_named(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
        os.close(handle)
        tmp = Path(name)
        try:
            yield tmp
            make_readable(tmp)
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
            fault_point(f"write:{path.name}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (see atomic_file)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def atomic_symlink(path: str | os.PathLike, target: str) -> None:
    """Make `path` a symbolic link to `target` (relative to its folder), replacing what was there in one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with write_errors_named(path):
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, path)


def remove_partials(path: str | os.PathLike) -> list[Path]:
    """Remove what killed atomic writes of `path` left behind; returns the entries removed.

    That is `.NAME.partial-*` and `.NAME.old-*` beside `path` and, when `path` is a folder, every `.*.partial-*`
    and `.*.old-*` inside it. A live writer's temporary entries look the same: call this only while holding
    the output's lock (models.lock.output_lock).
    """
    path = Path(path)
    found = [*path.parent.glob(f".{path.name}.partial-*"), *path.parent.glob(f".{path.name}.old-*")]
    if path.is_dir():
        found += [*path.glob(".*.partial-*"), *path.glob(".*.old-*")]
    for entry in found:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return found


def current_umask() -> int:
    """The process umask, e.g. 0o022.

    os.umask can only be read by setting it, and while it is set another thread may create a file with
    the wrong mode; Linux reports it in /proc/self/status without changing it, so read that first.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # the strictest value, for the instant it is set
    os.umask(umask)
    return umask


def make_readable(path: str | os.PathLike) -> None:
    """Give `path` (and, for a folder, everything in it) the permissions the umask gives new entries.

    Files get 0o666 & ~umask and folders 0o777 & ~umask (0644 and 0755 under the usual umask 0022):
    temporary files and folders are created owner-only, while an export or a shared cache is read by
    teammates and serving processes. Symbolic links are left alone (chmod would follow them).
    """
    umask = current_umask()
    path = Path(path)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


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


def safetensors_header(file: Path) -> tuple[int, dict]:
    """The header of a safetensors file: its length in bytes and {tensor name: {dtype, shape, data_offsets}}."""
    with open(file, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        return header_len, json.loads(handle.read(header_len))


def check_data_length(file: Path) -> None:
    header_len, header = safetensors_header(file)
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
