"""One module per `prune` subcommand; each defines `add_parser(subparsers)` and sets `run` as default.

A command is listed here only once it works end to end.
"""

from . import bench, dashboard, distill, export, generate, heal, run, score, sweep, train_drafter, validate, vocab

COMMANDS = (bench, generate, score, run, heal, vocab, sweep, dashboard, export, validate, distill, train_drafter)
