"""`prune train-drafter`: train a block-diffusion drafter from scratch on distillation data."""

from prune.training import driver as _train

from ._common import add_command, add_debug


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "train-drafter",
        help="train a drafter from scratch on distillation data (builds the demo drafter)",
        description=_train.DESCRIPTION + "\n\nexample:\n  prune distill --out data/distill\n"
        "  prune train-drafter --data data/distill --out my-drafter --steps 2000",
    )
    _train.add_arguments(parser)
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from ._common import quiet_libraries, resolve_device

    quiet_libraries()
    if args.device != "auto":  # a device this machine lacks fails before anything is built
        resolve_device(args.device)
    _train.data_weights(args)  # as early: one weight per --data folder
    _train.train_demo_drafter(args)
    return 0
