"""Optuna sweeps over pruning settings: many workers, one study, W&B runs grouped by study.

- `sweeps.config`: the sweep's settings, their defaults and choices: SweepConfig, COSTS, MODES, PRUNERS.
- `sweeps.space`: the search space (a TOML file; `default_space.toml` ships): SearchSpace.
- `sweeps.storages`: the storage schemes (SQLite, PostgreSQL/MySQL, journal files): SCHEMES, make_storage.
- `sweeps.objective`: one pruning campaign per trial (prune.progressive.run_pruning): SweepData,
  PruningObjective.
- `sweeps.study`: the study-wide trial budget, heartbeats and retries, summaries: open_study, run_worker,
  summarize.

Importing this package, `sweeps.config`, `sweeps.space` or `sweeps.storages` imports nothing heavy; the
other modules import optuna and torch.
"""
