"""Where a checkpoint folder keeps its weights: one `model.safetensors`, or the hub's sharded layout,
`model-0000i-of-0000N.safetensors` files listed by `model.safetensors.index.json` (its `weight_map`:
{tensor name: file}, and `metadata.total_size`), as `save_pretrained(max_shard_size=...)` writes it.

This module is the one place that knows the layout: the weight files of a folder, its weight map, the
tensor names and shapes across every file (each file's header and data length checked, and the index
against what each shard holds), the dtype stored, the bytes on disk. It reads headers only, never tensor
data, and imports no torch. Writing goes through transformers' `save_pretrained` (models.drafter.save_drafter),
which shards a checkpoint above `max_shard_size` and names the files as the hub does.
"""

import hashlib
import json
import math
import os
import re
from pathlib import Path

from .checkpoint import (SAFETENSORS_FLOAT_DTYPES, WEIGHTS_NAME, read_safetensors_shapes, safetensors_header,
                         sha256_file)
from .errors import CheckpointError, ConfigError

INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # the hub's customary shard size (transformers' default before v5)
# Units of a size such as "80MB" (decimal, as transformers reads them) or "1GiB" (binary), in bytes.
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes of a size: an integer, or a number with a unit ("80MB", "5GB", "1.5GiB"), at least 1."""
    match = None if isinstance(text, int) else _SIZE.fullmatch(str(text))
    size = text if isinstance(text, int) else match and int(float(match[1]) * SIZE_UNITS[(match[2] or "B").upper()])
    if not size or size < 1:
        raise ConfigError(f"max shard size {text!r} is not a size; give bytes or a number with a unit, e.g. 80MB "
                          "or 5GB (--max-shard-size)")
    return size


def is_sharded(folder: str | os.PathLike) -> bool:
    return (Path(folder) / INDEX_NAME).is_file()


def read_index(folder: str | os.PathLike) -> dict[str, str]:
    """The weight map of a sharded folder's index, {tensor name: shard file name}, checked to be a JSON
    object of plain file names in the folder."""
    file = Path(folder) / INDEX_NAME
    try:
        index = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not a readable JSON index ({exc}); re-export or re-download it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{file} has no weight_map of tensor names to shard files; re-export or re-download it")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(f"{file} maps {name} to {shard!r}, not a .safetensors file of this folder; "
                                  "re-export or re-download it")
    return weight_map


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint folder: [model.safetensors], or the shards its index names (sorted).

    Raises CheckpointError naming the file for a folder with no weights, with both layouts, a shard the index
    names that is missing, or a shard file of the hub's naming that the index does not name (an extra shard)."""
    folder = Path(folder)
    single, sharded = (folder / WEIGHTS_NAME).is_file(), is_sharded(folder)
    if single and sharded:
        raise CheckpointError(f"{folder} holds both {WEIGHTS_NAME} and {INDEX_NAME}; keep one layout (delete the "
                              "other) so that every tool loads the same weights")
    if not sharded:
        if not single:
            raise CheckpointError(f"{folder} has no {WEIGHTS_NAME} or {INDEX_NAME}; only safetensors checkpoints "
                                  "are supported")
        return [folder / WEIGHTS_NAME]
    named = sorted(set(read_index(folder).values()))
    missing = [name for name in named if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder}/{missing[0]}, a shard {INDEX_NAME} names, is missing"
                              f"{f' ({len(missing)} shards are)' if len(missing) > 1 else ''}; re-download or "
                              "re-export the checkpoint")
    extra = sorted(p.name for p in folder.iterdir() if SHARD_NAME.fullmatch(p.name) and p.name not in named)
    if extra:
        raise CheckpointError(f"{folder}/{extra[0]} is a shard that {INDEX_NAME} does not name; delete it, or "
                              "restore the index it belongs to")
    return [folder / name for name in named]


def read_weights(folder: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], Path]]:
    """{tensor name: (shape, the file holding it)} of everything a folder's weight files hold, from their headers.

    Every file's header and data length are checked (read_safetensors_shapes), and for a sharded folder the
    index against the shards: a tensor the index maps to a shard that does not hold it, a tensor a shard
    holds that the index maps elsewhere or not at all, a tensor in two shards. Each error names the file."""
    folder = Path(folder)
    files = weight_files(folder)
    weight_map = read_index(folder) if is_sharded(folder) else None
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in files:
        for name, shape in read_safetensors_shapes(file).items():
            if name in found:
                raise CheckpointError(f"{file} and {found[name][1]} both hold tensor {name}; re-export or "
                                      "re-download the checkpoint")
            if weight_map is not None and weight_map.get(name) != file.name:
                raise CheckpointError(f"{file} holds tensor {name}, which {INDEX_NAME} maps to "
                                      f"{weight_map.get(name) or 'no shard'}; re-export or re-download the checkpoint")
            found[name] = (shape, file)
    if weight_map is not None:
        absent = [name for name in weight_map if name not in found]
        if absent:
            raise CheckpointError(f"{folder}/{weight_map[absent[0]]} does not hold tensor {absent[0]}, which "
                                  f"{INDEX_NAME} maps to it ({len(absent)} such tensors); re-export or re-download "
                                  "the checkpoint")
    return found


def weights_label(folder: str | os.PathLike) -> str:
    """How errors name a folder's weights: its model.safetensors, or its index of shards."""
    return f"{folder}/{INDEX_NAME if is_sharded(folder) else WEIGHTS_NAME}"


def weights_sha256(folder: str | os.PathLike) -> str | None:
    """One sha256 of a folder's weights: that of its model.safetensors, or, sharded, of the lines
    "NAME SHA256" of its shards in order (the index's layout is checked by `weight_files`); None where the
    folder holds no safetensors weights (a .gguf target, say)."""
    folder = Path(folder)
    if not folder.is_dir() or not ((folder / WEIGHTS_NAME).is_file() or is_sharded(folder)):
        return None
    files = weight_files(folder)
    if not is_sharded(folder):
        return sha256_file(files[0])
    lines = "".join(f"{file.name} {sha256_file(file)}\n" for file in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def weights_bytes(folder: str | os.PathLike) -> int:
    """Bytes of a folder's weight files on disk."""
    return sum(file.stat().st_size for file in weight_files(folder))


def stored_dtype(folder: str | os.PathLike) -> str:
    """The floating-point dtype a checkpoint's weights are stored in, as a torch name ("bfloat16", ...).

    Read from the safetensors headers, i.e. what is on disk whatever config.json says; when tensors differ
    (e.g. float32 norms in a bfloat16 model), the dtype holding the most elements.
    """
    elements: dict[str, int] = {}
    for file in weight_files(folder):
        try:
            header = safetensors_header(file)[1]
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file} is not a valid safetensors file ({exc}); re-export or re-download "
                                  "it") from None
        for name, meta in header.items():
            if name != "__metadata__" and meta["dtype"] in SAFETENSORS_FLOAT_DTYPES:
                dtype = SAFETENSORS_FLOAT_DTYPES[meta["dtype"]]
                elements[dtype] = elements.get(dtype, 0) + math.prod(meta["shape"])
    if not elements:
        raise CheckpointError(f"{folder} holds no floating-point tensor; it is not a model checkpoint")
    return max(elements, key=elements.get)
