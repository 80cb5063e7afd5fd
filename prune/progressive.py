"""Progressive pruning (DESIGN section 6): score -> remove -> heal -> measure -> export, repeated.

Each step scores the remaining layers (prune.scoring), removes the `per_step` least harmful ones, heals
with LoRA (prune.heal) and keeps the healed weights only if they do not lower calibration tau, then
exports the step to OUT/step-XX and records it in OUT/state.json. The run stops at a layer budget, at a
retention floor, or when predicted speedup stops improving (a step that breaks a rule is not taken); the
state says which rule stopped it. A run resumes from its last completed step.

Predicted speedup uses pass times measured once on the unpruned drafter and stored in the state, scaled
by layer count (small drafters are bound by per-layer cost), so decisions never depend on the timing of
a later step and a resumed run decides exactly as an uninterrupted one.
"""

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.checkpoint import ensure_writable_output
from models.drafter import load_drafter
from models.errors import CheckpointError, ConfigError
from models.surgery import remove_layers

from .export import export_step
from .heal import HealConfig, heal
from .progress import progress_bar
from .report import write_report
from .scoring import Evaluation, ScoreConfig, evaluate, pass_times_ms, score_layers, target_times_ms

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


def _save_state(out: Path, state: dict) -> None:
    tmp = out / f".{STATE_NAME}.tmp"
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out / STATE_NAME)


def predicted_speedup_at(evaluation, layers: int, timing: dict) -> float | None:
    """Predicted speedup of a drafter with `layers` layers from the campaign's timing (see module docstring)."""
    if timing.get("verify_ms") is None:
        return None
    scale = layers / timing["layers"]
    round_ms = max(timing["verify_ms"], timing["packed_ms"] * scale)
    round_ms += (evaluation.fallback_rate or 0.0) * timing["draft_ms"] * scale
    return evaluation.tau * timing["ar_ms"] / round_ms


def measure_timing(drafter, score: ScoreConfig, target=None) -> dict:
    """Pass times (ms) of the unpruned `drafter` and of the target, the basis of every predicted speedup.

    Returns `{"layers", "draft_ms", "packed_ms", "verify_ms", "ar_ms"}` (target times None without a target).
    """
    draft_ms, packed_ms = pass_times_ms(drafter, score)
    verify_ms = ar_ms = None
    if target is not None:
        verify_ms, ar_ms = target_times_ms(target, drafter.config.block_size, score.timing_repeats)
    return {"layers": drafter.config.num_hidden_layers, "draft_ms": draft_ms, "packed_ms": packed_ms,
            "verify_ms": verify_ms, "ar_ms": ar_ms}


def run_pruning(drafter, source_dir, prompts, out, config: RunConfig, target=None, trajectories=None,
                heal_examples=None, resume: bool = False, log=print, on_step=None, progress=None,
                timing: dict | None = None) -> dict:
    """Run (or resume) a pruning campaign into folder `out`; returns the final state.

    Args:
        drafter: the unpruned drafter (float32 recommended: exports keep its dtype).
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
    """
    out = Path(out)
    state_file = out / STATE_NAME
    if resume and state_file.is_file():
        state = json.loads(state_file.read_text())
        if state["config"] != config_record(config):
            raise ConfigError(f"{out} holds a run with other settings; resume it with the same flags or choose "
                              "another --out")
        current = load_drafter(out / state["history"][-1]["folder"]) if state["history"] else drafter
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
        _save_state(out, state)
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
                                  on_layer=lambda *_: advance())
        chosen = sorted(s.layer for s in scores.ranking()[:k])
        reduced = remove_layers(current, chosen)
        if k == 1:  # scoring already measured the drafter without exactly this layer
            removed = scores.layers[chosen[0]]
            before = Evaluation([], removed.tau_without, None, removed.fallback_rate)
        else:
            before = evaluate(reduced, prompts, config.score, trajectories, target)
        healed, losses, rolled_back = reduced, [], False
        if heal_examples and config.heal.steps > 0:
            candidate, losses = heal(reduced, heal_examples, config.heal)
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
                        [{k: v for k, v in h.items() if k != "scores"} for h in history], overwrite=True)
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
        _save_state(out, state)
        if on_step is not None:
            reason = on_step(record, state)
            if reason:
                state["stopped_by"] = str(reason)
    _save_state(out, state)
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
