"""`prune heal`: one longer heal of a finished drafter (a `prune run` step), distilled from the drafter it
was pruned from, exported as a new folder.

The settings' defaults are `prune.config.FINISHING_HEAL`; docs/design.md (Healing a finished drafter) says why.
"""

from . import _types
from ._checkpoint_args import add_drafter_key_args, add_max_shard_size_arg, drafter_keys
from ._common import DTYPES, add_command, add_debug
from ._help import add_alias
from ._settings import build

EXAMPLES = """examples:
  prune heal pruned/final pruned-healed                       (a run on the demo pair: teacher and data known)
  prune heal pruned/final healed --train full --steps 480     (every decoder weight, three times as long)
  prune heal pruned/final healed --teacher D --data data/distill --steps 400"""
# Flags renamed to their settings' names (prune/commands/_settings.py); the old spellings still work.
OLD_FLAGS = {"--lora-rank": "--rank", "--lora-alpha": "--alpha", "--distill": "--distill-weight"}


def add_parser(subparsers) -> None:
    from prune.config import FINISHING_HEAL as H
    from prune.config import HEAL_WEIGHTS

    parser = add_command(
        subparsers,
        "heal",
        help="heal a pruned drafter with a longer fine-tune distilled from its unpruned source",
        description="Fine-tune SOURCE (e.g. OUT/final of `prune run`; LoRA adapters merged after, or every "
        "decoder weight: --train) so that its predictions match the drafter it was pruned from (KL, --distill-weight) "
        "on distillation data, and export the result to DESTINATION (plain Qwen3 folder, atomically). The "
        "training state is checkpointed beside DESTINATION every few updates; the same command resumes a "
        f"killed heal.\n\n{EXAMPLES}",
        common=("--teacher", "--data", "--steps", "--train", "--json", "--config"),
    )
    parser.add_argument("source", type=_types.drafter_dir, help="the pruned drafter folder to heal")
    parser.add_argument("destination", type=_types.output_dir,
                        help="new folder (must not exist or be empty unless --overwrite)")
    parser.add_argument("--teacher", type=_types.drafter_dir, default=None, metavar="DIR",
                        help="the drafter SOURCE was pruned from (default: the source its prune report records)")
    parser.add_argument("--data", type=_types.data_dir, nargs="+", default=None, metavar="DIR",
                        help="distillation data folders (prune distill output) (default: the demo drafter's "
                        "shipped folders when the teacher is the demo drafter; required otherwise)")
    parser.add_argument("--data-weights", type=_types.positive_int, nargs="+", default=None, metavar="W",
                        help="repeat each --data folder's sequences this many times (default: 1 each)")
    parser.add_argument("--steps", type=_types.positive_int, default=H.steps, help="optimizer updates")
    parser.add_argument("--train", choices=tuple(HEAL_WEIGHTS), default=H.train,
                        help="what trains: " + "; ".join(f"{name}: {w.help}" for name, w in HEAL_WEIGHTS.items()))
    parser.add_argument("--rank", type=_types.positive_int, default=H.rank, help="LoRA rank (--train lora)")
    parser.add_argument("--alpha", type=_types.positive_int, default=H.alpha,
                        help="LoRA alpha (scale = alpha / rank) (--train lora)")
    parser.add_argument("--lr", type=_types.positive_float, default=None,
                        help="peak learning rate (default: " + ", ".join(f"{w.lr:g} with --train {name}"
                                                                         for name, w in HEAL_WEIGHTS.items()) + ")")
    parser.add_argument("--gamma", type=_types.positive_float, default=H.gamma,
                        help="slot weight decay: draft slot i of a block weighs exp(-(i-1)/gamma) in the loss")
    parser.add_argument("--distill-weight", type=_types.fraction, default=H.distill_weight, metavar="W",
                        help="share of the loss that matches the teacher's predictions (KL) instead of the "
                        "target's tokens")
    parser.add_argument("--seed", type=_types.non_negative_int, default=H.seed,
                        help="seeds the adapter, batch order and anchors")
    parser.add_argument("--dtype", choices=("source", *DTYPES), default="source",
                        help="dtype of the exported weights; source: the dtype SOURCE's weights are stored in")
    add_max_shard_size_arg(parser)
    add_drafter_key_args(parser)
    parser.add_argument("--threads", type=_types.non_negative_int, default=0,
                        help="torch CPU threads (0: torch's default)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write a summary of the heal as JSON ('-' = stdout)")
    add_debug(parser)
    for old, flag in OLD_FLAGS.items():
        add_alias(parser, old, flag)
    parser.set_defaults(run=run)


def run(args) -> int:
    import torch

    from models.checkpoint import ensure_writable_output
    from models.errors import ConfigError
    from prune.config import HEAL_WEIGHTS
    from prune.export import resolve_export_dtype
    from prune.heal import heal_folder

    from ._common import quiet_libraries, write_json
    from ._heal import describe, heal_data, load_heal_examples

    quiet_libraries()
    ensure_writable_output(args.destination, args.overwrite)  # before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher = _teacher(args)
    chosen = heal_data(args.data, args.data_weights, teacher, flags="--data")
    if chosen is None:
        raise ConfigError("no healing data: give distillation folders of the teacher's target with --data DIR "
                          "(prune distill output)")
    examples = load_heal_examples(*chosen)
    config = build(args, "heal", {"lr": args.lr if args.lr is not None else HEAL_WEIGHTS[args.train].lr})
    config.validate()
    dtype = resolve_export_dtype(args.dtype, args.source)
    record = heal_folder(args.source, args.destination, teacher, examples, config, describe(*chosen), dtype=dtype,
                         overwrite=args.overwrite, progress=not args.no_progress and args.json != "-",
                         drafter_keys=drafter_keys(args), max_shard_size=args.max_shard_size)
    write_json({"destination": args.destination, **record}, args.json)
    if args.json != "-":
        print(args.destination)
    return 0


def _teacher(args) -> str:
    """--teacher, or the unpruned drafter that SOURCE's prune report names."""
    from pathlib import Path

    from models.errors import ConfigError
    from prune.export import read_report

    if args.teacher:
        return args.teacher
    recorded = read_report(args.source)[0].get("source")
    if not recorded or not Path(recorded).is_dir():
        raise ConfigError(f"{args.source} does not record the drafter it was pruned from"
                          + (f" ({recorded} is gone)" if recorded else "") + "; name it with --teacher DIR")
    return recorded
