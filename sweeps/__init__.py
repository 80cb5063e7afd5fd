"""Optuna sweeps over pruning settings: many workers, one study, W&B runs grouped by study.

- `sweeps.space`: the search space (a TOML file; `default_space.toml` ships): SearchSpace.
- `sweeps.objective`: one pruning campaign per trial (prune.progressive.run_pruning): SweepConfig,
  SweepData, PruningObjective.
- `sweeps.study`: storages (SQLite, PostgreSQL/MySQL, journal files), the study-wide trial budget,
  heartbeats and retries, summaries: make_storage, open_study, run_worker, summarize.

Importing this package imports nothing heavy; its modules import optuna and torch.
"""
