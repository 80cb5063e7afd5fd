"""Progressive pruning (docs/design.md, Progressive pruning): score -> remove -> heal -> measure -> export, repeated.

Each step scores the remaining layers (prune.scoring), removes the `per_step` least harmful ones, heals
with LoRA (prune.heal) and keeps the healed weights only if they do not lower calibration tau, then
exports the step to OUT/step-XX and records it in OUT/state.json. The run stops at a layer budget, at a
retention floor, or when predicted speedup stops improving (a step that breaks a rule is not taken); the
state says which rule stopped it. A run resumes from its last completed step, and an unfinished scoring round
from its last evaluated layer (prune.journal): a run killed at any moment and resumed ends with the same
steps, byte for byte, as one never interrupted.

Predicted speedup (decode.cost) uses pass times measured once at the start and stored in the state: the
target's, and the drafter's as affine functions of depth (fitted on the unpruned drafter and a half-depth
copy), so decisions never depend on the timing noise of a later step and a resumed run decides exactly
as an uninterrupted one.
"""

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from models.checkpoint import atomic_symlink, atomic_write_text, ensure_writable_output
from models.drafter import load_drafter
from models.errors import CheckpointError, ConfigError
from models.surgery import remove_layers

from .export import export_step, resolve_export_dtype, round_to_dtype
from .heal import HealConfig, heal
from .journal import ScoringJournal, remove_journals
from .progress import progress_bar
from .report import write_report
from .scoring import Evaluation, ScoreConfig, evaluate, placement, score_layers

STATE_NAME = "state.json"
_silent = functools.partial(progress_bar, enabled=False)


@dataclass
class RunConfig:
    """Settings of a pruning campaign.

    Attributes:
        layers_to_remove: stop after removing this many layers (None: only the other rules stop).
        min_retention: never take a step whose calibration tau falls below this fraction of the unpruned tau.
        per_step: layers removed per step.
        stop_on_speedup: stop when predicted speedup does not improve over the previous step.
        score: scoring settings (criterion, verify mode, decoding).
        heal: LoRA healing settings (steps = 0 disables healing).
    """

    layers_to_remove: int | None = None
    min_retention: float = 0.99
    per_step: int = 1
    stop_on_speedup: bool = True
    score: ScoreConfig = field(default_factory=ScoreConfig)
    heal: HealConfig = field(default_factory=HealConfig)

    def validate(self, num_layers: int) -> None:
        if not 0 < self.min_retention <= 1:
            raise ConfigError(f"--min-retention {self.min_retention} must be in (0, 1]")
        if self.per_step < 1:
            raise ConfigError(f"--per-step {self.per_step} must be at least 1")
        if self.layers_to_remove is not None and not 0 < self.layers_to_remove < num_layers:
            raise ConfigError(
                f"--layers-to-remove {self.layers_to_remove} must be in 1..{num_layers - 1}: the drafter has "
                f"{num_layers} layers and at least one must remain"
            )
        self.score.validate()
        self.heal.validate()


def save_state(out, state: dict) -> None:
    """Write OUT/state.json atomically."""
    out = Path(out)
    atomic_write_text(out / STATE_NAME, json.dumps(state, indent=2, sort_keys=True, default=str) + "\n")


def campaign_times(timing: dict, layers: int):
    """decode.cost.PassTimes of this campaign's target with a `layers`-layer drafter (None without target times).

    Reads the state's timing, including the older form `{"layers", "draft_ms", "packed_ms", "verify_ms",
    "ar_ms"}` (scaled by layer count, verify of the drafter's block of 16, no contention).
    """
    from decode.cost import PassTimes

    if "target" not in timing:  # a state written before the cost model
        if timing.get("verify_ms") is None:
            return None
        target = PassTimes(timing["ar_ms"], (timing["verify_ms"] - timing["ar_ms"]) / 15, 0.0, 0.0, contention=0.0)
    elif timing["target"] is None:
        return None
    else:
        target = PassTimes(**timing["target"])
    draft, packed = layer_costs(timing)
    return target.with_drafter(draft.at(layers), packed.at(layers))


def layer_costs(timing: dict):
    """(sync draft, packed) decode.cost.LayerCost of this campaign's drafter (older states: proportional)."""
    from decode.cost import LayerCost

    if "packed" not in timing:
        return (LayerCost(0.0, timing["draft_ms"] / timing["layers"]),
                LayerCost(0.0, timing["packed_ms"] / timing["layers"]))
    return LayerCost(*timing["draft"]), LayerCost(*timing["packed"])


def packed_ms_at(timing: dict, layers: int) -> float:
    """Modelled packed-pass time (ms) of a `layers`-layer drafter of this campaign."""
    return layer_costs(timing)[1].at(layers)


def predicted_speedup_at(evaluation, layers: int, timing: dict) -> float | None:
    """Predicted async speedup of a `layers`-layer drafter measured as `evaluation` (see the module docstring)."""
    return evaluation.predicted_speedup(campaign_times(timing, layers))


def measure_timing(drafter, score: ScoreConfig, target=None, times=None) -> dict:
    """Pass times of the unpruned `drafter` and of the target, the basis of every predicted speedup.

    `times`: the pair's decode.cost.PassTimes when already measured (the adaptive width's); else measured.

    Returns `{"layers", "draft": [fixed_ms, per_layer_ms], "packed": [...], "target": PassTimes as a dict or
    None without a target}`.
    """
    from decode.timing import drafter_layer_costs, measure_pass_times

    if times is None and target is not None:
        times = measure_pass_times(target, drafter, score.decode, score.timing_repeats)
    full = (times.draft_ms, times.packed_ms) if times is not None else None
    draft, packed = drafter_layer_costs(drafter, score.decode.packed_budget, score.timing_repeats, full)
    return {"layers": drafter.config.num_hidden_layers, "draft": [draft.fixed_ms, draft.per_layer_ms],
            "packed": [packed.fixed_ms, packed.per_layer_ms], "target": times.to_dict() if times else None}


@dataclass
class _Campaign:
    """The fixed inputs of one run_pruning call (see there); `dtype` is the resolved export dtype."""

    out: Path
    source_dir: Path
    prompts: list
    config: RunConfig
    target: object
    trajectories: list | None
    heal_examples: list | None
    dtype: object
    log: Callable
    progress: Callable | None

    def evaluate(self, model) -> Evaluation:
        """The async decoder's measurements of `model` on the calibration prompts."""
        return evaluate(model, self.prompts, self.config.score, self.trajectories, self.target)


def run_pruning(drafter, source_dir, prompts, out, config: RunConfig, target=None, trajectories=None,
                heal_examples=None, resume: bool = False, log=print, on_step=None, progress=None,
                timing: dict | None = None, export_dtype: str | None = None) -> dict:
    """Run (or resume) a pruning campaign into folder `out`; returns the final state.

    Args:
        drafter: the unpruned drafter, in the compute dtype (float32 recommended).
        source_dir: its folder (tokenizer files, generation config and provenance for the exports).
        prompts: calibration prompts (token ids); trajectories: their recorded target trajectories (replay).
        heal_examples: distillation `Example`s for healing (None or empty disables healing).
        resume: continue the run in `out` (its state.json) after its last completed step; when `out` holds
            no run yet, start one there (it need not be empty).
        on_step: optional callback(record, state) after each step is exported and saved (record = the step's
            entry of state["history"]). A returned string stops the run there, as a stop rule does: it becomes
            `stopped_by`, and the run ends normally (OUT/final, report). Used by sweeps (Optuna pruning) and
            tracking (W&B).
        progress: optional factory(description, total) of a context manager yielding `advance()`, called
            once per scored layer (e.g. `prune.progress.progress_bar`).
        timing: `measure_timing` of this drafter, measured once by the caller (sweeps share one per study so
            that trials compare tau, not timing noise); None measures it here.
        export_dtype: dtype of the exported steps ("float32", "bfloat16", "float16"); None or "source": the
            dtype `source_dir`'s weights are stored in. Steps are measured as rounded to it (round_to_dtype).

    A killed run loses at most the evaluation, heal or write it was doing: each scoring round keeps its layer
    evaluations in a journal (prune.journal), and every file is written atomically (models.checkpoint).
    """
    campaign = _Campaign(Path(out), Path(source_dir), prompts, config, target, trajectories, heal_examples,
                         resolve_export_dtype(export_dtype, source_dir), log, progress)
    state, current = _open_state(campaign, drafter, resume, timing)
    removed_total = sum(len(h["removed_original"]) for h in state["history"])
    while state["stopped_by"] is None:
        k, state["stopped_by"] = _step_size(config, current.config.num_hidden_layers, removed_total)
        if state["stopped_by"] is not None:
            break
        scores = _score_round(campaign, current, state)
        healed, record = _remove_and_heal(campaign, current, scores, sorted(s.layer for s in scores.ranking()[:k]),
                                          state)
        state["stopped_by"] = _stop_rule(config, state, record)
        if state["stopped_by"] is not None:
            break
        _commit_step(campaign, state, healed, record)
        removed_total += len(record["removed"])
        current = healed
        if on_step is not None:
            reason = on_step(record, state)
            if reason:
                state["stopped_by"] = str(reason)
    save_state(campaign.out, state)
    _link_final(campaign.out, state)
    write_report(campaign.out, state)
    remove_journals(campaign.out)
    return state


def _open_state(campaign: _Campaign, drafter, resume: bool, timing: dict | None):
    """(state, the drafter to prune next): the saved run of `campaign.out` when resuming one, else a new run
    (validated settings, unpruned evaluation and pass times, saved before the first scoring round)."""
    out, config = campaign.out, campaign.config
    if (out / STATE_NAME).is_file():
        if not resume:
            raise CheckpointError(f"{out} is not empty: it holds a pruning run; continue it with --resume or "
                                  "choose another --out")
        state = json.loads((out / STATE_NAME).read_text())
        if state["config"] != config_record(config):
            raise ConfigError(f"{out} holds a run with other settings; resume it with the same flags or choose "
                              "another --out")
        compute = next(drafter.parameters())
        current = (load_drafter(out / state["history"][-1]["folder"], compute.dtype, compute.device)
                   if state["history"] else drafter)
        campaign.log(f"resuming {out} after step {len(state['history'])}")
        return state, current
    if resume:
        campaign.log(f"{out} holds no pruning run yet; starting one")
    else:
        ensure_writable_output(out)
    out.mkdir(parents=True, exist_ok=True)
    config.validate(drafter.config.num_hidden_layers)
    if timing is not None and timing["layers"] != drafter.config.num_hidden_layers:
        raise ConfigError(f"the given timing is of a {timing['layers']}-layer drafter, this one has "
                          f"{drafter.config.num_hidden_layers}; measure it with measure_timing(drafter, ...)")
    state = {"config": config_record(config), "source": str(campaign.source_dir), "history": [], "stopped_by": None}
    base = campaign.evaluate(drafter)
    state["timing"] = dict(timing) if timing is not None else measure_timing(drafter, config.score, campaign.target)
    state["base"] = {"tau": base.tau, "fallback_rate": base.fallback_rate,
                     "predicted_speedup": predicted_speedup_at(base, drafter.config.num_hidden_layers,
                                                               state["timing"])}
    save_state(out, state)
    return state, drafter


def _step_size(config: RunConfig, layers: int, removed_total: int) -> tuple[int, str | None]:
    """(layers to remove in the next step, None) or (0, the stop rule that ends the run before it)."""
    if config.layers_to_remove is not None and removed_total >= config.layers_to_remove:
        return 0, "layer budget"
    k = min(config.per_step, layers - 1)
    if config.layers_to_remove is not None:
        k = min(k, config.layers_to_remove - removed_total)
    return (k, None) if k >= 1 else (0, "one layer left")


def _score_round(campaign: _Campaign, current, state: dict):
    """Score every layer of `current` (prune.scoring.ScoreReport), continuing the round's journal if a killed
    run left one with the same key (settings, pass times, prompts, trajectories, weights, dtype and device)."""
    layers, step = current.config.num_hidden_layers, len(state["history"]) + 1
    journal = ScoringJournal.for_round(campaign.out, step, state["config"], state["timing"], campaign.prompts,
                                       campaign.trajectories, current, *placement(current))
    if journal.layers:
        campaign.log(f"step {step}: scoring continues with {len(journal.layers)} of {layers} layers evaluated "
                     "before the interruption")
    with (campaign.progress or _silent)(f"step {step}: scoring", layers) as advance:
        return score_layers(current, campaign.prompts, campaign.config.score, target=campaign.target,
                            trajectories=campaign.trajectories, on_layer=lambda *_: advance(),
                            times=campaign_times(state["timing"], layers), layer_costs=layer_costs(state["timing"]),
                            journal=journal)


def _remove_and_heal(campaign: _Campaign, current, scores, chosen: list[int], state: dict):
    """Remove layers `chosen` (current indices) from `current` and heal; returns (the step's drafter, its record
    for state["history"]: what was removed, tau before and after healing, retention, predicted speedup, scores)."""
    step = len(state["history"]) + 1
    reduced = round_to_dtype(remove_layers(current, chosen), campaign.dtype)
    if len(chosen) == 1:  # scoring already measured the drafter without exactly this layer
        removed = scores.layers[chosen[0]]
        before = Evaluation([], removed.tau_without, None, removed.fallback_rate, removed.verify_width,
                            removed.packed_share, removed.packed_tokens)
    else:
        before = campaign.evaluate(reduced)
    healed, measured, losses, rolled_back = _heal(campaign, reduced, before, step)
    record = {
        "step": step, "folder": f"step-{step:02d}", "removed": chosen,
        "removed_original": [scores.layers[i].original_layer for i in chosen],
        "layers": healed.config.num_hidden_layers, "tau_before_heal": before.tau, "tau": measured.tau,
        "retention": measured.tau / state["base"]["tau"], "heal_rolled_back": rolled_back,
        "predicted_speedup": predicted_speedup_at(measured, healed.config.num_hidden_layers, state["timing"]),
        "heal_loss": [h["loss"] for h in losses],
        "scores": [asdict(s) for s in scores.layers],
    }
    return healed, record


def _heal(campaign: _Campaign, reduced, before: Evaluation, step: int):
    """LoRA-heal `reduced` (measured as `before`), keeping the heal only if it does not lower tau; returns
    (drafter, its Evaluation, heal loss history, whether the heal was rolled back)."""
    if not (campaign.heal_examples and campaign.config.heal.steps > 0):
        return reduced, before, [], False
    candidate, losses = heal(reduced, campaign.heal_examples, campaign.config.heal)
    candidate = round_to_dtype(candidate, campaign.dtype)  # judge the heal by the weights that are exported
    after = campaign.evaluate(candidate)
    if after.tau >= before.tau:
        return candidate, after, losses, False
    campaign.log(f"step {step}: healing lowered tau ({after.tau:.3f} < {before.tau:.3f}); kept the pre-heal weights")
    return reduced, before, losses, True


def _stop_rule(config: RunConfig, state: dict, record: dict) -> str | None:
    """The stop rule a step recorded as `record` breaks (it is then not taken), or None."""
    if record["retention"] < config.min_retention:
        return (f"retention floor: removing original layers {record['removed_original']} would keep "
                f"{record['retention']:.4f} < {config.min_retention}")
    speedup = record["predicted_speedup"]
    previous = state["history"][-1]["predicted_speedup"] if state["history"] else state["base"]["predicted_speedup"]
    if config.stop_on_speedup and speedup is not None and previous is not None and speedup <= previous:
        return f"predicted speedup stopped improving ({speedup:.3f} <= {previous:.3f})"
    return None


def _commit_step(campaign: _Campaign, state: dict, healed, record: dict) -> None:
    """Export the step to OUT/step-XX, then record it in OUT/state.json (a step exists once the state names it)."""
    history = state["history"] + [record]
    export_step(healed, campaign.out / record["folder"], campaign.source_dir,
                {"settings": state["config"], "base": state["base"], "timing": state["timing"]},
                [{k: v for k, v in h.items() if k != "scores"} for h in history], dtype=campaign.dtype,
                overwrite=True)
    state["history"] = history
    campaign.log(f"step {record['step']}: removed original layers {record['removed_original']}, tau "
                 f"{record['tau']:.3f} (retention {record['retention']:.4f})")
    save_state(campaign.out, state)
    remove_journals(campaign.out)


def config_record(config: RunConfig) -> dict:
    """The settings of a campaign as plain JSON values (as stored in state.json)."""
    return json.loads(json.dumps(asdict(config), default=str))


def _link_final(out: Path, state: dict) -> None:
    """OUT/final -> the last step taken (a relative symlink, replaced in one rename), or absent when no step was taken."""
    final = out / "final"
    if state["history"]:
        atomic_symlink(final, state["history"][-1]["folder"])
    elif final.is_symlink() or final.exists():
        final.unlink()


def has_run(out) -> bool:
    """Whether folder `out` holds a pruning run (its state.json) that --resume continues."""
    return (Path(out) / STATE_NAME).is_file()
