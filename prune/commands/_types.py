"""Argument types of the `prune` commands: each checks one flag's text and converts it, or rejects it.

Used as argparse `type=`: a rejected value is a usage error (exit 2) whose one line names the value to give
instead, before anything is loaded. Checks that need a model (a layer budget against the drafter's layers)
are not here; the commands make them from the drafter's config.json before loading weights. Nothing here
imports torch, so `--help` stays fast.
"""

import argparse
import codecs
import json
import math
import re
from pathlib import Path

from models.drafter_config import KEY_BLOCKS, MAX_BLOCK_SIZE, REQUIRED_KEYS, missing_keys

CONFIG_NAME = "config.json"
DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")
_SNIFF_BYTES = 1 << 16  # how much of a text file is read to see that it is readable UTF-8 text


def _reject(message: str):
    raise argparse.ArgumentTypeError(message)


def _bounded(convert, what: str, low=None, high=None, low_open: bool = False):
    """A type accepting `convert(text)` within [low, high] ((low, high] if `low_open`); `what` names it."""

    def check(text: str):
        try:
            value = convert(text)
        except ValueError:
            _reject(f"got {text!r}; give {what}")
        if isinstance(value, float) and not math.isfinite(value):
            _reject(f"got {text!r}; give {what}")
        below = low is not None and (value <= low if low_open else value < low)
        if below or (high is not None and value > high):
            _reject(f"got {text}; give {what}")
        return value

    check.__name__ = what
    return check


positive_int = _bounded(int, "an integer >= 1", low=1)
non_negative_int = _bounded(int, "an integer >= 0", low=0)
positive_float = _bounded(float, "a number > 0", low=0, low_open=True)
non_negative_float = _bounded(float, "a number >= 0", low=0)
positive_fraction = _bounded(float, "a fraction in (0, 1]", low=0, high=1, low_open=True)
fraction = _bounded(float, "a fraction in [0, 1]", low=0, high=1)


def _distinct_ints(text: str, what: str, low: int, example: str) -> tuple[int, ...]:
    """Distinct integers >= `low` separated by commas, in the given order; a usage error naming `what`."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        _reject(f"got {text!r}; give {what} separated by commas, e.g. {example}")
    if min(values) < low or len(set(values)) != len(values):
        _reject(f"got {text}; give distinct {what} >= {low}" + (", e.g. " + example if low == 0 else ""))
    return values


def sizes(text: str) -> tuple[int, ...]:
    """Distinct positive sizes separated by commas ("8192,4096"), largest first."""
    return tuple(sorted(_distinct_ints(text, "sizes", 1, "8192,4096"), reverse=True))


def layer_indices(text: str) -> tuple[int, ...]:
    """Distinct 0-based layer indices separated by commas ("3,2,8")."""
    return _distinct_ints(text, "layer indices", 0, "3,2,8")


def block_size(text: str) -> int:
    """Tokens of a draft block: 2..models.drafter_config.MAX_BLOCK_SIZE."""
    return _bounded(int, f"an integer in 2..{MAX_BLOCK_SIZE}", low=2, high=MAX_BLOCK_SIZE)(text)


def size(text: str) -> int:
    """Bytes: an integer, or a number with a unit ("80MB", "5GB", "1GiB"; models.shards.parse_size)."""
    from models.errors import ConfigError
    from models.shards import parse_size

    try:
        return parse_size(text)
    except ConfigError:
        _reject(f"got {text!r}; give a size such as 80MB, 5GB or 1GiB")


def name(text: str) -> str:
    """A non-empty name (study, W&B entity, project or workspace)."""
    if not text.strip():
        _reject("got an empty name; give a non-empty one")
    return text


def device(text: str) -> str:
    """A torch device: cpu, cuda, cuda:N (also mps, xpu); checked against the machine when it is used."""
    if not DEVICE.fullmatch(text):
        _reject(f"got {text!r}; give cpu, cuda or cuda:N")
    return text


def device_or_auto(text: str) -> str:
    return text if text == "auto" else device(text)


def _folder(text: str) -> Path:
    """An existing folder."""
    path = Path(text)
    if not path.exists():
        _reject(f"folder {text} does not exist; give an existing folder")
    if not path.is_dir():
        _reject(f"{text} is a file, not a folder; give a folder")
    return path


def text_file(text: str) -> str:
    """An existing, readable, non-empty UTF-8 text file (JSONL prompts, TOML spaces, saved outputs)."""
    path = Path(text)
    if path.is_dir():
        _reject(f"{text} is a folder; give a file")
    try:
        with open(path, "rb") as handle:
            head = handle.read(_SNIFF_BYTES)
    except FileNotFoundError:
        _reject(f"file {text} does not exist; give an existing file")
    except OSError as exc:
        _reject(f"cannot read {text} ({exc.strerror or exc}); give a readable file")
    try:
        decoded = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        _reject(f"{text} is not UTF-8 text; give a text file")
    if not decoded.strip():
        _reject(f"{text} is empty; give a file with content")
    return text


def output_file(text: str) -> str:
    """Where a file will be written ('-' = stdout): not a folder, and no part of its parent path is a file."""
    if text == "-":
        return text
    path = Path(text)
    if path.is_dir():
        _reject(f"{text} is a folder; give a file path")
    _no_file_above(path, text)
    return text


def output_dir(text: str) -> str:
    """Where a folder will be written: not an existing file, and no part of its parent path is a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        _reject(f"{text} is a file; give a folder path")
    _no_file_above(path, text)
    return text


def _no_file_above(path: Path, text: str) -> None:
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                _reject(f"{parent} is a file, so {text} cannot be created; give another path")
            return


def _config_of(path: Path, text: str) -> dict:
    """The config.json of a model folder (a usage error when it is missing or not JSON)."""
    file = path / CONFIG_NAME
    if not file.is_file():
        _reject(f"{text} has no {CONFIG_NAME}; give a model checkpoint folder")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _reject(f"cannot read {file} ({exc}); give a checkpoint folder with a valid {CONFIG_NAME}")
    if not isinstance(config, dict):
        _reject(f"{file} is not a JSON object; give a checkpoint folder with a valid {CONFIG_NAME}")
    return config


def _is_drafter(config: dict) -> bool:
    return not missing_keys(config)


def drafter_dir(text: str) -> str:
    """A drafter folder: a model folder whose config.json carries block_size and mask_token_id (a target's does
    not), at one of the places of models.drafter_config.KEY_BLOCKS, or whose missing keys the command's
    --block-size / --mask-token-id give: that is checked once every flag is read (`drafter_key_problem`)."""
    _config_of(_folder(text), text)
    return text


def drafter_key_problem(text: str, given: dict, flags: dict) -> str | None:
    """Why drafter folder `text` is no drafter, or None: a drafter key its config.json lacks and `given`
    ({key: value}, from the command's flags) does not give; `flags` ({key: flag}) are the command's flags."""
    lacking = [key for key in missing_keys(_config_of(Path(text), text)) if key not in given]
    if not lacking:
        return None
    blocks = " or ".join(block for block in KEY_BLOCKS if block)
    fix = "give a drafter folder, and a target as --target"
    if all(key in flags for key in lacking):
        fix += f"; or pass {' and '.join(flags[key] for key in lacking)} for a drafter whose {CONFIG_NAME} lacks them"
    return (f"{text} is not a block-diffusion drafter (its {CONFIG_NAME} has no {' / '.join(lacking)}, at the top "
            f"level or in {blocks}; a target model?); {fix}")


def model_path(text: str) -> str:
    """A causal LM: a folder with config.json, or a .gguf file."""
    _model_config(text)
    return text


def _model_config(text: str) -> dict:
    """The config.json of model folder `text` ({} for a .gguf file)."""
    path = Path(text)
    if path.is_file():
        if path.suffix != ".gguf":
            _reject(f"{text} is a file but not a .gguf; give a model folder or a .gguf file")
        return {}
    return _config_of(_folder(text), text)


def target_path(text: str) -> str:
    """A target model: a folder with config.json that is not a drafter's, or a .gguf file."""
    if _is_drafter(_model_config(text)):
        _reject(f"{text} is a block-diffusion drafter (its {CONFIG_NAME} has {' and '.join(REQUIRED_KEYS)}); "
                "pass it as --drafter and the target model as --target")
    return text


def data_dir(text: str) -> str:
    """A distillation data folder written by `prune distill` (it holds manifest.json)."""
    from prune.training.data import MANIFEST

    if not (_folder(text) / MANIFEST).is_file():
        _reject(f"{text} holds no distillation data (no {MANIFEST}); give a folder written by prune distill")
    return text


def vocab_source(text: str) -> str:
    """What a draft vocabulary is counted from: a distillation data folder, or a --save-outputs JSONL file."""
    return data_dir(text) if Path(text).is_dir() else text_file(text)


def suite(text: str) -> str:
    """A built-in prompt suite, NAME or NAME:train / NAME:calib / NAME:eval, or a mix of them joined by "+"."""
    from decode.suites import parse_mix
    from models.errors import DataError

    try:
        parse_mix(text)
    except DataError as exc:
        _reject(str(exc))
    return text


def suite_or_prompt_file(text: str) -> str:
    """A built-in prompt suite, or a JSONL prompt file (a name ending in .jsonl)."""
    return text_file(text) if text.endswith(".jsonl") else suite(text)
