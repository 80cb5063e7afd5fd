"""The drafter's config rules: its extra keys, their bounds and their validation (docs/design.md, Layer surgery).

A drafter config is a Qwen3 config (`model_type` "qwen3") carrying `block_size` and `mask_token_id`, and
optionally `draft_vocab_size`, `draft_vocab` and `original_layer_indices` (models/drafter.py describes them). Nothing
here imports torch or transformers: the command line checks flags against these rules before a model loads.

A checkpoint's config.json may keep the two drafter keys at its top level or in a nested block, as
DFlash-style configs keep `mask_token_id` (and sometimes `block_size`) in `dflash_config`; KEY_BLOCKS lists
where they are looked for, and `with_drafter_keys` brings them to the top level, where the loaded model's
config carries them (and every export writes them). Values given for a checkpoint that has none
(`--block-size`, `--mask-token-id`; `drafter_keys=` in Python) fill the gaps.
"""

from .errors import ConfigError

REQUIRED_KEYS = ("block_size", "mask_token_id")  # what tells a block-diffusion drafter from a target model
MAX_BLOCK_SIZE = 64
# Where config.json may keep the drafter keys, searched in order: "" is the top level, any other entry the
# name of a nested block. A new checkpoint layout is one entry.
KEY_BLOCKS = ("", "dflash_config")
# The command-line flag that gives each drafter key for a checkpoint that lacks it.
KEY_FLAGS = {"block_size": "--block-size", "mask_token_id": "--mask-token-id"}


def _getter(config):
    """`get(key, default=None)` reading a transformers config or a dict (config.json as read)."""
    return config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)


def _place(block: str, key: str) -> str:
    return f"{block}.{key}" if block else key


def found_keys(raw: dict, key: str) -> dict[str, object]:
    """{where (e.g. "block_size", "dflash_config.mask_token_id"): value} of every KEY_BLOCKS place that holds
    `key` in config.json `raw`, in KEY_BLOCKS order."""
    found = {}
    for block in KEY_BLOCKS:
        holder = raw.get(block) if block else raw
        if isinstance(holder, dict) and holder.get(key) is not None:
            found[_place(block, key)] = holder[key]
    return found


def missing_keys(raw: dict) -> list[str]:
    """The drafter keys that no KEY_BLOCKS place of config.json `raw` holds."""
    return [key for key in REQUIRED_KEYS if not found_keys(raw, key)]


def with_drafter_keys(raw: dict, given: dict | None = None, where: str = "config.json") -> dict:
    """A copy of config.json `raw` with `block_size` and `mask_token_id` at its top level: read from the
    KEY_BLOCKS places, or from `given` ({key: value}, the --block-size / --mask-token-id flags) where
    `raw` has none. Raises ConfigError for a key found nowhere (naming its flag), places that disagree,
    or a given value that disagrees with the checkpoint's (it fills a gap, never overrides)."""
    given = {key: value for key, value in (given or {}).items() if value is not None}
    unknown = sorted(set(given) - set(REQUIRED_KEYS))
    if unknown:
        raise ConfigError(f"unknown drafter key {unknown[0]!r}; drafter_keys takes {', '.join(REQUIRED_KEYS)}")
    resolved = dict(raw)
    for key in REQUIRED_KEYS:
        found, flag = found_keys(raw, key), KEY_FLAGS[key]
        values = set(found.values())
        if len(values) > 1:
            shown = ", ".join(f"{place} = {value}" for place, value in found.items())
            raise ConfigError(f"{where}: {shown} disagree; keep one value of {key}")
        if values and key in given and given[key] not in values:
            place, value = next(iter(found.items()))
            raise ConfigError(f"{where} has {place} = {value}, but {given[key]} is given ({flag}); drop {flag}, "
                              f"which only fills a {key} the checkpoint lacks")
        if not values and key not in given:
            places = ", ".join(_place(block, key) for block in KEY_BLOCKS)
            raise ConfigError(f"{where}: missing key {key!r} (looked at {places}); a drafter config needs "
                              f"{', '.join(REQUIRED_KEYS)}: pass {flag} (Python: drafter_keys={{'{key}': ...}})")
        resolved[key] = next(iter(values)) if values else given[key]
    return resolved


def original_layers(config) -> list[int]:
    """The 0-based indices, in the unpruned drafter, of the layers a drafter config describes: its
    `original_layer_indices`, or 0..n-1 for a drafter that was never pruned (a transformers config or a dict)."""
    get = _getter(config)
    return list(get("original_layer_indices") or range(get("num_hidden_layers")))


def validate_config(config, where: str = "drafter config") -> None:
    """Raise ConfigError naming the first inconsistency of a drafter config (a transformers config or a dict)."""
    get = _getter(config)
    if get("model_type") != "qwen3":
        raise ConfigError(f"{where}: model_type is {get('model_type')!r}; a drafter must be a qwen3 model")
    for key in REQUIRED_KEYS:
        if get(key) is None:
            raise ConfigError(f"{where}: missing key {key!r}; a drafter config needs {', '.join(REQUIRED_KEYS)} "
                              f"(for a checkpoint that lacks it: {KEY_FLAGS[key]})")
    vocab_size, block_size, mask_id = get("vocab_size"), get("block_size"), get("mask_token_id")
    if not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"{where}: block_size {block_size!r} must be an integer in 2..{MAX_BLOCK_SIZE}")
    if not isinstance(mask_id, int) or not 0 <= mask_id < vocab_size:
        raise ConfigError(f"{where}: mask_token_id {mask_id!r} must be an id in 0..{vocab_size - 1}")
    draft_vocab = get("draft_vocab_size") or vocab_size
    if not 0 < draft_vocab <= vocab_size:
        raise ConfigError(f"{where}: draft_vocab_size {draft_vocab} must be in 1..vocab_size ({vocab_size})")
    _validate_draft_vocab(get("draft_vocab"), draft_vocab, where)
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                          f"{kv_heads} (--heads, --kv-heads)")
    layers = get("num_hidden_layers")
    layer_types = get("layer_types")
    if layer_types is not None and len(layer_types) != layers:
        raise ConfigError(
            f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers is {layers}; "
            "re-export the drafter with this tool's layer surgery"
        )
    kept = get("original_layer_indices")
    if kept is not None and (len(kept) != layers or list(kept) != sorted(set(kept))):
        raise ConfigError(
            f"{where}: original_layer_indices {kept} must list {layers} distinct increasing layer indices"
        )


def _validate_draft_vocab(named, proposable: int, where: str) -> None:
    """The `draft_vocab` key (models/draft_vocab.py): a file name in the folder and 1..proposable tokens."""
    if named is None:
        return
    tokens, file = (named.get("tokens"), named.get("file")) if isinstance(named, dict) else (None, None)
    if not isinstance(tokens, int) or not 0 < tokens <= proposable or not isinstance(file, str) or "/" in file:
        raise ConfigError(f"{where}: draft_vocab {named!r} must name a file in the folder and 1..{proposable} tokens; "
                          "cut the head again with prune vocab")


def draft_vocab_limit(config) -> int:
    """Ids at or above this are padding rows, never proposed."""
    return getattr(config, "draft_vocab_size", None) or config.vocab_size
