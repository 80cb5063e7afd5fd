"""One module per `prune` subcommand; each defines `add_parser(subparsers)` and sets `run` as default.

A command is listed here only once it works end to end.
"""

from . import bench, distill, run, score, train_drafter, validate

COMMANDS = (bench, score, run, validate, distill, train_drafter)
