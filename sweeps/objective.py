"""The Optuna objective: one pruning campaign per trial, through `prune.progressive.run_pruning`.

A trial draws settings from the search space, runs the campaign into OUT/trial-NNNN (the number is the
trial's, unique in the study), then measures the final drafter on the sweep's *evaluation* prompts, a
fixed set shared by every trial: the calibration size is itself searched, so calibration tau is not a
fair yardstick between trials.

Modes (docs/design.md, Tracking and sweeps):
- single-objective (`directions=("maximize",)`): maximize the predicted speedup of the final drafter on
  the evaluation prompts, subject to eval retention >= `retention_floor` (an Optuna constraint: samplers
  and `best_trial` prefer feasible trials). Every campaign also refuses steps below the floor on its
  calibration prompts (`min_retention` is raised to it).
- multi-objective (`directions=("maximize", "minimize")`): eval retention vs drafter cost (layers left,
  or the predicted packed-pass time); `study.best_trials` is the Pareto front.

After each step the trial reports its calibration retention at "layers removed so far" (comparable
between trials with different per-step k), and the pruner (median by default) may stop it: the campaign
then ends after that step (OUT/final and the report are written) and the trial is PRUNED. Optuna's
pruners handle single-objective studies only, so multi-objective trials are never pruned.

Predicted speedups and packed-pass costs come from one timing (decode.cost) of the drafter and the target,
measured by the study's first trial and stored in the study's user attributes
(`timing/packed_budget=N/DEVICE/DTYPE`, e.g. `timing/packed_budget=64/cuda/bfloat16`: workers computing
on another kind of device or in another dtype measure their own): trials compare what they pruned, not
how busy the machine was while each one measured.

Each trial's user attributes hold where its checkpoint is and what it measured (sweeps.study.TRIAL_ATTRS). They are
set only once the campaign has returned and its last export has been checked whole (`exported_checkpoint`),
so a worker killed while a trial exports leaves that trial without a checkpoint: RUNNING until the
heartbeats of another worker mark it FAIL and queue its retry (sweeps/study.py), which runs in a folder of
its own (trial numbers are unique).
"""

import functools
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import optuna

from decode.cost import PassTimes
from models.drafter import load_drafter
from models.errors import CheckpointError, ConfigError
from models.precision import dtype_name
from prune.config import RunConfig
from prune.export import REPORT_NAME, verify_export
from prune.progressive import Campaign, RunHooks, config_record, run_pruning
from prune.scoring import Evaluation, evaluate
from prune.state import RunState, StepRecord, Timing, campaign_timing
from prune.trajectories import HasSource

from ._optuna import quiet_optuna
from .config import SweepConfig
from .space import HEAL_NAMES, VOCAB_NAMES, SearchSpace


@dataclass
class SweepData(HasSource):
    """What every trial of one worker shares, loaded once: the pair, prompts and trajectories, heal data.

    `source`: where the target's trajectories come from (prune.trajectories.TrajectorySource: the live target, or
    a recorded file of its outputs, whose target's weights are not loaded; a loaded target model is taken as its
    live source); `target` is its loaded target (None with a recorded file alone).

    `calibration` holds at least as many prompts as the space's largest calibration size; a trial uses
    the first `calibration_prompts` of them. `evaluation` prompts measure every trial's final drafter.
    `pass_times`: the pair's measured pass times for the sweep's own decoder settings (`SweepConfig.score`),
    the start of the study's timing as of `prune run`'s; `cache`: the cache folder (prune.cache) that trials
    share with `prune score` and `prune run`; `heal_data`: how a trial's record names the healing examples
    (prune.progressive.Campaign.heal_data); `vocab_ranking`: the ids head steps keep (prune.vocab.TokenRanking;
    None: no head steps).
    """

    drafter: object
    drafter_dir: str
    source: object
    calibration: list[list[int]]
    calibration_trajectories: list | None
    evaluation: list[list[int]]
    evaluation_trajectories: list | None
    heal_examples: list | None = None
    drafter_hash: str = ""
    pass_times: PassTimes | None = None
    cache: Path | None = None
    heal_data: list[str] | None = None
    vocab_ranking: object = None


def campaign_config(values: dict, config: SweepConfig) -> tuple[RunConfig, int | None]:
    """The RunConfig of one trial from its drawn values, and its calibration size (None: all prompts)."""
    score = replace(config.score, criterion=values.get("criterion", config.score.criterion),
                    decode=replace(config.score.decode,
                                   packed_budget=values.get("packed_budget", config.score.decode.packed_budget)),
                    seed=config.seed)
    heal = replace(config.heal, steps=values.get("heal_steps", config.heal.steps),
                   rank=values.get("lora_rank", config.heal.rank), alpha=values.get("lora_alpha", config.heal.alpha),
                   lr=values.get("heal_lr", config.heal.lr), seed=config.seed)
    floor = values.get("vocab_size")  # head steps down to this size (0: none); unset: every size of the sweep's
    sizes = config.vocab_sizes if floor is None else tuple(s for s in config.vocab_sizes if floor and s >= floor)
    run = RunConfig(layers_to_remove=values.get("layers_to_remove"),
                    min_retention=max(values.get("min_retention", config.retention_floor), config.retention_floor),
                    per_step=values.get("per_step", 1), stop_on_speedup=values.get("stop_on_speedup", True),
                    check_prompts=0,  # a trial is judged on the sweep's evaluation prompts (measure)
                    vocab_sizes=sizes, score=score, heal=heal)
    return run, values.get("calibration_prompts")


def check_layer_budget(space: SearchSpace, layers: int) -> None:
    """Refuse a space whose layers_to_remove or per_step would leave a drafter of `layers` layers none."""
    for setting in ("layers_to_remove", "per_step"):
        if space.largest(setting, 1) > layers - 1:
            raise ConfigError(f"search space {space.source}: {setting} reaches {space.largest(setting, 1)} but the "
                              f"drafter has {layers} layers (at least one must remain); lower it in --space")


def check_space(space: SearchSpace, data: SweepData) -> SearchSpace:
    """Refuse a space that cannot run on this pair and these prompts; drop healing without heal data."""
    check_layer_budget(space, data.drafter.config.num_hidden_layers)
    wanted = space.largest("calibration_prompts", len(data.calibration))
    if wanted > len(data.calibration):
        raise ConfigError(f"search space {space.source}: calibration_prompts reaches {wanted} but only "
                          f"{len(data.calibration)} calibration prompts are loaded; raise --limit or lower it")
    if not data.heal_examples:
        space = space.without(HEAL_NAMES)
    if data.vocab_ranking is None:
        space = space.without(VOCAB_NAMES)
    return space


def exported_checkpoint(out: Path, folder: str) -> str:
    """OUT/final as a trial records it, once checked to be the complete export of step `folder`: the link
    points at it and every file hashes as its report lists (prune.export.verify_export)."""
    final = out / "final"
    complete = final.resolve() == (out / folder).resolve() and (final / REPORT_NAME).is_file()
    if not complete or verify_export(final):
        raise CheckpointError(f"{final} is not the complete export of {out / folder}; the trial records no "
                              "checkpoint (rerun it)")
    return str(out.resolve() / "final")


def study_timing_key(score, drafter) -> str:
    """The study user attribute that holds the timing of `drafter` (on its device, in its dtype) for
    `score`'s packed budget."""
    weight = next(drafter.parameters())
    return (f"timing/packed_budget={score.decode.packed_budget}/{weight.device.type}/"
            f"{dtype_name(weight.dtype)}")


class PruningObjective:
    """Callable(trial) -> objective value(s); see the module docstring.

    `tracker_factory(trial, run_config_record)` returns a prune.tracking.Tracker (or None) per trial.
    """

    def __init__(self, config: SweepConfig, space: SearchSpace, data: SweepData, tracker_factory=None,
                 log=print):
        self.config, self.data, self.log = config, data, log
        self.space = check_space(space, data)
        self.tracker_factory = tracker_factory
        self._base_eval = None

    def study_timing(self, trial, score, wait_s: float = 600.0) -> dict:
        """The unpruned drafter's pass times for `score`'s packed budget, measured once per study: the
        prune.state.Timing record as the study keeps it (`Timing.to_dict()`).

        The first trial to need them stores them in the study's user attributes; every later trial, in any
        worker, reads them back, so trials differ by what they pruned, not by the machine's load while each
        measured. A trial that finds none waits while an earlier-numbered trial is still running (it is
        measuring them), at most `wait_s` seconds, so that two workers starting together agree. They are
        measured as `prune run` measures them (prune.state.campaign_timing, from the sweep's pass times when
        the budget is the sweep's own, and through the cache), so trials share scoring rounds with it.
        """
        key = study_timing_key(score, self.data.drafter)
        deadline = time.monotonic() + wait_s
        study = trial.study
        while True:
            stored = study.user_attrs.get(key)
            if stored is not None:
                return stored
            with quiet_optuna():
                optuna.storages.fail_stale_trials(study)  # a dead worker's trial stops counting as running
            earlier = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            if not any(t.number < trial.number for t in earlier) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        own_budget = score.decode.packed_budget == self.config.score.decode.packed_budget
        timing = campaign_timing(self.data.drafter, score, self.data.source,
                                 self.data.pass_times if own_budget else None, self.data.cache).to_dict()
        study.set_user_attr(key, timing)
        return timing

    def base_evaluation(self) -> Evaluation:
        """The unpruned drafter on the evaluation prompts (measured once per worker)."""
        if self._base_eval is None:
            self._base_eval = evaluate(self.data.drafter, self.data.evaluation, self.config.score,
                                       self.data.evaluation_trajectories, self.data.target)
        return self._base_eval

    def __call__(self, trial):
        values = self.space.suggest(trial)
        run_config, calibration = campaign_config(values, self.config)
        out = self._trial_folder(trial)
        tracker = self._tracker(trial, values, run_config, out)
        pruned = []
        data = self.data
        trajectories = data.calibration_trajectories
        campaign = Campaign(data.drafter, data.drafter_dir, data.calibration[:calibration], data.source,
                            trajectories[:calibration] if trajectories is not None else None,
                            data.heal_examples if run_config.heal.steps else None, data.cache,
                            heal_data=data.heal_data, vocab_ranking=data.vocab_ranking)
        hooks = RunHooks(log=lambda message: self.log(f"trial {trial.number}: {message}"),
                         on_step=functools.partial(self._on_step, trial, tracker, pruned))
        try:
            timing = Timing.from_dict(self.study_timing(trial, run_config.score))
            state = run_pruning(campaign, out, run_config, timing=timing,
                                export_dtype=self.config.export_dtype, hooks=hooks,
                                max_shard_size=self.config.max_shard_size)
            metrics = self.measure(state, out)
        except BaseException:
            if tracker is not None:
                tracker.finish(exit_code=1)
            raise
        self._record(trial, metrics)
        if tracker is not None:
            summary = {f"sweep/{k}": metrics[k] for k in ("eval_tau", "eval_retention", "cost")}
            summary["sweep/eval_predicted_speedup"] = metrics["predicted_speedup"]
            summary["sweep/state"] = "PRUNED" if pruned else "COMPLETE"
            tracker.finish(state, out, summary=summary, artifact_aliases=[f"trial-{trial.number:04d}"])
        if pruned:
            raise optuna.TrialPruned(state.stopped_by)
        values_out = [metrics[name] for name in self.config.objective_names()]
        return values_out[0] if len(values_out) == 1 else tuple(values_out)

    def _trial_folder(self, trial) -> Path:
        """OUT/trial-NNNN, refused when it holds files; the trial records where it runs."""
        out = Path(self.config.out) / f"trial-{trial.number:04d}"
        if out.exists() and any(out.iterdir()):
            raise CheckpointError(f"{out} already holds files (from another study?); use another --out for "
                                  f"study {self.config.study!r}")
        trial.set_user_attr("trial_dir", str(out.resolve()))
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        return out

    def _tracker(self, trial, values: dict, run_config: RunConfig, out: Path):
        """The trial's W&B tracker (None without a tracker factory)."""
        if self.tracker_factory is None:
            return None
        return self.tracker_factory(trial, {
            "trial": {"study": self.config.study, "number": trial.number, "params": dict(trial.params)},
            "values": values, "settings": config_record(run_config), "sweep": self.config.record(),
            "drafter": self.data.drafter_dir, "drafter_hash": self.data.drafter_hash, "out": str(out)})

    def _on_step(self, trial, tracker, pruned: list, record: StepRecord, state: RunState) -> str | None:
        """After each step: track it, report the calibration retention at the layers removed so far, and stop
        the campaign (its reason; the layers removed go to `pruned`) when the Optuna pruner says so."""
        if tracker is not None:
            tracker.on_step(record, state)
        if self.config.multi_objective or record.is_head_step:  # the pruner reads retention by layers removed
            return None
        removed = state.timing.layers - record.layers
        trial.report(record.retention, removed)
        if trial.should_prune():
            pruned.append(removed)
            return (f"pruned by the Optuna pruner after {removed} layers removed "
                    f"(calibration retention {record.retention:.4f})")
        return None

    def _record(self, trial, metrics: dict) -> None:
        """The trial's user attributes (sweeps.study.TRIAL_ATTRS) and, single-objective, its constraint."""
        for name, value in metrics.items():
            trial.set_user_attr(name, value)
        if not self.config.multi_objective:
            trial.set_constraint("retention_floor", self.config.retention_floor - metrics["eval_retention"])

    def measure(self, state: RunState, out: Path) -> dict:
        """What a finished campaign achieved, on its calibration prompts and on the evaluation prompts."""
        timing, base, last, rows = state.timing, self.base_evaluation(), state.last, state.head_rows
        if last is None:
            final, checkpoint, layers = base, self.data.drafter_dir, timing.layers
        else:
            compute = next(self.data.drafter.parameters())  # the run's device and dtype, as the campaign's
            drafter = load_drafter(out / last.folder, compute.dtype, compute.device)
            final = evaluate(drafter, self.data.evaluation, self.config.score, self.data.evaluation_trajectories,
                             self.data.target)
            checkpoint, layers = exported_checkpoint(out, last.folder), last.layers
            del drafter
        speedup = final.predicted_speedup(timing.pass_times(layers, rows))
        packed_ms = timing.packed_ms(layers, rows)
        return {
            "checkpoint": str(checkpoint), "tau": last.tau if last else state.base.tau,
            "retention": last.retention if last else 1.0, "eval_tau": final.tau,
            "eval_retention": final.tau / base.tau if base.tau else 0.0,
            "predicted_speedup": speedup if speedup is not None else 0.0, "layers": layers, "head_rows": rows,
            "layers_removed": timing.layers - layers, "packed_pass_ms": packed_ms,
            "cost": layers if self.config.cost == "layers" else packed_ms, "stopped_by": str(state.stopped_by),
        }
