"""W&B tracking: every `prune run`, `prune score` and sweep trial is one W&B run (docs/design.md, Tracking and sweeps).

Mode: `WANDB_MODE` when set (online, offline, disabled); otherwise online when W&B credentials are
configured (WANDB_API_KEY, an identity token file, or a ~/.netrc entry for the W&B host) and offline
when they are not. Offline runs land in `<dir>/wandb/offline-run-*` (`wandb sync` uploads them later).

Failure policy: W&B never stops a pruning run. Any failure (wandb not installed, no network, a bad key,
an error while logging) prints one warning, and tracking stays off for the rest of the process, so a
sweep does not pay a network timeout per trial.

The metric names below are stable: the saved dashboard (prune.dashboard) and docs/design.md depend on them.
Per-step metrics are plotted against `pruning/layers_removed`, heal losses against `heal/update`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the run state's module imports torch; tracking reads the state it is given
    from .state import RunState, StepRecord

PROJECT = "d3d-prune"
STEP_AXIS = "pruning/layers_removed"
HEAL_AXIS = "heal/update"

# name -> meaning. History metrics, then tables and images, then summary values.
METRICS = {
    "pruning/layers_removed": "x-axis of the per-step metrics: layers removed so far (0 = the unpruned drafter)",
    "pruning/step": "pruning step (0 = the unpruned drafter)",
    "pruning/layers": "layers left in the drafter",
    "pruning/tau": "tau on the prompts that judge steps: check prompts, or calibration prompts without them "
                   "(async decoder; the macro mean over prompts)",
    "pruning/tau_before_heal": "that tau right after the removal, before healing",
    "pruning/retention": "that tau / the unpruned drafter's",
    "pruning/predicted_speedup": "predicted async speedup over target-only decoding",
    "pruning/heal_rolled_back": "1 when healing lowered tau and the pre-heal weights were kept",
    "pruning/head_rows": "rows of the drafter's head: its draft vocabulary's ids after a head step, its whole "
                         "head before any (head steps are logged beside layer steps, at the same layers removed)",
    "heal/update": "x-axis of heal losses: LoRA updates so far, over all steps",
    "heal/loss": "drafter loss of one LoRA update",
    "heal/step": "pruning step that the heal update belongs to",
    "layer_scores": "table: the scores of every remaining layer at one step (0-based layer indices)",
    "layer_scores_bar": "bar chart: score by original layer at one step (lower = less harmful to remove)",
    "layer_scores_heatmap": "table: (step, original layer, score) for every step, the heatmap's data",
    "plots/layer_scores": "image: the local heatmap of layer scores (report PNG)",
    "plots/tau_vs_layers_removed": "image: the local tau / predicted speedup curve (report PNG)",
    "plots/heal_loss": "image: the local heal loss curves (report PNG)",
    "base/tau": "summary: the unpruned drafter's tau on the prompts that judge steps",
    "base/predicted_speedup": "summary: unpruned predicted speedup",
    "final/tau": "summary: the same tau of the last step taken",
    "final/retention": "summary: its retention",
    "final/predicted_speedup": "summary: its predicted speedup",
    "final/layers": "summary: layers left",
    "final/head_rows": "summary: rows of its head (its draft vocabulary's ids, or its whole head)",
    "base/measured_speedup": "summary: unpruned async speedup over ar, measured on held-out prompts (prune.speed)",
    "base/measured_speedup_error": "summary: its standard error over those prompts (paired with ar's times)",
    "base/measured_predicted_speedup": "summary: the cost model's speedup for that measurement",
    "base/heldout_tau": "summary: unpruned tau on the held-out prompts of the speed check",
    "final/measured_speedup": "summary: final async speedup over ar, measured beside the unpruned one",
    "final/measured_speedup_error": "summary: its standard error over those prompts (paired with ar's times)",
    "final/measured_predicted_speedup": "summary: the cost model's speedup for that measurement",
    "final/heldout_tau": "summary: final tau on the held-out prompts of the speed check",
    "final/heldout_retention_error": "summary: standard error of final / unpruned held-out tau over those prompts",
    "final/layers_removed": "summary: layers removed",
    "final/stopped_by": "summary: the stop rule that ended the run",
    "sweep/eval_tau": "summary (trials): tau of the final drafter on the sweep's evaluation prompts",
    "sweep/eval_retention": "summary (trials): eval tau / unpruned eval tau (the Pareto objective)",
    "sweep/eval_predicted_speedup": "summary (trials): predicted speedup on the evaluation prompts",
    "sweep/cost": "summary (trials): drafter cost of the multi-objective mode (layers or packed-pass ms)",
    "sweep/state": "summary (trials): COMPLETE or PRUNED",
}
ARTIFACT_TYPE = "model"  # the final checkpoint of a run, artifact name `pruned-<drafter hash>`


@dataclass
class TrackingConfig:
    """Where and how a run is tracked.

    Attributes:
        mode: "online", "offline" or "disabled" (see `resolve_mode`).
        project, entity: the W&B project (entity None: the user's default).
        group: runs of one study share a group (the study name); job_type: run, score or trial.
        name: the run's display name; tags: e.g. the drafter hash.
        dir: the folder that receives `wandb/` (None: the working directory).
        init_timeout: seconds wandb.init may take (it waits for the server when online).
    """

    mode: str = "offline"
    project: str = PROJECT
    entity: str | None = None
    group: str | None = None
    job_type: str = "run"
    name: str | None = None
    tags: tuple[str, ...] = ()
    dir: str | None = None
    init_timeout: float = 90.0


def has_credentials(environ) -> bool:
    """Whether W&B credentials are configured (without asking the network)."""
    import netrc
    from urllib.parse import urlparse

    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    file = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        return netrc.netrc(file).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(environ, enabled: bool = True) -> str:
    """W&B mode from the environment: WANDB_MODE wins; otherwise online only with credentials."""
    if not enabled or environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode == "dryrun":
        return "offline"
    if mode in ("online", "offline", "disabled"):
        return mode
    return "online" if has_credentials(environ) else "offline"


def drafter_tag(drafter_hash: str) -> str:
    return f"drafter-{drafter_hash[:12]}"


_broken: str | None = None  # set by the first failure; tracking stays off in this process afterwards


def _warn_once(reason: str) -> None:
    global _broken
    if _broken is None:
        print(f"Warning: W&B tracking is off for this process ({reason}); the run goes on without it.",
              file=sys.stderr)
        _broken = reason


def _safe(method):
    """Run a Tracker method; any exception warns once and disables tracking (never raised)."""

    def wrapper(self, *args, **kwargs):
        if not self.active:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - W&B must never stop a run
            self._fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
            return None

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


class Tracker:
    """One W&B run, started on first use (so an output folder is validated before `wandb/` lands in it).

    `on_step` fits `RunHooks(on_step=...)` of prune.progressive; `finish(state, out)` logs what the run produced.
    """

    def __init__(self, config: TrackingConfig, run_config: dict):
        self.config = config
        self.run_config = run_config
        self.run = None
        self._started = False
        self._logged_steps: set[int] = set()
        self._heal_updates = 0

    @property
    def active(self) -> bool:
        return self.config.mode != "disabled" and _broken is None

    def _fail(self, reason: str) -> None:
        _warn_once(reason)
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass

    def _start(self):
        if self._started:
            return self.run
        self._started = True
        import wandb

        wandb.setup(settings=wandb.Settings(silent=True))  # no console messages from wandb in this process
        folder = self.config.dir
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project, entity=self.config.entity, group=self.config.group,
            job_type=self.config.job_type, name=self.config.name, tags=list(self.config.tags),
            config=self.run_config, dir=folder, mode=self.config.mode, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=self.config.init_timeout),
        )
        self.run.define_metric(STEP_AXIS)
        self.run.define_metric("pruning/*", step_metric=STEP_AXIS)
        self.run.define_metric(HEAL_AXIS)
        self.run.define_metric("heal/*", step_metric=HEAL_AXIS)
        return self.run

    @_safe
    def on_step(self, record: StepRecord, state: RunState) -> None:
        """After a pruning step: log the unpruned baseline (once) and every step not yet logged."""
        self._log_history(state)

    def _log_history(self, state: RunState) -> None:
        run = self._start()
        if 0 not in self._logged_steps:
            run.log({STEP_AXIS: 0, "pruning/step": 0, "pruning/layers": state.timing.layers,
                     "pruning/tau": state.base.tau, "pruning/retention": 1.0,
                     **_numbers({"pruning/predicted_speedup": state.base.predicted_speedup,
                                 "pruning/head_rows": _rows(state, 0)})})
            self._logged_steps.add(0)
        for record in state.history:
            if record.step not in self._logged_steps:
                self._log_step(run, record, state)
                self._logged_steps.add(record.step)

    def _log_step(self, run, record: StepRecord, state: RunState) -> None:
        import wandb

        for loss in record.heal_loss:
            self._heal_updates += 1
            run.log({HEAL_AXIS: self._heal_updates, "heal/loss": loss, "heal/step": record.step})
        scores = {}
        if record.scores:  # a head step scores no layer
            table = _score_table([asdict(s) for s in record.scores], record.step)
            scores = {"layer_scores": table,
                      "layer_scores_bar": wandb.plot.bar(table, "original_layer_name", "score",
                                                         title=f"layer scores at step {record.step} (0-based)")}
        run.log({
            STEP_AXIS: state.timing.layers - record.layers, "pruning/step": record.step,
            "pruning/layers": record.layers, "pruning/tau": record.tau,
            "pruning/tau_before_heal": record.tau_before_heal,
            "pruning/retention": record.retention, "pruning/heal_rolled_back": int(record.heal_rolled_back),
            **_numbers({"pruning/predicted_speedup": record.predicted_speedup,
                        "pruning/head_rows": _rows(state, record.step)}), **scores,
        })

    @_safe
    def log_scores(self, report: dict) -> None:
        """A `prune score` report: the score table, its bar chart and the baseline."""
        import wandb

        run = self._start()
        table = _score_table(report["layers"], 0)
        run.log({"layer_scores": table,
                 "layer_scores_bar": wandb.plot.bar(table, "original_layer_name", "score", title="layer scores")})
        run.summary.update(_numbers({"base/tau": (report["base"] or {}).get("tau"),
                                     "base/predicted_speedup": report.get("base_predicted_speedup")}))

    @_safe
    def finish(self, state: RunState | None = None, out=None, summary: dict | None = None, artifact_aliases=(),
               exit_code: int = 0) -> None:
        """Log the rest of a pruning run (history, heatmap table, report PNGs, summary, final checkpoint
        as a model artifact), any extra `summary`, and close the run. A run that failed before logging
        anything leaves no W&B run behind."""
        if not self._started and state is None and not summary:
            return
        run = self._start()
        if state is not None:
            self._log_final(run, state, Path(out) if out is not None else None, artifact_aliases)
        if summary:
            run.summary.update({k: v for k, v in summary.items() if v is not None})
        run.finish(exit_code=exit_code)
        self.run = None

    def _log_final(self, run, state: RunState, out: Path | None, aliases) -> None:
        import wandb

        self._log_history(state)
        if state.history:
            rows = [[h.step, s.original_layer, s.score] for h in state.history for s in h.scores]
            run.log({"layer_scores_heatmap": wandb.Table(columns=["step", "original_layer", "score"], data=rows)})
        if out is not None:
            images = {f"plots/{png.stem}": wandb.Image(str(png)) for png in sorted(out.glob("*.png"))}
            if images:
                run.log(images)
        run.summary.update(_numbers(_summary(state)))
        run.summary["final/stopped_by"] = str(state.stopped_by)
        if state.last is not None and out is not None:
            run.log_artifact(self._artifact(state, out), aliases=["latest", *aliases])

    def _artifact(self, state: RunState, out: Path):
        """The final checkpoint as a W&B model artifact, with its numbers as metadata."""
        import wandb

        last = state.last
        folder = (out / last.folder).resolve()
        artifact = wandb.Artifact(
            f"pruned-{self.config.tags[0] if self.config.tags else 'drafter'}", type=ARTIFACT_TYPE,
            description="pruned drafter: the last step of a prune run (plain Qwen3 checkpoint folder)",
            metadata={"tau": last.tau, "retention": last.retention, "layers": last.layers,
                      "head_rows": _rows(state, last.step),
                      "predicted_speedup": last.predicted_speedup, "source": state.source,
                      "removed_original": state.removed_original(), "stopped_by": str(state.stopped_by),
                      "local_path": str(folder)},
        )
        # Exports are written once and never modified, so W&B need not copy them to its staging area.
        artifact.add_dir(str(folder), policy="immutable")
        return artifact


def _summary(state: RunState) -> dict:
    """The run summary's numbers: the unpruned drafter, the last step taken and the measured speed check."""
    last, base = state.last, state.base
    summary = {
        "base/tau": base.tau, "base/predicted_speedup": base.predicted_speedup,
        "final/tau": last.tau if last else base.tau,
        "final/retention": last.retention if last else 1.0,
        "final/predicted_speedup": last.predicted_speedup if last else base.predicted_speedup,
        "final/layers": state.layers, "final/layers_removed": state.timing.layers - state.layers,
        "final/head_rows": _rows(state, last.step if last else 0),
        "final/equal_tau_speedup": state.equal_tau_speedup(state.layers, state.head_rows) if last else None,
    }
    speed = state.speed
    for name, row in (("base", speed and speed.base), ("final", speed and speed.final)):
        if row:
            summary.update({f"{name}/measured_speedup": row.measured_speedup,
                            f"{name}/measured_speedup_error": row.measured_speedup_error,
                            f"{name}/measured_predicted_speedup": row.predicted_speedup,
                            f"{name}/heldout_tau": row.tau})
    if speed and speed.retention_error is not None:
        summary["final/heldout_retention_error"] = speed.retention_error
    return summary


def _rows(state: RunState, step: int) -> int | None:
    """Rows of the drafter's head after `step` (0: the unpruned drafter's, as its timing measured them; None
    in a run timed before the head term)."""
    cut = [h.head_rows for h in state.history if h.step <= step and h.is_head_step]
    return cut[-1] if cut else (state.timing.draft.rows or None)


def _score_table(scores: list[dict], step: int):
    import wandb

    columns = ["step", "layer", "original_layer", "original_layer_name", "score", "delta_tau", "ci_low", "ci_high",
               "tau_without", "predicted_speedup"]
    rows = [[step, s["layer"], s["original_layer"], f"L{s['original_layer']:02d}", s["score"], s["delta_tau"],
             s["ci_low"], s["ci_high"], s["tau_without"], s["predicted_speedup"]] for s in scores]
    return wandb.Table(columns=columns, data=rows)


def _numbers(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def tracker_for(mode: str, project: str, run_config: dict, **fields) -> Tracker:
    """A Tracker; `mode` from `resolve_mode`. Fields as in TrackingConfig."""
    return Tracker(TrackingConfig(mode=mode, project=project, **fields), run_config)


def default_dir(out, environ) -> str | None:
    """Where `wandb/` goes: WANDB_DIR when the user set it, else the run's output folder (else the working
    directory). Passed explicitly: wandb reads its environment once per process."""
    return environ.get("WANDB_DIR") or (str(out) if out is not None else None)

