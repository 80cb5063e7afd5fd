"""Progressive pruning (DESIGN section 6): score -> remove -> heal -> measure -> export, repeated.

Each step scores the remaining layers (prune.scoring), removes the `per_step` least harmful ones, heals
with LoRA (prune.heal) and keeps the healed weights only if they do not lower calibration tau, then
exports the step to OUT/step-XX and records it in OUT/state.json. The run stops at a layer budget, at a
retention floor, or when predicted speedup stops improving (a step that breaks a rule is not taken); the
state says which rule stopped it. A run resumes from its last completed step.

Predicted speedup (decode.cost) uses pass times measured once at the start and stored in the state: the
target's, and the drafter's as affine functions of depth (fitted on the unpruned drafter and a half-depth
copy), so decisions never depend on the timing noise of a later step and a resumed run decides exactly
as an uninterrupted one.
"""

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.checkpoint import atomic_write_text, ensure_writable_output
from models.drafter import load_drafter
from models.errors import CheckpointError, ConfigError
from models.surgery import remove_layers

from .export import export_step, resolve_export_dtype, round_to_dtype
from .heal import HealConfig, heal
from .progress import progress_bar
from .report import write_report
from .scoring import Evaluation, ScoreConfig, evaluate, score_layers

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


def run_pruning(drafter, source_dir, prompts, out, config: RunConfig, target=None, trajectories=None,
                heal_examples=None, resume: bool = False, log=print, on_step=None, progress=None,
                timing: dict | None = None, export_dtype: str | None = None) -> dict:
    """Run (or resume) a pruning campaign into folder `out`; returns the final state.

    Args:
        drafter: the unpruned drafter, in the compute dtype (float32 recommended).
        source_dir: its folder (tokenizer files, generation config and provenance for the exports).
        prompts: calibration prompts (token ids); trajectories: their recorded target trajectories (replay).
        heal_examples: distillation `Example`s for healing (None or empty disables healing).
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
    """
    out = Path(out)
    state_file = out / STATE_NAME
    dtype = resolve_export_dtype(export_dtype, source_dir)
    if resume and state_file.is_file():
        state = json.loads(state_file.read_text())
        if state["config"] != config_record(config):
            raise ConfigError(f"{out} holds a run with other settings; resume it with the same flags or choose "
                              "another --out")
        compute = next(drafter.parameters())
        current = (load_drafter(out / state["history"][-1]["folder"], compute.dtype, compute.device)
                   if state["history"] else drafter)
        log(f"resuming {out} after step {len(state['history'])}")
    else:
        if not resume:
            ensure_writable_output(out)
        out.mkdir(parents=True, exist_ok=True)
        config.validate(drafter.config.num_hidden_layers)
        state = {"config": config_record(config), "source": str(source_dir), "history": [], "stopped_by": None}
        base = evaluate(drafter, prompts, config.score, trajectories, target)
        if timing is not None and timing["layers"] != drafter.config.num_hidden_layers:
            raise ConfigError(f"the given timing is of a {timing['layers']}-layer drafter, this one has "
                              f"{drafter.config.num_hidden_layers}; measure it with measure_timing(drafter, ...)")
        state["timing"] = dict(timing) if timing is not None else measure_timing(drafter, config.score, target)
        state["base"] = {"tau": base.tau, "fallback_rate": base.fallback_rate,
                         "predicted_speedup": predicted_speedup_at(base, drafter.config.num_hidden_layers,
                                                                   state["timing"])}
        save_state(out, state)
        current = drafter
    base_tau = state["base"]["tau"]
    removed_total = sum(len(h["removed_original"]) for h in state["history"])

    while state["stopped_by"] is None:
        layers = current.config.num_hidden_layers
        if config.layers_to_remove is not None and removed_total >= config.layers_to_remove:
            state["stopped_by"] = "layer budget"
            break
        k = min(config.per_step, layers - 1)
        if config.layers_to_remove is not None:
            k = min(k, config.layers_to_remove - removed_total)
        if k < 1:
            state["stopped_by"] = "one layer left"
            break
        with (progress or _silent)(f"step {len(state['history']) + 1}: scoring", layers) as advance:
            scores = score_layers(current, prompts, config.score, target=target, trajectories=trajectories,
                                  on_layer=lambda *_: advance(), times=campaign_times(state["timing"], layers),
                                  layer_costs=layer_costs(state["timing"]))
        chosen = sorted(s.layer for s in scores.ranking()[:k])
        reduced = round_to_dtype(remove_layers(current, chosen), dtype)
        if k == 1:  # scoring already measured the drafter without exactly this layer
            removed = scores.layers[chosen[0]]
            before = Evaluation([], removed.tau_without, None, removed.fallback_rate, removed.verify_width)
        else:
            before = evaluate(reduced, prompts, config.score, trajectories, target)
        healed, losses, rolled_back = reduced, [], False
        if heal_examples and config.heal.steps > 0:
            candidate, losses = heal(reduced, heal_examples, config.heal)
            candidate = round_to_dtype(candidate, dtype)  # judge the heal by the weights that are exported
            after = evaluate(candidate, prompts, config.score, trajectories, target)
            if after.tau >= before.tau:
                healed, measured = candidate, after
            else:
                rolled_back, measured = True, before
                log(f"step {len(state['history']) + 1}: healing lowered tau ({after.tau:.3f} < {before.tau:.3f}); "
                    "kept the pre-heal weights")
        else:
            measured = before
        retention = measured.tau / base_tau
        speedup = predicted_speedup_at(measured, healed.config.num_hidden_layers, state["timing"])
        if retention < config.min_retention:
            state["stopped_by"] = (f"retention floor: removing original layers "
                                   f"{[scores.layers[i].original_layer for i in chosen]} would keep "
                                   f"{retention:.4f} < {config.min_retention}")
            break
        previous = state["history"][-1]["predicted_speedup"] if state["history"] else state["base"]["predicted_speedup"]
        if config.stop_on_speedup and speedup is not None and previous is not None and speedup <= previous:
            state["stopped_by"] = f"predicted speedup stopped improving ({speedup:.3f} <= {previous:.3f})"
            break
        step = len(state["history"]) + 1
        record = {
            "step": step, "folder": f"step-{step:02d}", "removed": chosen,
            "removed_original": [scores.layers[i].original_layer for i in chosen],
            "layers": healed.config.num_hidden_layers, "tau_before_heal": before.tau, "tau": measured.tau,
            "retention": retention, "heal_rolled_back": rolled_back, "predicted_speedup": speedup,
            "heal_loss": [h["loss"] for h in losses],
            "scores": [asdict(s) for s in scores.layers],
        }
        history = state["history"] + [record]
        try:
            export_step(healed, out / record["folder"], source_dir,
                        {"settings": state["config"], "base": state["base"], "timing": state["timing"]},
                        [{k: v for k, v in h.items() if k != "scores"} for h in history], dtype=dtype,
                        overwrite=True)
        except OSError as exc:
            raise CheckpointError(
                f"could not write {out / record['folder']} ({exc.strerror or exc}); the run is intact up to step "
                f"{step - 1}: free disk space and rerun with --resume"
            ) from None
        state["history"] = history
        removed_total += len(chosen)
        current = healed
        log(f"step {step}: removed original layers {record['removed_original']}, tau {measured.tau:.3f} "
            f"(retention {retention:.4f})")
        save_state(out, state)
        if on_step is not None:
            reason = on_step(record, state)
            if reason:
                state["stopped_by"] = str(reason)
    save_state(out, state)
    _link_final(out, state)
    write_report(out, state)
    return state


def config_record(config: RunConfig) -> dict:
    """The settings of a campaign as plain JSON values (as stored in state.json)."""
    return json.loads(json.dumps(asdict(config), default=str))


def _link_final(out: Path, state: dict) -> None:
    """OUT/final -> the last step taken (a relative symlink), or absent when no step was taken."""
    final = out / "final"
    if final.is_symlink() or final.exists():
        final.unlink()
    if state["history"]:
        final.symlink_to(state["history"][-1]["folder"])


def check_resumable(out) -> None:
    out = Path(out)
    if not (out / STATE_NAME).is_file():
        raise CheckpointError(f"{out} holds no pruning run to resume; start one without --resume")
