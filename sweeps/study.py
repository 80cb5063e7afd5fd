"""Studies shared by many workers: samplers, the study-wide trial budget, heartbeats, summaries.

Storages are URLs (sweeps.storages: SQLite, PostgreSQL/MySQL, journal files). Database storages get
heartbeats: a running trial records one every `heartbeat` seconds (`_Heartbeat` here), and a trial silent
for `grace` seconds is marked FAIL by the next worker that looks and re-queued once. Journal storages have
no heartbeats: a killed worker's trial stays RUNNING (docs/design.md, Tracking and sweeps).

The budget (`n_trials`) is study-wide: however many workers run, exactly `n_trials` trials end COMPLETE
or PRUNED. Trial numbers are the storage's atomic counter, so each worker:
  1. counts the study's trials; stops when n_trials are COMPLETE/PRUNED; if the rest of the budget is
     held by RUNNING trials (and none is WAITING), waits for them (with heartbeats: a dead one turns into
     a WAITING retry that this worker then runs) instead of starting more;
  2. asks for a trial (a queued WAITING retry first), then counts the trials *numbered below it* that are
     COMPLETE, PRUNED, RUNNING or WAITING. If they already fill the budget, another worker won the race
     for the last slot: the trial is told FAIL with user attribute `over_budget` and never evaluated;
  3. otherwise evaluates it. A trial that fails (an error, Ctrl-C, a dead worker) frees its slot.
Trials below a given number never become more numerous, so two workers cannot both take the last slot,
and a slot is only given up when a trial fails, which the loop then refills.
"""

import gc
import threading
import time

import optuna
from optuna.trial import TrialState

from models.errors import ConfigError, one_of

from ._optuna import quiet_optuna
from .config import PRUNERS

OVER_BUDGET = "over_budget"
META_KEY = "d3d_prune"  # study user attribute: the mode and search space the study was created with
# What every trial records in its user attributes (set by sweeps.objective, read by the summaries).
TRIAL_ATTRS = ("checkpoint", "host", "worker", "trial_dir", "tau", "retention", "eval_tau", "eval_retention",
               "predicted_speedup", "layers", "layers_removed", "head_rows", "packed_pass_ms", "cost", "stopped_by")


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """A TPE sampler made afresh for each trial, seeded with (seed, trial number).

    Workers that share a seed would otherwise draw the same parameters in the same order; trial numbers
    are unique in a study, so seeding by them gives distinct draws and keeps a one-worker sweep
    reproducible. TPE needs no state besides its random generator (it reads the history from the
    storage), and handles single- and multi-objective studies and their constraints.
    """

    def __init__(self, seed: int = 0, n_startup_trials: int = 5):
        self.seed, self.n_startup_trials = seed, n_startup_trials
        self._inner = self._make(0)

    def _make(self, number: int):
        return optuna.samplers.TPESampler(seed=(self.seed * 1_000_003 + number) % 2**32,
                                          n_startup_trials=self.n_startup_trials)

    def before_trial(self, study, trial):
        self._inner = self._make(trial.number)
        self._inner.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, name, distribution):
        return self._inner.sample_independent(study, trial, name, distribution)

    def after_trial(self, study, trial, state, values):
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self):
        self._inner.reseed_rng()


def open_study(name: str, storage, directions, meta: dict, seed: int = 0, pruner: str = PRUNERS[0]):
    """Create the study or join it; refuse to join one made with other directions or another space."""
    if pruner not in PRUNERS:
        raise ConfigError(f"unknown pruner {pruner!r}; choose {one_of(PRUNERS)} (--pruner)")
    multi = len(directions) > 1
    chosen = (optuna.pruners.NopPruner() if pruner == "none" or multi
              else optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with quiet_optuna():
        study = optuna.create_study(study_name=name, storage=storage, directions=list(directions),
                                    sampler=TrialSeededSampler(seed), pruner=chosen, load_if_exists=True)
    wanted = [optuna.study.StudyDirection.MAXIMIZE if d == "maximize" else optuna.study.StudyDirection.MINIMIZE
              for d in directions]
    if list(study.directions) != wanted:
        have = " ".join(d.name.lower() for d in study.directions)
        raise ConfigError(f"study {name!r} exists with --directions {have}; use those or another --study")
    stored = study.user_attrs.get(META_KEY)
    if stored is None:
        study.set_user_attr(META_KEY, meta)
        with quiet_optuna():
            study.set_metric_names(list(meta["objectives"]))
    elif stored != meta:
        changed = sorted(k for k in set(stored) | set(meta) if stored.get(k) != meta.get(k))
        raise ConfigError(f"study {name!r} was created with other sweep settings ({', '.join(changed)}); rerun "
                          "with the same --space, --directions, --retention-floor and --cost, or use another --study")
    return study


def state_counts(study) -> dict[str, int]:
    counts = {state.name: 0 for state in TrialState}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] += 1
    counts["OVER_BUDGET"] = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get(OVER_BUDGET))
    return counts


def _ahead(study, number: int) -> int:
    """Trials numbered below `number` that hold a slot of the budget."""
    holding = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=holding)
               if t.number < number and not t.user_attrs.get(OVER_BUDGET))


class _Heartbeat:
    """Records a running trial's heartbeat every interval (RDB storages with heartbeats only)."""

    def __init__(self, storage, trial_id: int):
        interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.interval:
            self.storage.record_heartbeat(self.trial_id)
            self.thread = threading.Thread(target=self._beat, daemon=True)
            self.thread.start()
        return self

    def _beat(self):
        while not self.stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # noqa: BLE001 - a missed beat is retried; a long outage fails the trial
                pass

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def run_worker(study, storage, objective, n_trials: int | None, timeout: float | None = None, poll: float = 2.0,
               log=print) -> str:
    """Evaluate trials of `study` until it holds `n_trials` COMPLETE/PRUNED trials (or `timeout` seconds
    pass); returns why it stopped. An error in the objective marks its trial FAIL and is raised."""
    if n_trials is not None and n_trials < 1:
        raise ConfigError(f"--n-trials {n_trials} must be at least 1")
    budget = n_trials if n_trials is not None else float("inf")  # None: until the timeout
    heartbeats = bool(getattr(storage, "get_heartbeat_interval", lambda: None)())
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        with quiet_optuna():
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial -> FAIL -> a WAITING retry
        counts = state_counts(study)
        done = counts["COMPLETE"] + counts["PRUNED"]
        if done >= budget:
            return f"the study holds {done} finished trials (budget {n_trials})"
        if counts["WAITING"] == 0 and done + counts["RUNNING"] >= budget:
            if not heartbeats:
                return (f"the rest of the budget is held by {counts['RUNNING']} running trial(s); this storage "
                        "has no heartbeats, so this worker does not wait for them")
            time.sleep(poll)
            continue
        with quiet_optuna():
            trial = study.ask()
        if _ahead(study, trial.number) >= budget:
            trial.set_user_attr(OVER_BUDGET, True)
            study.tell(trial, state=TrialState.FAIL)
            log(f"trial {trial.number}: the budget of {n_trials} trials was taken by other workers; not run")
            continue
        _evaluate(study, storage, trial, objective, log)
        gc.collect()
    return f"--timeout reached ({timeout} s)"


def _evaluate(study, storage, trial, objective, log) -> None:
    try:
        # Trial has no public id; the storage's heartbeat API takes the internal one.
        with _Heartbeat(storage, trial._trial_id):
            values = objective(trial)
    except optuna.TrialPruned as pruned:
        _tell(study, trial, log, state=TrialState.PRUNED)
        log(f"trial {trial.number}: pruned ({pruned})")
        return
    except BaseException:
        _tell(study, trial, log, state=TrialState.FAIL)
        raise
    _tell(study, trial, log, values=values)
    log(f"trial {trial.number}: finished with {values}")


def _tell(study, trial, log, **kwargs) -> None:
    try:
        study.tell(trial, **kwargs)
    except optuna.exceptions.UpdateFinishedTrialError:
        # Another worker saw no heartbeat for longer than the grace period and failed (and re-queued) it.
        log(f"trial {trial.number}: was marked failed by another worker (missed heartbeats); its retry counts instead")


def trial_record(trial) -> dict:
    """A trial as JSON: number, state, objective values, parameters and what the objective recorded."""
    return {"number": trial.number, "state": trial.state.name, "values": trial.values, "params": trial.params,
            **{name: trial.user_attrs.get(name) for name in TRIAL_ATTRS},
            "retry_of": trial.system_attrs.get("failed_trial")}


def summarize(study) -> dict:
    """The study's trial counts and its best trial (single objective) or Pareto front (multi-objective).

    The best trial is the feasible one (eval retention at or above the floor) with the highest predicted
    speedup; the Pareto front holds the COMPLETE trials that no other trial dominates, by cost.
    """
    meta = study.user_attrs.get(META_KEY, {})
    summary = {"study": study.study_name, "directions": [d.name.lower() for d in study.directions],
               "objectives": meta.get("objectives"), "retention_floor": meta.get("retention_floor"),
               "counts": {k: v for k, v in state_counts(study).items() if v}}
    if len(study.directions) > 1:
        front = sorted(study.best_trials, key=lambda t: (t.values[1], -t.values[0], t.number))
        summary["pareto_front"] = [trial_record(t) for t in front]
    else:
        try:
            summary["best"] = trial_record(study.best_trial)
        except ValueError:  # no COMPLETE (feasible) trial yet
            summary["best"] = None
        summary["tradeoff_front"] = [trial_record(t) for t in tradeoff_front(study.trials)]
    return summary


def tradeoff_front(trials) -> list:
    """COMPLETE trials that no other COMPLETE trial beats on both eval retention (higher) and cost (lower).

    A single-objective study optimises speedup alone; this front shows, from the attributes every trial
    records, which checkpoints trade retention for size best - the front a multi-objective study searches.
    Sorted by cost, then trial number.
    """
    done = [t for t in trials if t.state == TrialState.COMPLETE
            and t.user_attrs.get("eval_retention") is not None and t.user_attrs.get("cost") is not None]

    def point(t):
        return t.user_attrs["eval_retention"], t.user_attrs["cost"]

    def dominated(t):
        r, c = point(t)
        return any(ro >= r and co <= c and (ro, co) != (r, c) for ro, co in map(point, done))

    return sorted((t for t in done if not dominated(t)), key=lambda t: (point(t)[1], t.number))
