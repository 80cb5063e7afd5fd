"""Optuna as the sweeps use it: its experimental-feature warnings silenced where those features are used on purpose."""

import contextlib
import warnings

import optuna


@contextlib.contextmanager
def quiet_optuna():
    """Silence Optuna's experimental-feature warnings for the features used on purpose here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # We run trials with our own loop (for the budget) and record heartbeats ourselves (sweeps.study).
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield
