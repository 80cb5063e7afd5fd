"""Optuna studies over pruning settings, and W&B grouping of their trials (not built yet)."""
