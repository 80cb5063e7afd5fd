"""Layer scoring, progressive pruning, healing, export, reports, and the `prune` CLI.

Importing this package is cheap: no torch, transformers, wandb or optuna until a command needs them.
"""

__version__ = "0.1.0"
