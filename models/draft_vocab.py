"""A draft vocabulary: the K token ids a drafter may propose, and the one map from head rows to target ids.

A drafter with a draft vocabulary computes its head on those K rows of `lm_head` alone, in every pass
(decode.engine, models.inference.draft_logits), and maps its proposals back through the index tensor
kept here. The target still verifies over its whole vocabulary, so greedy output stays the target's and
speculative sampling stays exact; an id outside the subset costs acceptance only.

On disk the drafter keeps its full (tied) head, so the folder loads as a plain `Qwen3ForCausalLM`; the ids
are a safetensors file beside the weights and config.json names it:

    draft_vocab.safetensors   {"ids": int64 (K,)}, most frequent first; metadata {"format": "1"}
    config.json               "draft_vocab": {"file": "draft_vocab.safetensors", "tokens": K,
                                              "sha256": sha256 of the ids' int64 bytes,
                                              "source": what ranked them, "coverage": share of its tokens}

In memory the ids are a non-persistent int64 buffer `draft_vocab_ids` of the model (it moves with the
model's device, survives deep copies such as layer surgery and heals, and is never written into the
weights file). Without the key (and the buffer) the drafter proposes from its whole proposable vocabulary.
"""

import copy
import hashlib
import os
from pathlib import Path

import torch

from .drafter_config import draft_vocab_limit
from .errors import CheckpointError, ConfigError

FILE = "draft_vocab.safetensors"
KEY = "draft_vocab"  # the config key
BUFFER = "draft_vocab_ids"  # the model's buffer
FORMAT = "1"


def ids_sha256(ids: torch.Tensor) -> str:
    """sha256 of `ids` (int64 `(K,)`) as little-endian bytes: what config.json records of the file."""
    return hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def proposable_ids(config) -> torch.Tensor:
    """Every id the drafter's full head may propose, ascending (int64): below `draft_vocab_size`, never the mask."""
    ids = torch.arange(draft_vocab_limit(config), dtype=torch.int64)
    return ids[ids != config.mask_token_id]


def check_ids(ids: torch.Tensor, config, where: str = "draft vocabulary") -> torch.Tensor:
    """`ids` as int64 on the CPU, after checking it is a draft vocabulary of a drafter with `config`: a 1-D
    tensor of distinct ids the full head may propose (ConfigError otherwise)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ConfigError(f"{where}: expected a non-empty 1-D integer tensor of token ids")
    ids = ids.to("cpu", torch.int64)
    limit, mask_id = draft_vocab_limit(config), config.mask_token_id
    bad = ids[(ids < 0) | (ids >= limit) | (ids == mask_id)]
    if bad.numel():
        raise ConfigError(f"{where}: id {int(bad[0])} is not a proposable token (ids 0..{limit - 1}, never the "
                          f"mask id {mask_id}); rebuild it with prune vocab")
    if ids.unique().numel() != ids.numel():
        raise ConfigError(f"{where}: ids repeat; rebuild it with prune vocab")
    return ids


def draft_vocab(model: torch.nn.Module) -> torch.Tensor | None:
    """The draft vocabulary of `model` (int64 `(K,)` on its device; row r of its head proposes id `ids[r]`), or
    None when it proposes from its whole head. A model whose config names a draft vocabulary that was never
    attached (loaded by plain transformers) is refused: it would propose ids outside it."""
    ids = getattr(model, BUFFER, None)
    config = getattr(model, "config", None)
    named = getattr(config, KEY, None) if config is not None else None
    if ids is None and named:
        raise ConfigError("this drafter's config names a draft vocabulary that is not loaded; load the folder with "
                          "models.drafter.load_drafter")
    return ids


def head_rows(model_or_config) -> int:
    """Rows of the head a drafter's passes compute: its draft vocabulary's size, else its proposable ids (the
    rows below draft_vocab_size; see `head_selection`)."""
    config = getattr(model_or_config, "config", model_or_config)
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    named = get(KEY)
    return int(named["tokens"]) if named else int(get("draft_vocab_size") or get("vocab_size"))


def head_selection(model: torch.nn.Module) -> torch.Tensor | int | None:
    """The rows of `model.lm_head` its passes compute: the draft vocabulary's ids (int64 `(K,)`; column r of the
    logits is token `ids[r]`), else the first draft_vocab_size rows where rows follow them (padding rows, never
    proposed: a prefix keeps column r = token r and is a view of the weights), else None (every row: a target,
    or a drafter whose every row is proposable)."""
    ids = draft_vocab(model)
    if ids is not None:
        return ids
    limit = draft_vocab_limit(model.config)
    return limit if limit < model.config.vocab_size else None


def set_draft_vocab(model: torch.nn.Module, ids: torch.Tensor | None, source: str | None = None,
                    coverage: float | None = None) -> torch.nn.Module:
    """Give `model` (in place) the draft vocabulary `ids` (int64 `(K,)`), or none with None; returns it.

    `source` (what ranked the ids) and `coverage` (the share of that source's tokens they hold) are recorded
    in the config for the folder's readers."""
    if ids is None:
        if hasattr(model, BUFFER):
            delattr(model, BUFFER)
        if hasattr(model.config, KEY):
            delattr(model.config, KEY)
        return model
    ids = check_ids(ids, model.config)
    device = next(model.parameters()).device
    model.register_buffer(BUFFER, ids.to(device), persistent=False)
    setattr(model.config, KEY, {"file": FILE, "tokens": int(ids.numel()), "sha256": ids_sha256(ids),
                                "source": source, "coverage": None if coverage is None else round(float(coverage), 6)})
    return model


def with_draft_vocab(model: torch.nn.Module, ids: torch.Tensor, source: str | None = None,
                     coverage: float | None = None) -> torch.nn.Module:
    """A copy of `model` with the draft vocabulary `ids` (`model` is unchanged)."""
    return set_draft_vocab(copy.deepcopy(model), ids, source, coverage)


def cut_ids(current: torch.Tensor | None, ranking: torch.Tensor, size: int, config) -> torch.Tensor:
    """The `size` best-ranked ids among those a drafter proposes now (`current`: its draft vocabulary, None:
    every proposable id), best first. `ranking`: ids best first (prune.vocab.TokenRanking); ids it lacks
    rank after it, in id order."""
    pool = proposable_ids(config) if current is None else current.to("cpu", torch.int64)
    if not 0 < size <= pool.numel():
        raise ConfigError(f"a draft vocabulary of {size} ids must be in 1..{pool.numel()} (the ids the drafter "
                          "proposes now); choose a smaller --size")
    top = max(int(pool.max()), int(ranking.max()) if ranking.numel() else 0)
    rank = torch.full((top + 1,), len(ranking), dtype=torch.int64)
    rank[ranking.to(torch.int64)] = torch.arange(len(ranking), dtype=torch.int64)
    order = sorted(pool.tolist(), key=lambda i: (int(rank[i]), i))
    return torch.tensor(order[:size], dtype=torch.int64)


def write_draft_vocab(folder: str | os.PathLike, ids: torch.Tensor) -> Path:
    """Write `ids` as FILE in `folder` (a folder being saved; the caller makes it atomic)."""
    from safetensors.torch import save_file

    path = Path(folder) / FILE
    save_file({"ids": ids.detach().to("cpu", torch.int64).contiguous()}, str(path), metadata={"format": FORMAT})
    return path


def read_draft_vocab(folder: str | os.PathLike, config) -> torch.Tensor | None:
    """The draft vocabulary a drafter folder's config names (int64 `(K,)` on the CPU), checked against the
    config (CheckpointError naming the problem), or None when it names none."""
    named = config.get(KEY) if isinstance(config, dict) else getattr(config, KEY, None)
    if not named:
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / named.get("file", FILE)
    try:
        ids = load_file(str(path))["ids"]
    except (OSError, KeyError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: cannot read the draft vocabulary that config.json names ({exc}); copy the "
                              "file back or cut the head again with prune vocab") from None
    if ids.dim() != 1 or ids.numel() != named.get("tokens") or ids_sha256(ids) != named.get("sha256"):
        raise CheckpointError(f"{path} holds {ids.numel()} ids that do not match config.json's draft_vocab "
                              f"({named.get('tokens')} ids, sha256 {str(named.get('sha256'))[:12]}...); cut the head "
                              "again with prune vocab")
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    check_ids(ids, _Limits(get("vocab_size"), get("draft_vocab_size"), get("mask_token_id")), where=str(path))
    return ids


class _Limits:
    """The config fields `check_ids` reads, from a config.json dict or a config."""

    def __init__(self, vocab_size, draft_vocab_size, mask_token_id):
        self.vocab_size, self.draft_vocab_size, self.mask_token_id = vocab_size, draft_vocab_size, mask_token_id
