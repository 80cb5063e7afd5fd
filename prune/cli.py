"""The `prune` command line: parses arguments, dispatches to one command module, maps errors to exit codes.

Exit codes: 0 success; 1 a known error (printed as `Error: ...`, traceback only with --debug);
2 a usage error (argparse; one line, `prune CMD: error: ...; see prune CMD --help`, from the shared
argument types of prune/commands/_types.py). stdout carries data (tables, JSON); progress and logs go to stderr.
Importing this module does not import torch, transformers, wandb or optuna.
"""

import argparse
import sys

from . import __version__
from .commands import COMMANDS
from .commands._common import Parser

DESCRIPTION = """\
Prune block-diffusion speculative drafters (D3D-style) by their impact on acceptance length.

Commands measure and transform a drafter/target pair: a drafter is a Qwen3 checkpoint folder (one
model.safetensors or sharded) whose config.json carries block_size and mask_token_id (at the top level or in
a block such as dflash_config; --block-size / --mask-token-id give them otherwise); a target is any local
causal-LM folder or .gguf file.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="prune", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"d3d-prune {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None  # a --config file is read while parsing: its errors are known errors too
    try:
        args = parser.parse_args(argv)
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
        from models.errors import D3DError

        if getattr(args, "debug", False) or not isinstance(exc, D3DError):
            raise
        print(f"Error: {exc}", file=sys.stderr)
        return 1
