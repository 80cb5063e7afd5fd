"""The drafter: a plain `Qwen3ForCausalLM` whose config carries `block_size` and `mask_token_id`.

Extra config keys (all plain JSON, ignored by anything that just loads Qwen3):
    block_size              B, mask slots drafted per pass.
    mask_token_id           the id fed at mask slots; never a real token of the target.
    draft_vocab_size        ids >= this are padding rows and are never proposed (default: vocab_size).
    draft_vocab             optional: the K ids the drafter proposes from, kept in draft_vocab.safetensors
                            beside the weights (models/draft_vocab.py; the head on disk stays whole).
    original_layer_indices  0-based indices, in the unpruned drafter, of the layers this one keeps.

The rules these keys obey, their validation and where a checkpoint may keep them (top level or a nested block,
with values given for a checkpoint that lacks them: `drafter_keys`) are models/drafter_config.py; where it
keeps its weights (one file or shards) is models/shards.py.
"""

import copy
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from .checkpoint import atomic_folder, copy_tokenizer_files, read_config_json
from .draft_vocab import draft_vocab as draft_vocab_of
from .draft_vocab import read_draft_vocab, set_draft_vocab, write_draft_vocab
from .drafter_config import validate_config, with_drafter_keys
from .errors import CheckpointError, ConfigError
from .provenance import FILE as PROVENANCE_FILE
from .shards import DEFAULT_MAX_SHARD_SIZE, parse_size, read_weights, weights_label
from .surgery import remove_layers


def create_drafter(
    vocab_size: int,
    mask_token_id: int,
    block_size: int = 16,
    num_hidden_layers: int = 36,
    hidden_size: int = 256,
    intermediate_size: int = 768,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    **config_kwargs,
) -> Qwen3ForCausalLM:
    """Build a randomly initialised drafter (float32) from explicit sizes; `seed` fixes the weights."""
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        block_size=block_size,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab_size or vocab_size,
        original_layer_indices=list(range(num_hidden_layers)),
        **config_kwargs,
    )
    validate_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def drafter_from_checkpoint(
    folder: str | os.PathLike,
    block_size: int = 16,
    mask_token_id: int | None = None,
    num_hidden_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Qwen3ForCausalLM:
    """Initialise a drafter from a pretrained Qwen3 causal-LM folder (safetensors), e.g. a small Qwen3.

    The weights are copied; `num_hidden_layers` keeps only the first layers. When the mask id (default:
    one past the source vocabulary) has no embedding row yet, the vocabulary grows to a multiple of 64
    and the new rows start at the mean embedding; ids past the source vocabulary are never proposed.
    """
    raw = read_config_json(folder)
    if raw.get("model_type") != "qwen3":
        raise ConfigError(f"{folder}: model_type is {raw.get('model_type')!r}; a drafter starts from a qwen3 model")
    source = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa", use_safetensors=True, trust_remote_code=False
    )
    vocab = source.config.vocab_size
    mask_id = vocab if mask_token_id is None else mask_token_id
    if mask_id >= vocab:
        new_vocab = -(-(mask_id + 1) // 64) * 64
        source.resize_token_embeddings(new_vocab, mean_resizing=True)
    config = source.config
    config.block_size, config.mask_token_id = block_size, mask_id
    config.draft_vocab_size = min(vocab, mask_id)  # padded rows past a mask id inside the vocabulary too
    layers = num_hidden_layers or config.num_hidden_layers
    config.original_layer_indices = list(range(config.num_hidden_layers))
    drafter = remove_layers(source, range(layers, config.num_hidden_layers)) if layers < config.num_hidden_layers else source
    drafter.config.original_layer_indices = list(range(layers))  # a fresh drafter: its layers are the originals
    validate_config(drafter.config)
    return drafter.eval()


def init_embeddings_from(drafter: Qwen3ForCausalLM, source: torch.nn.Module) -> None:
    """Copy the token embedding (and an untied lm_head) rows that `source` has into `drafter`.

    Rows beyond the source vocabulary (the mask token, padding) keep their random initialisation. The
    widths must match; use this to start a drafter from its target's embeddings.
    """
    src_embed = source.get_input_embeddings().weight
    dst_embed = drafter.get_input_embeddings().weight
    if src_embed.shape[1] != dst_embed.shape[1]:
        raise ConfigError(
            f"cannot copy embeddings of width {src_embed.shape[1]} into a drafter of width {dst_embed.shape[1]}; "
            "choose hidden_size equal to the source's"
        )
    rows = min(src_embed.shape[0], dst_embed.shape[0])
    with torch.no_grad():
        dst_embed[:rows].copy_(src_embed[:rows])
        src_head, dst_head = source.get_output_embeddings(), drafter.get_output_embeddings()
        if src_head is not None and dst_head is not None and dst_head.weight is not dst_embed:
            dst_head.weight[:rows].copy_(src_head.weight[:rows])


def expected_weight_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes a safetensors file must hold for `config` (tied weights excluded)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(copy.deepcopy(config))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def validate_checkpoint(folder: str | os.PathLike, drafter_keys: dict | None = None) -> Qwen3Config:
    """Check a drafter folder without loading weights: config keys, the integrity of every weight file (one
    file or shards and their index, models/shards.py), tensor names and shapes, and the draft vocabulary its
    config names (models/draft_vocab.py); returns its config with the drafter keys at the top level.

    `drafter_keys`: {"block_size": B, "mask_token_id": ID} for a checkpoint whose config.json lacks them
    (models.drafter_config.with_drafter_keys)."""
    folder = Path(folder)
    where = f"{folder}/config.json"
    raw = with_drafter_keys(read_config_json(folder), drafter_keys, where)
    validate_config(raw, where=where)
    config = Qwen3Config.from_dict(raw)
    held = read_weights(folder)
    found = {name: shape for name, (shape, _) in held.items()}
    expected = expected_weight_shapes(config)
    found.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        detail = "; ".join(
            part
            for part in (
                f"missing {_names(missing)}" if missing else "",
                f"unexpected {_names(unexpected)}" if unexpected else "",
            )
            if part
        )
        raise CheckpointError(f"{weights_label(folder)} does not match its config.json: {detail}")
    wrong = [name for name in expected if found[name] != expected[name]]
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{held[name][1]}: tensor {name} has shape {list(found[name])}, config says "
            f"{list(expected[name])} ({len(wrong)} tensors differ)"
        )
    read_draft_vocab(folder, raw)
    return config


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_drafter(
    folder: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    drafter_keys: dict | None = None,
) -> Qwen3ForCausalLM:
    """Validate and load a drafter folder (safetensors: one file or shards) in eval mode with SDPA attention,
    with its draft vocabulary where it has one.

    The weights stream in file by file into the model (transformers' loader), so loading holds one copy of
    them; the config is the validated one, with the drafter keys at its top level (`drafter_keys`: as in
    validate_checkpoint)."""
    config = validate_checkpoint(folder, drafter_keys)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), config=config, dtype=dtype, attn_implementation="sdpa", use_safetensors=True,
        trust_remote_code=False,
    )
    ids = read_draft_vocab(folder, read_config_json(folder))
    if ids is not None:
        named = model.config.draft_vocab
        set_draft_vocab(model, ids, named.get("source"), named.get("coverage"))
    return model.to(device).eval()


def save_drafter(
    model: Qwen3ForCausalLM,
    folder: str | os.PathLike,
    tokenizer_source: str | os.PathLike | None = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
    before_commit=None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a drafter folder atomically: config.json, the weights (model.safetensors, or shards and their index
    above `max_shard_size`, models/shards.py), its draft vocabulary (where it has one), tokenizer files, extra
    text files.

    Args:
        tokenizer_source: a folder whose tokenizer files (and record of training prompts,
            models/provenance.py) are copied alongside (usually the source drafter).
        dtype: cast the saved weights (e.g. torch.bfloat16); the in-memory model is not changed.
        extra_files: `{file name: text}` written into the folder before it is renamed into place.
        before_commit: optional callable(temporary folder) run last, e.g. to record hashes of the files.
        max_shard_size: bytes, or a size such as "80MB", of the largest weight file; weights above it are
            written as the hub's shards (model-0000i-of-0000N.safetensors and model.safetensors.index.json).
    """
    validate_config(model.config)
    with atomic_folder(folder, overwrite=overwrite) as tmp:
        to_save = model
        if dtype is not None and dtype != next(model.parameters()).dtype:
            to_save = copy.deepcopy(model).to(dtype)
        to_save.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=parse_size(max_shard_size))
        ids = draft_vocab_of(model)
        if ids is not None:
            write_draft_vocab(tmp, ids)
        if tokenizer_source is not None:
            copy_tokenizer_files(tokenizer_source, tmp)
            # What the source was trained on stays true of its pruned and re-exported copies.
            provenance = Path(tokenizer_source) / PROVENANCE_FILE
            if provenance.is_file() and (tmp / PROVENANCE_FILE) != provenance:
                shutil.copy2(provenance, tmp / PROVENANCE_FILE)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if before_commit is not None:
            before_commit(tmp)
    return Path(folder)
