"""`prune train-drafter`: train a block-diffusion drafter from scratch on distillation data.

The flags and their help are here; their defaults are `prune.training.config.TRAIN_DRAFTER_DEFAULTS`, and
the work is `prune.training.driver.train_demo_drafter`.
"""

import argparse

from prune.training.config import TRAIN_DRAFTER_DEFAULTS as DEFAULTS

from . import _types as t
from ._common import add_command, add_debug
from ._settings import build

DESCRIPTION = "Train a block-diffusion drafter from scratch on distillation data of its target."


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "train-drafter",
        help="train a drafter from scratch on distillation data (builds the demo drafter)",
        description=DESCRIPTION + "\n\nexample:\n  prune distill --out data/distill\n"
        "  prune train-drafter --data data/distill --out my-drafter --steps 2000",
        common=("--data", "--out", "--target", "--steps", "--init-from", "--device", "--json", "--config"),
    )
    _add_data_args(parser)
    _add_loop_args(parser)
    _add_drafter_args(parser)
    _add_run_args(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from prune.training.driver import data_weights, train_demo_drafter, training_summary

    from ._common import quiet_libraries, resolve_device, write_json

    quiet_libraries()
    if args.device != "auto":  # a device this machine lacks fails before anything is built
        resolve_device(args.device)
    data_weights(args)  # as early: one weight per --data folder
    if args.split_idle and not args.init_from:
        from models.errors import ConfigError

        raise ConfigError("--split-idle splits the layers of a trained drafter; give it with --init-from DRAFTER")
    folder = train_demo_drafter(args, build(args, "train-drafter"))
    write_json(training_summary(folder), args.json)
    return 0


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Where the data, the target and the result are."""
    p.add_argument("--data", type=t.data_dir, required=True, nargs="+",
                   help="distillation data folder(s) (prune distill output)")
    p.add_argument("--data-weights", type=t.positive_int, nargs="+", default=None,
                   help="repeat each --data folder's training sequences this many times (default: 1 each)")
    p.add_argument("--out", type=t.output_dir, default=None,
                   help="output drafter folder (must not exist, or use --overwrite)")
    p.add_argument("--target", type=t.target_path, default=None,
                   help="target model folder (default: the one named in the data manifest)")


def _add_loop_args(p: argparse.ArgumentParser) -> None:
    """The training loop's settings (prune.training.config.TrainConfig)."""
    d = DEFAULTS
    p.add_argument("--steps", type=t.positive_int, default=d["steps"], help="optimizer updates")
    p.add_argument("--batch-size", type=t.positive_int, default=d["batch_size"], help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=t.positive_int, default=d["grad_accum"], help="micro-batches per update")
    p.add_argument("--lr", type=t.positive_float, default=d["lr"], help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=t.non_negative_int, default=d["warmup_steps"], help="linear warmup updates")
    p.add_argument("--blocks-per-sequence", type=t.positive_int, default=d["blocks_per_sequence"],
                   help="mask blocks at random anchors per sequence")
    p.add_argument("--max-length", type=t.positive_int, default=d["max_length"],
                   help="crop sequences to this many tokens")
    p.add_argument("--gamma", type=t.positive_float, default=d["gamma"],
                   help="slot weight decay w_i = exp(-(i-1)/gamma)")
    p.add_argument("--ar-weight", type=t.non_negative_float, default=d["ar_weight"],
                   help="lambda, weight of the AR loss")
    p.add_argument("--seed", type=t.non_negative_int, default=d["seed"],
                   help="seeds weights, data split, batches and anchors")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    """The drafter's sizes and where its weights start."""
    d = DEFAULTS
    p.add_argument("--layers", type=t.positive_int, default=d["layers"], help="decoder layers")
    p.add_argument("--hidden-size", type=t.positive_int, default=d["hidden_size"], help="model width")
    p.add_argument("--intermediate-size", type=t.positive_int, default=d["intermediate_size"], help="MLP width")
    p.add_argument("--heads", type=t.positive_int, default=d["heads"], help="attention heads")
    p.add_argument("--kv-heads", type=t.positive_int, default=d["kv_heads"], help="key/value heads")
    p.add_argument("--head-dim", type=t.positive_int, default=d["head_dim"], help="width of one head")
    p.add_argument("--block-size", type=t.block_size, default=d["block_size"], help="B, mask slots per block")
    p.add_argument("--init", choices=("slice", "pca", "random"), default=d["init"],
                   help="slice: start every layer from the target (one rotation of its residual stream, one key/value "
                   "group, the strongest MLP neurons; prune/training/transplant.py); pca: only the embedding from the "
                   "target's (PCA projection); random: nothing from the target")
    p.add_argument("--calibration-sequences", type=t.positive_int, default=d["calibration_sequences"],
                   help="--init slice: data sequences whose target activations choose the rotation, heads and neurons")
    p.add_argument("--init-from", type=t.drafter_dir, default=None,
                   help="start from this drafter folder instead of building one (sizes and --init ignored)")
    p.add_argument("--split-idle", type=t.non_negative_int, default=0, metavar="N",
                   help="with --init-from: replace its N layers with the smallest output projections (layers that "
                   "never learned) by copies of N trained layers spread over the rest, each split in two halves "
                   "(models/surgery.py split_layers); 0: keep the layers as they are")
    p.add_argument("--save-initial", type=t.output_dir, default=None,
                   help="only build the initial drafter (with its embedding init) and save it here, then exit")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Evaluation, checkpoints, limits and the machine."""
    d = DEFAULTS
    p.add_argument("--eval-tau", type=t.non_negative_int, default=0,
                   help="also measure real tau (async decoder, replayed trajectories) on this many held-out "
                   "sequences at every evaluation (0: off)")
    p.add_argument("--partial-data", action="store_true",
                   help="train on the finished shards of a distillation run that is still going")
    p.add_argument("--max-seconds", type=t.non_negative_float, default=d["max_seconds"],
                   help="stop training once this call has run this long (0: no limit)")
    p.add_argument("--max-mb", type=t.positive_float, default=d["max_mb"],
                   help="refuse drafters larger than this in bfloat16")
    p.add_argument("--eval-size", type=t.non_negative_int, default=d["eval_size"],
                   help="held-out sequences for evaluation")
    p.add_argument("--eval-data", type=t.data_dir, default=None,
                   help="draw the held-out sequences from this distillation folder instead of from --data (any "
                   "training sequence with one's prompt is dropped); e.g. fresh data when continuing a drafter")
    p.add_argument("--keep-best", action="store_true",
                   help="save the weights of the evaluation with the best held-out accept proxy, not the last")
    p.add_argument("--eval-every", type=t.non_negative_int, default=d["eval_every"],
                   help="evaluate every N updates (0: at the end)")
    p.add_argument("--checkpoint-every", type=t.non_negative_int, default=d["checkpoint_every"],
                   help="checkpoint every N updates (0: at the end)")
    p.add_argument("--checkpoint-dir", type=t.output_dir, default=None,
                   help="checkpoint folder (default: OUT-checkpoints); "
                   "an interrupted run with the same flags resumes from it")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoint folder after saving")
    p.add_argument("--device", type=t.device_or_auto, default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (default: on for CUDA, off for CPU)")
    p.add_argument("--threads", type=t.non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="OUT", default=None, type=t.output_file,
                   help="write a summary of the run (updates, seconds, sequences, last evaluation, kept best) as JSON "
                   "('-' = stdout)")
