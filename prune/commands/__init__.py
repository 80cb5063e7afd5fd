"""One module per `prune` subcommand; each defines `add_parser(subparsers)` and sets `run` as default.

A command is listed here only once it works end to end.
"""

from . import bench, distill, score, train_drafter, validate

COMMANDS = (bench, score, validate, distill, train_drafter)
