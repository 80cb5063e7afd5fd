"""Flags about a drafter checkpoint's layout, shared by the commands that read or write one: the drafter keys
of a checkpoint whose config.json lacks them, and the largest weight file an export writes (models/shards.py).
Nothing here imports torch."""

from models.drafter_config import KEY_FLAGS
from models.shards import DEFAULT_MAX_SHARD_SIZE

from . import _types


def add_drafter_key_args(parser, block_size: bool = True) -> None:
    """--block-size and --mask-token-id: the drafter keys of a checkpoint whose config.json lacks them (at every
    place of models.drafter_config.KEY_BLOCKS); they fill gaps and never override a checkpoint's value.
    `block_size=False` where the command has a --block-size of its own (bench: the most tokens verified per
    round), which then also gives a missing block_size."""
    if block_size:
        parser.add_argument("--block-size", type=_types.block_size, default=None, metavar="B",
                            help="the drafter's block_size, for a checkpoint whose config.json has none (at the top "
                            "level or in a nested block such as dflash_config)")
    parser.add_argument("--mask-token-id", type=_types.non_negative_int, default=None, metavar="ID",
                        help="the drafter's mask_token_id, for a checkpoint whose config.json has none (at the top "
                        "level or in a nested block such as dflash_config)")
    parser.set_defaults(drafter_key_flags=KEY_FLAGS, drafter_keys_fill_only=() if block_size else ("block_size",))


def drafter_keys(args, folder=None) -> dict:
    """{key: value} the command's drafter key flags give (add_drafter_key_args), for the drafter in `folder`:
    a flag that means something else too (bench's --block-size) only where `folder`'s config.json lacks the key."""
    from models.checkpoint import read_config_json
    from models.drafter_config import missing_keys

    keys = {key: getattr(args, key, None) for key in getattr(args, "drafter_key_flags", {})}
    fill_only = getattr(args, "drafter_keys_fill_only", ())
    if fill_only and folder is not None:
        lacking = missing_keys(read_config_json(folder))
        keys.update({key: None for key in fill_only if key not in lacking})
    return {key: value for key, value in keys.items() if value is not None}


def add_max_shard_size_arg(parser) -> None:
    parser.add_argument("--max-shard-size", type=_types.size, default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                        help="largest weight file written (e.g. 80MB, 5GB); heavier weights are written as the "
                        "hub's shards, model-0000i-of-0000N.safetensors with model.safetensors.index.json")
