"""`prune validate`: check a drafter checkpoint (and optionally its pairing with a target) without decoding."""

from . import _types
from ._common import add_command, add_debug, quiet_libraries, write_json


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "validate",
        help="check a drafter folder and its compatibility with a target",
        description="Check a drafter checkpoint without loading its weights: config keys, per-layer config "
        "lists, safetensors integrity, tensor names and shapes, the draft vocabulary (its ids file against "
        "config.json, reported as draft_vocab_tokens); with --target also the vocabulary, mask id, "
        "tokenizer and block size against the target.\n\nexample:\n  prune validate --drafter DRAFTER --target TARGET",
    )
    parser.add_argument("--drafter", required=True, type=_types.drafter_dir, help="drafter checkpoint folder")
    parser.add_argument("--target", default=None, type=_types.target_path,
                        help="target model folder or .gguf file (optional)")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the summary as JSON to OUT ('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from models.drafter import validate_checkpoint
    from models.target import check_pair, load_tokenizer, target_config_of

    quiet_libraries()
    config = validate_checkpoint(args.drafter)
    summary = {
        "drafter": args.drafter,
        "layers": config.num_hidden_layers,
        "original_layer_indices": getattr(config, "original_layer_indices", None),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        # the ids it proposes from (models/draft_vocab.py; validate_checkpoint checked the file): None = every id
        "draft_vocab_tokens": (getattr(config, "draft_vocab", None) or {}).get("tokens"),
        "draft_vocab": getattr(config, "draft_vocab", None),
        "compatible_with_target": None,
    }
    if args.target:
        check_pair(config, target_config_of(args.target), load_tokenizer(args.drafter), load_tokenizer(args.target))
        summary["target"] = args.target
        summary["compatible_with_target"] = True
    if args.json:
        write_json(summary, args.json)
    if args.json != "-":
        pairs = ", ".join(f"{k}={v}" for k, v in summary.items() if k not in ("original_layer_indices", "draft_vocab"))
        print(f"OK: {pairs}")
    return 0
