"""`prune validate`: check a drafter checkpoint (and optionally its pairing with a target) without decoding, and
plan its commands' memory."""

import sys

from . import _types
from ._checkpoint_args import add_drafter_key_args, drafter_keys
from ._common import DTYPES, SCORE, add_command, add_debug, quiet_libraries, write_json


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "validate",
        help="check a drafter folder and its compatibility with a target",
        description="Check a drafter checkpoint without loading its weights: config keys, per-layer config "
        "lists, safetensors integrity (one model.safetensors, or every shard against its index), tensor names and "
        "shapes, the draft vocabulary (its ids file against config.json, reported as draft_vocab_tokens); with --target also the vocabulary, mask id, "
        "tokenizer and block size against the target. Then a memory plan from the configs alone: parameters, bytes and "
        "the estimated peak memory of prune score, prune run (default heal) and prune heal --train full on --device "
        "(prune/memory_plan.py), with a warning on stderr for each that exceeds the device's free memory."
        "\n\nexamples:\n  prune validate --drafter DRAFTER --target TARGET\n"
        "  prune validate --drafter DRAFTER --target TARGET --device cuda --dtype bfloat16 --json -",
    )
    parser.add_argument("--drafter", required=True, type=_types.drafter_dir, help="drafter checkpoint folder")
    parser.add_argument("--target", default=None, type=_types.target_path,
                        help="target model folder or .gguf file (optional)")
    add_drafter_key_args(parser)
    parser.add_argument("--device", default="cpu", type=_types.device,
                        help="the device the memory plan is for: cpu, cuda, cuda:1, ... (a GPU need not be present)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="the compute dtype the memory plan is for, as the measuring commands take it (the "
                        "drafter's follows their --drafter-dtype auto: float32 on a CPU)")
    parser.add_argument("--batch-size", type=_types.positive_int, default=SCORE["batch_size"],
                        help="prompts decoded at once, as prune score and prune run take it (the plan's caches, "
                        "activations and logits)")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the summary as JSON to OUT ('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from models.drafter import validate_checkpoint
    from models.shards import weight_files, weights_bytes
    from models.target import check_pair, load_tokenizer, target_config_of
    from prune.memory_plan import describe, warnings_for

    quiet_libraries()
    config = validate_checkpoint(args.drafter, drafter_keys(args, args.drafter))
    summary = {
        "drafter": args.drafter,
        "layers": config.num_hidden_layers,
        "original_layer_indices": getattr(config, "original_layer_indices", None),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "weight_files": len(weight_files(args.drafter)),
        "weights_bytes": weights_bytes(args.drafter),
        # the ids it proposes from (models/draft_vocab.py; validate_checkpoint checked the file): None = every id
        "draft_vocab_tokens": (getattr(config, "draft_vocab", None) or {}).get("tokens"),
        "draft_vocab": getattr(config, "draft_vocab", None),
        "compatible_with_target": None,
    }
    target_config = None
    if args.target:
        target_config = target_config_of(args.target)
        check_pair(config, target_config, load_tokenizer(args.drafter), load_tokenizer(args.target))
        summary["target"] = args.target
        summary["compatible_with_target"] = True
    checked = ", ".join(f"{k}={v}" for k, v in summary.items() if k not in ("original_layer_indices", "draft_vocab"))
    plan, available, source = _memory_plan(args, config, target_config)
    summary.update(plan.to_dict(), available_bytes=available, available_source=source)
    if args.json:
        write_json(summary, args.json)
    if args.json != "-":
        print(f"OK: {checked}")
        print(describe(plan, available, source) + ("" if target_config else " (no --target: its parts left out)"))
    for line in warnings_for(plan, available, source):
        print(line, file=sys.stderr)
    return 0


def _memory_plan(args, drafter_config, target_config):
    """The memory plan of the pair on --device in --dtype, and the memory the device has (prune/memory_plan.py)."""
    import torch

    from models.precision import dtype_name, resolve_dtype
    from prune.memory_plan import Workload, device_memory, plan_memory

    device = torch.device(args.device)
    if args.dtype != "auto":
        dtype = args.dtype
    elif device.type == "cuda" and not torch.cuda.is_available():
        dtype = "bfloat16"  # planning for a GPU from a machine without one: what current GPUs compute natively
    else:
        dtype = dtype_name(resolve_dtype("auto", device))
    plan = plan_memory(drafter_config, target_config, args.device, dtype, workload=Workload(batch_size=args.batch_size))
    return (plan, *device_memory(args.device))
