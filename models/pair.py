"""A drafter and its target, loaded together and checked against each other."""

import os
from dataclasses import dataclass

import torch

from .drafter import load_drafter, validate_checkpoint
from .precision import drafter_dtype
from .target import check_pair, load_target, load_tokenizer, target_files


@dataclass
class Pair:
    """A loaded drafter/target pair.

    Attributes:
        target: the loaded target, or None when only its files were read (`load_pair(..., target_weights=False)`).
        tokenizer: the target's tokenizer, or None when neither folder carries tokenizer files.
        stop_ids: ids that end generation (the target's EOS ids).
        max_positions: the smaller of the two models' context lengths.
        target_config: the target's config (read from its files whether or not its weights are loaded).
    """

    drafter: torch.nn.Module
    target: torch.nn.Module | None
    tokenizer: object | None
    stop_ids: tuple[int, ...]
    max_positions: int
    target_config: object = None


def load_pair(
    drafter_dir: str | os.PathLike,
    target_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    drafter_compute: str | torch.dtype | None = "auto",
    drafter_keys: dict | None = None,
    target_weights: bool = True,
) -> Pair:
    """Validate both checkpoints and their compatibility before loading any weights, then load them.

    `dtype` is the target's compute dtype; `drafter_compute` the drafter's (models.precision.drafter_dtype:
    "auto" is float32 on a CPU and `dtype` elsewhere); `drafter_keys` as in models.drafter.validate_checkpoint.
    `target_weights` False reads the target's tokenizer, config and generation config only (Pair.target None):
    what replaying its recorded outputs needs."""
    drafter_config = validate_checkpoint(drafter_dir, drafter_keys)
    described = target_files(target_path)
    tokenizer = load_tokenizer(target_path)
    drafter_tokenizer = load_tokenizer(drafter_dir)
    check_pair(drafter_config, described.config, drafter_tokenizer, tokenizer)
    target = load_target(target_path, dtype, device) if target_weights else None
    return _with_drafter(target, drafter_dir, tokenizer, drafter_tokenizer,
                         drafter_dtype(drafter_compute, dtype, torch.device(device)), device, drafter_keys, described)


def pair_with_target(drafter_dir: str | os.PathLike, target: torch.nn.Module, tokenizer=None,
                     drafter_compute: str | torch.dtype | None = "auto", drafter_keys: dict | None = None) -> Pair:
    """A pair around an already-loaded target (set to eval mode); the drafter loads on its device, in
    `drafter_compute` as `load_pair` reads it (auto: float32 on a CPU, the target's dtype elsewhere).

    Args:
        tokenizer: the target's tokenizer; None uses the drafter folder's tokenizer files (exported drafters
            carry those of their target).
        drafter_keys: as in models.drafter.validate_checkpoint.
    """
    drafter_config = validate_checkpoint(drafter_dir, drafter_keys)
    drafter_tokenizer = load_tokenizer(drafter_dir)
    check_pair(drafter_config, target.config, drafter_tokenizer, tokenizer)
    weight = next(target.parameters())
    return _with_drafter(target.eval(), drafter_dir, tokenizer, drafter_tokenizer,
                         drafter_dtype(drafter_compute, weight.dtype, weight.device), weight.device, drafter_keys)


def _with_drafter(target, drafter_dir, tokenizer, drafter_tokenizer, dtype, device, drafter_keys,
                  described=None) -> Pair:
    """Load the drafter of a checked pair and assemble the Pair (the target's tokenizer preferred); `described`
    (models.target.TargetFiles) stands in for `target` where its weights are not loaded."""
    drafter = load_drafter(drafter_dir, dtype, device, drafter_keys)
    target_side = target if target is not None else described
    max_positions = min(
        getattr(target_side.config, "max_position_embeddings", 1 << 30),
        getattr(drafter.config, "max_position_embeddings", 1 << 30),
    )
    return Pair(drafter, target, tokenizer or drafter_tokenizer, stop_ids_of(target_side, tokenizer), max_positions,
                target_side.config)


def stop_ids_of(target: torch.nn.Module | None = None, tokenizer=None) -> tuple[int, ...]:
    """The ids that end a sequence: every EOS id that the target's generation config, its config or the
    tokenizer names (sorted, distinct). The one stop rule of decoding, distillation and training. `target`:
    a loaded target, or its files (models.target.TargetFiles), which name the same ids."""
    ids = set()
    sources = (getattr(target, "generation_config", None), getattr(target, "config", None), tokenizer)
    for source in sources:
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return tuple(sorted(ids))
