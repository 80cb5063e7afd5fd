"""Load a target model (a local transformers folder or a GGUF file) and check it against a drafter."""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import TOKENIZER_FILES, read_config_json
from .drafter_config import MAX_BLOCK_SIZE, draft_vocab_limit
from .errors import CheckpointError, CompatibilityError


def load_target(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load any causal LM from a local folder (safetensors) or a `.gguf` file, in eval mode.

    Only local files are read: a name that is not an existing path is an error, never a hub download.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"target {path} does not exist; pass a local model folder or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"target {path} is a file but not a .gguf file; pass a model folder or a .gguf file")
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
        )
    else:
        read_config_json(path)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, use_safetensors=True, local_files_only=True, trust_remote_code=False
        )
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model folder or GGUF file, or None when the folder carries no tokenizer files."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def check_pair(drafter_config, target_config, drafter_tokenizer=None, target_tokenizer=None) -> None:
    """Raise CompatibilityError unless the drafter can draft for the target.

    Checks: the drafter's proposable ids are target ids, the mask id is not a real target token, both
    tokenizers (when present) map every shared token to the same id, and the block size is sane.
    """
    target_vocab = target_config.vocab_size
    real_tokens = len(target_tokenizer) if target_tokenizer is not None else target_vocab
    limit = draft_vocab_limit(drafter_config)
    mask_id = drafter_config.mask_token_id
    block = drafter_config.block_size
    if limit > max(target_vocab, real_tokens + 1) or drafter_config.vocab_size < real_tokens:
        raise CompatibilityError(
            f"vocabulary mismatch: the drafter has {drafter_config.vocab_size} ids ({limit} proposable), the target "
            f"{real_tokens} real tokens; use a drafter trained for this target's tokenizer"
        )
    if mask_id < real_tokens:
        raise CompatibilityError(
            f"the drafter's mask_token_id {mask_id} is a real target token (the target has {real_tokens}); "
            "the mask id must be an extra id >= the tokenizer size"
        )
    if not 2 <= block <= MAX_BLOCK_SIZE or block > getattr(target_config, "max_position_embeddings", block):
        raise CompatibilityError(f"block_size {block} is not usable with this target; use 2..{MAX_BLOCK_SIZE}")
    _check_same_ids(drafter_tokenizer, target_tokenizer, "drafter")


def check_assistant(assistant_config, target_config, assistant_tokenizer=None, target_tokenizer=None) -> None:
    """Raise CompatibilityError unless a causal LM can draft for the target in transformers' assisted
    generation with the target's tokenizer: the same vocabulary size and, where both carry tokenizers, the
    same id for every target token."""
    sizes = getattr(assistant_config, "vocab_size", None), getattr(target_config, "vocab_size", None)
    if sizes[0] != sizes[1]:
        raise CompatibilityError(
            f"vocabulary mismatch: the assistant has {sizes[0]} ids, the target {sizes[1]}; pass an assistant "
            "model of the target's tokenizer (e.g. a smaller model of the same family)"
        )
    _check_same_ids(assistant_tokenizer, target_tokenizer, "assistant")


def _check_same_ids(tokenizer, target_tokenizer, role: str) -> None:
    """CompatibilityError unless `tokenizer` maps every token of `target_tokenizer` to the same id (either None: no check)."""
    if tokenizer is None or target_tokenizer is None:
        return
    own, target = tokenizer.get_vocab(), target_tokenizer.get_vocab()
    differing = [tok for tok, idx in target.items() if own.get(tok) != idx]
    if differing:
        raise CompatibilityError(
            f"tokenizer mismatch: {len(differing)} target tokens have another id in the {role}'s tokenizer "
            f"(e.g. {differing[0]!r}); the {role} must share the target's tokenizer"
        )


@dataclass(frozen=True)
class TargetFiles:
    """A target as its files describe it, its weights never read: what replaying its recorded outputs needs of
    it. `config`: its config (vocabulary, context length); `generation_config`: its generation_config.json
    (stop ids), None where it has none (a loaded target then derives one from `config`)."""

    config: object
    generation_config: object | None = None


def target_files(path: str | os.PathLike) -> TargetFiles:
    """The config and generation config of a target folder or GGUF file, without loading weights."""
    from transformers import GenerationConfig

    path = Path(path)
    generation = None
    if path.is_dir() and (path / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return TargetFiles(target_config_of(path), generation)


def target_config_of(path: str | os.PathLike):
    """The config of a target folder or GGUF file without loading weights."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_file():
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    read_config_json(path)
    return AutoConfig.from_pretrained(str(path), local_files_only=True)
