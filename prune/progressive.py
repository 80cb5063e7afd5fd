"""Progressive pruning (docs/design.md, Progressive pruning): score -> remove -> heal -> measure -> export, repeated.

Before each layer step a run may take a head step instead (RunConfig.vocab_sizes): the drafter's head cut to
the next smaller draft vocabulary (prune.vocab), judged on the check prompts by the same rules, taken when
they accept it. It costs one evaluation where a layer step costs a scoring round, so it is tried first, and
again before every later layer step (the rules may accept it after a heal).

Each step scores the remaining layers on the calibration prompts (prune.scoring), removes the `per_step`
least harmful ones, heals with LoRA (prune.heal) and keeps the healed weights only if they do not lower tau,
then exports the step to OUT/step-XX and records it in OUT/state.json. Steps are judged (heal rule and
rollback, stop rules) on check prompts disjoint from the calibration prompts (RunConfig.check_prompts): on
the prompts that chose its layers a step reads better than it is. The run stops at a layer budget, at a
retention floor, or when predicted speedup falls a tolerance below the best so far (a step that breaks a rule
is not taken); the state says which rule stopped it. A run resumes from its last completed step, and an
unfinished scoring round from its last evaluated layer (prune.journal): a run killed at any moment and
resumed ends with the same steps, byte for byte, as one never interrupted.

Predicted speedup (decode.cost) uses pass times measured once at the start and stored in the state
(prune.state.Timing): the target's, and the drafter's as affine functions of depth (fitted on the unpruned
drafter and a half-depth copy), so decisions never depend on the timing noise of a later step and a
resumed run decides exactly as an uninterrupted one. The state's schema is prune/state.py; the settings'
prune/config.py.
"""

import functools
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from models.checkpoint import atomic_symlink, ensure_writable_output
from models.drafter import load_drafter
from models.errors import CheckpointError, ConfigError
from models.shards import DEFAULT_MAX_SHARD_SIZE
from models.surgery import remove_layers

from .cache import model_identity
from .config import RunConfig, complete_settings, settings_record
from .export import export_step, resolve_export_dtype, round_to_dtype
from .heal import heal
from .journal import ScoringJournal, remove_journals
from .progress import clock, progress_bar
from .ranking import skipped_note
from .report import write_report
from .scoring import (Evaluation, ScoreReport, cached_scores, carried_scores, evaluate, expected_best_of,
                      retention_error, round_evaluations)
from .state import (BaseRecord, Host, RunState, StepRecord, Timing, campaign_timing, has_run, judged_on,
                    load_state, save_state)
from .trajectories import HasSource
from .training.loss import Teacher
from .head_steps import head_step
from .vocab import next_head_size

_silent = functools.partial(progress_bar, enabled=False)


@dataclass
class Campaign(HasSource):
    """What a campaign prunes and measures with.

    Attributes:
        drafter: the unpruned drafter, in the compute dtype (float32 recommended).
        source_dir: its folder (tokenizer files, generation config and provenance for the exports).
        prompts: calibration prompts (token ids): scoring rounds rank the layers on them.
        source: where the target's trajectories come from (prune.trajectories.TrajectorySource: the live
            target, or a recorded file of its outputs, whose target's weights are not loaded; a loaded target
            model is taken as its live source). Its loaded target (`target`, None with a recorded file alone)
            serves live verification and the pass times; with a source, scoring rounds are cached.
        trajectories: the prompts' recorded target trajectories (replay; prune.scoring.cached_trajectories).
        check_prompts: prompts disjoint from `prompts` that judge every step (RunConfig.check_prompts of them);
            None or empty: the steps are judged on `prompts`.
        check_trajectories: their recorded target trajectories (replay), `RunConfig.check_tokens` long.
        heal_data: what `heal_examples` were read from, as the run's record names it ("folder xW" per folder,
            prune.commands._heal.describe); a resume must heal on the same.
        heal_examples: distillation `Example`s for healing (None or empty disables healing).
        cache: the cache folder (prune.cache): the campaign's timing is kept there, and a scoring round that
            `prune score` scored with the same settings is read from there; None caches nothing.
        vocab_ranking: the ids head steps keep, best first (prune.vocab.TokenRanking; counted on training
            prompts); None: no head steps (RunConfig.vocab_sizes must then offer none below the drafter's ids).
    """

    drafter: object
    source_dir: Path | str
    prompts: list
    source: object = None
    trajectories: list | None = None
    heal_examples: list | None = None
    cache: Path | None = None
    check_prompts: list | None = None
    check_trajectories: list | None = None
    heal_data: list[str] | None = None
    vocab_ranking: object = None

    @functools.cached_property
    def teacher(self) -> Teacher:
        """The unpruned drafter as every heal's teacher, remembering its states: the heals of a campaign draw
        the same batches, so the teacher runs in the first heal only (prune.training.loss.Teacher)."""
        return Teacher(self.drafter, remember=True)


@dataclass
class RunHooks:
    """How a campaign talks to its caller.

    Attributes:
        log: called with each progress message (a line of text).
        on_step: optional callback(StepRecord, RunState) after each step is exported and saved. A returned
            string stops the run there, as a stop rule does: it becomes `stopped_by`, and the run ends normally
            (OUT/final, report). Used by sweeps (Optuna pruning) and tracking (W&B).
        progress: optional factory(description, total) of a context manager yielding `advance()`, called once
            per scored layer (e.g. `prune.progress.progress_bar`).
        heal_progress: show each heal's LoRA updates on stderr (the training loop's bar, or a line now and then
            in a log): a heal is the longest silent stretch of a run otherwise.
    """

    log: Callable = print
    on_step: Callable | None = None
    progress: Callable | None = None
    heal_progress: bool = False


@dataclass
class _Run:
    """One run_pruning call: its inputs, folder, settings, resolved export dtype, hooks and largest weight file."""

    campaign: Campaign
    out: Path
    config: RunConfig
    dtype: object
    hooks: RunHooks
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE

    def judge(self, model) -> Evaluation:
        """The scoring decoder's measurements of `model` on the prompts that judge steps: the check prompts, or
        the calibration prompts when the campaign has none."""
        c = self.campaign
        if c.check_prompts:
            return evaluate(model, c.check_prompts, self.config.check_score, c.check_trajectories, c.target)
        return evaluate(model, c.prompts, self.config.score, c.trajectories, c.target)

    @functools.cached_property
    def base(self) -> Evaluation:
        """The unpruned drafter's measurements on the prompts that judge steps (deterministic: a resumed run
        measures the same)."""
        return self.judge(self.campaign.drafter)

    @property
    def judged_on(self) -> str:
        """The prompts steps are judged on, in words (prune.state.judged_on)."""
        return judged_on(self.config.check_prompts)

    def log(self, message: str) -> None:
        self.hooks.log(message)


def run_pruning(campaign: Campaign, out, config: RunConfig, resume: bool = False, timing: Timing | None = None,
                export_dtype: str | None = None, hooks: RunHooks | None = None,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> RunState:
    """Run (or resume) a pruning campaign into folder `out`; returns its final state (prune.state).

    Args:
        campaign: the drafter and what it is measured and healed with.
        resume: continue the run in `out` (its state.json) after its last completed step; when `out` holds
            no run yet, start one there (it need not be empty).
        timing: the campaign's pass times (`campaign_timing` of this drafter), measured once by the caller
            (sweeps share one per study so that trials compare tau, not timing noise); None measures them here.
        export_dtype: dtype of the exported steps ("float32", "bfloat16", "float16"); None or "source": the
            dtype `source_dir`'s weights are stored in. Steps are measured as rounded to it (round_to_dtype).
        hooks: log, per-step callback and progress bars (RunHooks; default: print, none, none).
        max_shard_size: the largest weight file of an exported step (bytes or "80MB"); a heavier step is written
            as shards (models/shards.py). Not a setting of the run: a resume may write its steps otherwise.

    A killed run loses at most the evaluation, heal or write it was doing: each scoring round keeps its layer
    evaluations in a journal (prune.journal), and every file is written atomically (models.checkpoint).
    """
    _check_campaign(campaign, config)
    run = _Run(campaign, Path(out), config, resolve_export_dtype(export_dtype, campaign.source_dir),
               hooks or RunHooks(), max_shard_size)
    state, current = _open_state(run, resume, timing)
    removed_total = len(state.removed_original())
    while state.stopped_by is None:
        cut = _head_step(run, current, state)
        if cut is not None:
            current = _take(run, state, *cut)
            continue
        k, state.stopped_by = _step_size(config, current.config.num_hidden_layers, removed_total)
        if state.stopped_by is not None:
            break
        scores = _score_round(run, current, state, k)
        healed, record, verdict = _take_step(run, current, scores, k, state)
        state.stopped_by = _stop_rule(config, state, verdict)
        if state.stopped_by is not None:
            break
        current = _take(run, state, healed, record)
        removed_total += len(record.removed)
    save_state(run.out, state)
    _link_final(run.out, state)
    write_report(run.out, state)
    remove_journals(run.out)
    return state


def _take(run: _Run, state: RunState, drafter, record: StepRecord):
    """Export and record the step (`_commit_step`), then tell the caller (RunHooks.on_step, which may stop the
    run); returns the drafter the run goes on from."""
    _commit_step(run, state, drafter, record)
    if run.hooks.on_step is not None:
        reason = run.hooks.on_step(record, state)
        if reason:
            state.stopped_by = str(reason)
    return drafter


def _head_step(run: _Run, current, state: RunState):
    """prune.head_steps.head_step of the run: (the cut drafter, its StepRecord) or None."""
    return head_step(run.campaign.vocab_ranking, run.config.vocab_sizes, current, state, run.judge,
                     functools.partial(_stop_rule, run.config), run.log)


def _check_campaign(campaign: Campaign, config: RunConfig) -> None:
    """Refuse a campaign whose check prompts are not those the settings describe, or that offers head steps
    without the ranking they cut by."""
    checks = len(campaign.check_prompts or [])
    if checks != config.check_prompts:
        raise ConfigError(f"the campaign carries {checks} check prompts where the settings ask for "
                          f"{config.check_prompts}; pass as many (Campaign.check_prompts) or set check_prompts")
    if checks and config.score.verify == "replay" and len(campaign.check_trajectories or []) != checks:
        raise ConfigError("replayed scoring needs the check prompts' target trajectories "
                          "(Campaign.check_trajectories; prune.scoring.cached_trajectories)")
    if campaign.vocab_ranking is None and next_head_size(config.vocab_sizes, campaign.drafter) is not None:
        raise ConfigError("head steps (vocab_sizes) need the ids' ranking (Campaign.vocab_ranking, prune.vocab."
                          "rank_tokens on distillation data); pass one, or set vocab_sizes to () (--no-vocab-steps)")


def _open_state(run: _Run, resume: bool, timing: Timing | None) -> tuple[RunState, object]:
    """(state, the drafter to prune next): the saved run of `run.out` when resuming one, else a new run
    (validated settings, unpruned evaluation and pass times, saved before the first scoring round)."""
    out, config, drafter = run.out, run.config, run.campaign.drafter
    if has_run(out):
        if not resume:
            raise CheckpointError(f"{out} is not empty: it holds a pruning run; continue it with --resume or "
                                  "choose another --out")
        state = load_state(out)
        stored, given = with_defaults(state.config, config_record(RunConfig())), config_record(config)
        if stored != given:
            differences = "; ".join(setting_differences(stored, given)[:4])
            raise ConfigError(f"{out} holds a run with other settings ({differences}); resume it with its "
                              "settings or choose another --out")
        healed_on = _heal_data(run)
        if state.heal_data is not None and healed_on is not None and state.heal_data != healed_on:
            raise ConfigError(f"{out} holds a run that heals on {', '.join(state.heal_data)}, not on "
                              f"{', '.join(healed_on)}; resume it with that --heal-data or choose another --out")
        ranked = _vocab(run)
        if state.vocab is not None and ranked is not None and state.vocab["sha256"] != ranked["sha256"]:
            raise ConfigError(f"{out} holds a run whose head steps rank the ids of {', '.join(state.vocab['source'])}, "
                              f"not those of {', '.join(ranked['source'])}; resume it with that --vocab-data or "
                              "choose another --out")
        compute = next(drafter.parameters())
        current = load_drafter(out / state.last.folder, compute.dtype, compute.device) if state.history else drafter
        run.log(f"resuming {out} after step {len(state.history)}")
        host = Host.of(drafter, run.campaign.target)
        if state.host is not None and state.host != host:
            run.log(f"note: {out} was started on {state.host.text()}; this is {host.text()}, whose arithmetic and "
                    "pass times may choose other layers than that machine would have")
        return state, current
    if resume:
        run.log(f"{out} holds no pruning run yet; starting one")
    else:
        ensure_writable_output(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = drafter.config.num_hidden_layers
    config.validate(layers)
    if timing is not None and timing.layers != layers:
        raise ConfigError(f"the given timing is of a {timing.layers}-layer drafter, this one has {layers}; "
                          "measure it with campaign_timing(drafter, ...)")
    base = run.base
    if timing is None:
        timing = campaign_timing(drafter, config.score, run.campaign.source, cache=run.campaign.cache)
    state = RunState(config_record(config), str(run.campaign.source_dir), timing,
                     BaseRecord(base.tau, base.fallback_rate, base.predicted_speedup(timing.pass_times(layers)),
                                base.width, base.packed_share, base.packed_tokens),
                     heal_data=_heal_data(run), host=Host.of(drafter, run.campaign.target), vocab=_vocab(run))
    save_state(out, state)
    _log_ceiling(run, state)
    return state, drafter


def _heal_data(run: _Run) -> list[str] | None:
    """What the run heals on as its record names it (Campaign.heal_data); None when it does not heal."""
    return run.campaign.heal_data if run.config.heal.steps and run.campaign.heal_examples else None


def _vocab(run: _Run) -> dict | None:
    """The ranking head steps cut by, as the run's record keeps it; None when the run takes no head steps."""
    ranking = run.campaign.vocab_ranking
    return ranking.record() if ranking is not None and run.config.vocab_sizes else None


def _log_ceiling(run: _Run, state: RunState) -> None:
    """Say what the run can buy at most: the predicted speedup of the layers it may remove at equal tau."""
    removable = run.config.layers_to_remove or run.config.per_step
    gain = state.equal_tau_speedup(state.layers - removable)
    if gain is None:
        return
    layers = "1 layer fewer makes" if removable == 1 else f"{removable} layers fewer make"
    run.log(f"on this machine {layers} the drafter at most {gain:.3f}x faster at equal tau (predicted: "
            f"{state.timing.depth_text()}); what a step loses in tau comes off that")


def _step_size(config: RunConfig, layers: int, removed_total: int) -> tuple[int, str | None]:
    """(layers to remove in the next step, None) or (0, the stop rule that ends the run before it)."""
    if config.layers_to_remove is not None and removed_total >= config.layers_to_remove:
        return 0, "layer budget"
    k = min(config.per_step, layers - 1)
    if config.layers_to_remove is not None:
        k = min(k, config.layers_to_remove - removed_total)
    return (k, None) if k >= 1 else (0, "one layer left")


def _score_round(run: _Run, current, state: RunState, take: int) -> ScoreReport:
    """Score every layer of `current` (prune.scoring.ScoreReport) for a step that removes `take`: from the score
    cache when `prune score` scored this drafter with these settings, else continuing the round's journal if a
    killed run left one with the same key (settings, pass times, prompts, trajectories, carried scores,
    weights, dtype and device). After the first step, a screening round starts from the previous round's
    scores (RunConfig.carry_screen; prune.scoring.score_layers, `carried`)."""
    c = run.campaign
    layers, step = current.config.num_hidden_layers, len(state.history) + 1
    scored = next((h for h in reversed(state.history) if h.scores), None)  # head steps score no layer
    carried = carried_scores(scored.scores, scored.removed) if scored and run.config.carry_screen else None
    journal = ScoringJournal.for_round(run.out, step, state.config, state.timing.to_dict(), c.prompts,
                                       c.trajectories, carried and [asdict(s) for s in carried],
                                       *model_identity(current))
    if journal.layers or journal.screened:
        run.log(f"step {step}: scoring continues with {len(journal.screened) or len(journal.layers)} of {layers} "
                "layers evaluated before the interruption")
    evaluations = round_evaluations(run.config.score, layers, len(c.prompts), carried=bool(carried))
    started = time.monotonic()
    with (run.hooks.progress or _silent)(f"step {step}: scoring", evaluations) as advance:
        report = cached_scores(c.cache, current, c.prompts, run.config.score, state.timing, c.source,
                               trajectories=c.trajectories, on_layer=lambda *_: advance(), journal=journal,
                               store=False, carried=carried, take=take,
                               on_total=lambda total: advance(0, total=total))
    fresh = sum(s.age is None and not s.skipped for s in report.layers)
    run.log(f"step {step}: scored {fresh} of {layers} layers in this round ({clock(time.monotonic() - started)})")
    skipped = skipped_note(report.to_dict())
    if skipped:
        run.log(f"step {step}: {skipped}")
    return report


def _candidates(run: _Run, scores: ScoreReport, k: int) -> list[list[int]]:
    """The layer sets (current indices) a step that removes `k` may take, in order: the `k` lowest of the
    ranking, then, when one layer goes per step and steps are judged on check prompts, the next lowest
    layers, up to RunConfig.check_candidates in all."""
    ranking = scores.ranking()
    options = [sorted(s.layer for s in ranking[:k])]
    if k == 1 and run.campaign.check_prompts:
        options += [[s.layer] for s in ranking[1:run.config.check_candidates]]
    return options


def _take_step(run: _Run, current, scores: ScoreReport, k: int, state: RunState):
    """Remove the layers of the step from `current` and heal; returns (the step's drafter, its StepRecord, the
    StepRecord the stop rules judge: the same, but a later try's tau lowered by its discount, `_discounted`).

    The candidates (`_candidates`) are judged in order, each at its discounted tau (`_discounted`), and the
    first that the stop rules accept and that has lost less than HealConfig.min_drop of the unpruned tau is
    the step, whether or not the run heals. When none is, the step is the candidate judged best: healed when it
    lost enough (`_heal`), and then accepted or refused by the stop rules (run_pruning). The calibration
    ranking is noisy among its lowest layers, so the next lowest often keeps the tau the lowest loses on the
    check prompts; a try costs one evaluation on them, a heal dozens of training updates, and a layer lost
    for good (a run without heals) more than either."""
    step = len(state.history) + 1
    options = _candidates(run, scores, k)
    tried = []  # (judged tau, chosen, drafter, its Evaluation), in the order tried
    for index, chosen in enumerate(options):
        reduced = round_to_dtype(remove_layers(current, chosen), run.dtype)
        if len(chosen) == 1 and not run.campaign.check_prompts and scores.layers[chosen[0]].tau_without is not None:
            # judged on the calibration prompts: scoring already measured the drafter without exactly this layer
            removed = scores.layers[chosen[0]]
            before = Evaluation([], removed.tau_without, None, removed.fallback_rate, removed.verify_width,
                                removed.packed_share, removed.packed_tokens, decoder=run.config.score.decoder)
        else:
            before = run.judge(reduced)
        record = verdict = _step_record(run, state, scores, chosen, before, before, [], False)
        judged = _discounted(run, before, tries=index + 1)
        if judged is not before:
            verdict = _step_record(run, state, scores, chosen, judged, judged, [], False)
            run.log(f"step {step}: try {index + 1} keeps {record.retention:.2%} of the unpruned {run.judged_on} tau, "
                    f"judged at {verdict.retention:.2%} (the optimism of the best of {index + 1} reads, "
                    "--check-try-discount)")
        if _stop_rule(run.config, state, verdict) is None and not _lost_enough(run, judged.tau, state.base.tau):
            _heal(run, reduced, before, state.base.tau, step)  # says why it is not healed
            return reduced, record, verdict
        tried.append((judged.tau, chosen, reduced, before))
        if index + 1 < len(options):
            originals = [scores.layers[i].original_layer for i in chosen]
            following = [scores.layers[i].original_layer for i in options[index + 1]]
            run.log(f"step {step}: without original layers {originals} the drafter keeps {record.retention:.2%} of "
                    f"the unpruned {run.judged_on} tau, short of a step taken as it is; trying original layers "
                    f"{following} (--check-candidates)")
    judged_tau, chosen, reduced, before = max(tried, key=lambda t: t[0])  # the first of equals: max keeps it
    if len(tried) > 1:
        run.log(f"step {step}: no try kept {1 - run.config.heal.min_drop:.2%} of the unpruned {run.judged_on} "
                f"tau; taking the best judged, original layers {[scores.layers[i].original_layer for i in chosen]}")
    healed, measured, losses, rolled_back = _heal(run, reduced, before, state.base.tau, step)
    record = _step_record(run, state, scores, chosen, before, measured, losses, rolled_back)
    discount = before.tau - judged_tau  # a heal starts from the selected read, so it keeps that optimism
    verdict = record if discount == 0 else _step_record(
        run, state, scores, chosen, replace(before, tau=judged_tau), replace(measured, tau=measured.tau - discount),
        losses, rolled_back)
    return healed, record, verdict


def _discounted(run: _Run, measured: Evaluation, tries: int) -> Evaluation:
    """`measured`, the `tries`-th candidate of a step on the check prompts, as the stop rules judge it: its tau
    lowered by RunConfig.check_try_discount x the optimism of the best of `tries` reads x the standard error of
    its retention there (paired with the unpruned drafter's per-prompt tau), in units of the unpruned tau.
    The first try, or a discount of 0, is judged as it reads (`measured` itself)."""
    discount = run.config.check_try_discount * expected_best_of(tries)
    if discount == 0:
        return measured
    base = run.base
    error = retention_error(measured.tau_per_prompt, base.tau_per_prompt)
    return replace(measured, tau=measured.tau - discount * error * base.tau)


def _step_record(run: _Run, state: RunState, scores: ScoreReport, chosen: list[int], before: Evaluation,
                 measured: Evaluation, losses: list, rolled_back: bool) -> StepRecord:
    """The StepRecord of removing `chosen` (current indices), measured `before` and after (`measured`) a heal."""
    step = len(state.history) + 1
    layers = state.layers - len(chosen)
    return StepRecord(
        step=step, folder=f"step-{step:02d}", removed=chosen,
        removed_original=[scores.layers[i].original_layer for i in chosen], layers=layers,
        tau_before_heal=before.tau, tau=measured.tau, retention=measured.tau / state.base.tau,
        heal_rolled_back=rolled_back,
        predicted_speedup=measured.predicted_speedup(state.timing.pass_times(layers, state.head_rows)),
        heal_loss=[h["loss"] for h in losses], scores=list(scores.layers),
    )


def _lost_enough(run: _Run, tau: float, base_tau: float) -> bool:
    """A drafter at `tau` has lost at least HealConfig.min_drop of the unpruned `base_tau`: enough to heal, and
    enough that a step tries its next candidate first."""
    min_drop = run.config.heal.min_drop
    return min_drop == 0 or (base_tau > 0 and 1 - tau / base_tau >= min_drop)


def _needs_heal(run: _Run, tau: float, base_tau: float) -> bool:
    """A drafter at `tau` has lost enough to heal (`_lost_enough`) and the run heals."""
    config = run.config.heal
    return bool(run.campaign.heal_examples and config.steps > 0) and _lost_enough(run, tau, base_tau)


def _heal(run: _Run, reduced, before: Evaluation, base_tau: float, step: int):
    """LoRA-heal `reduced` (measured as `before`) when it has lost at least `HealConfig.min_drop` of the
    unpruned drafter's tau `base_tau` (both on the prompts that judge steps), keeping the heal only if it does
    not lower tau there; returns (drafter, its Evaluation, heal loss history, whether the heal was rolled
    back)."""
    examples, config = run.campaign.heal_examples, run.config.heal
    if not (examples and config.steps > 0):
        return reduced, before, [], False
    lost = 1 - before.tau / base_tau if base_tau > 0 else 0.0
    standing = f"step {step}: the drafter keeps {1 - lost:.2%} of the unpruned {run.judged_on} tau"
    if not _needs_heal(run, before.tau, base_tau):
        run.log(f"{standing} (heals below {1 - config.min_drop:.2%}, --heal-min-drop): not healed")
        return reduced, before, [], False
    run.log(f"{standing}: healing ({config.steps} LoRA updates, --heal-distill-weight {config.distill_weight:g})")
    started = time.monotonic()
    # The teacher of a distilling heal is the unpruned drafter: what every step tries to stay close to.
    candidate, losses = heal(reduced, examples, config, teacher=run.campaign.teacher,
                             progress=run.hooks.heal_progress, label=f"step {step}: heal")
    candidate = round_to_dtype(candidate, run.dtype)  # judge the heal by the weights that are exported
    after = run.judge(candidate)
    run.log(f"step {step}: healed in {clock(time.monotonic() - started)}: tau {before.tau:.3f} -> {after.tau:.3f}")
    if after.tau >= before.tau:
        return candidate, after, losses, False
    run.log(f"step {step}: healing lowered tau ({after.tau:.3f} < {before.tau:.3f}); kept the pre-heal weights")
    return reduced, before, losses, True


def _stop_rule(config: RunConfig, state: RunState, record: StepRecord) -> str | None:
    """The stop rule a step recorded as `record` breaks (it is then not taken), or None."""
    if record.retention < config.min_retention:
        change = (f"cutting the head to {record.head_rows} ids" if record.is_head_step else
                  f"removing original layers {record.removed_original}")
        return f"retention floor: {change} would keep {record.retention:.4f} < {config.min_retention}"
    speedup = record.predicted_speedup
    earlier = [("the unpruned drafter", state.base.predicted_speedup)] + [
        (f"step {h.step}", h.predicted_speedup) for h in state.history]
    earlier = [(name, value) for name, value in earlier if value is not None]
    if not (config.stop_on_speedup and speedup is not None and earlier):
        return None
    name, best = max(earlier, key=lambda item: item[1])
    if speedup <= best * (1 - config.speedup_tolerance):
        below = f"more than {config.speedup_tolerance:.1%} " if config.speedup_tolerance else ""
        return f"predicted speedup {below}below the best ({speedup:.3f} <= {best:.3f}, {name})"
    return None


def _commit_step(run: _Run, state: RunState, healed, record: StepRecord) -> None:
    """Export the step to OUT/step-XX, then record it in OUT/state.json (a step exists once the state names it)."""
    history = state.history + [record]
    export_step(healed, run.out / record.folder, run.campaign.source_dir,
                {"settings": state.config, "source": state.source, "base": asdict(state.base),
                 "timing": state.timing.to_dict()},
                [h.to_dict(scores=False) for h in history], dtype=run.dtype, overwrite=True,
                max_shard_size=run.max_shard_size)
    state.history = history
    change = (f"cut the head to {record.head_rows} ids" if record.is_head_step else
              f"removed original layers {record.removed_original}")
    run.log(f"step {record.step}: {change}, {run.judged_on} tau {record.tau:.3f} (retention {record.retention:.4f})")
    save_state(run.out, state)
    remove_journals(run.out)


def config_record(config: RunConfig) -> dict:
    """The settings of a campaign as plain JSON values (as stored in state.json)."""
    return settings_record(config)


# Settings added since a run could be saved without them, at the value that reproduces what runs did before:
# such a run resumes only with these values (e.g. `--check-prompts 0`), as it was judged then.
SETTINGS_BEFORE_THEY_EXISTED = {"check_prompts": 0, "check_candidates": 1, "check_try_discount": 0.0,
                                "check_tokens": None, "vocab_sizes": [], "context_vocab": False}


def with_defaults(stored: dict, defaults: dict) -> dict:
    """A saved run's settings completed for this version (prune.config.complete_settings, with the settings
    whose old behaviour is not their default at SETTINGS_BEFORE_THEY_EXISTED)."""
    return complete_settings(stored, defaults, SETTINGS_BEFORE_THEY_EXISTED)


def setting_differences(stored: dict, given: dict, prefix: str = "") -> list[str]:
    """The settings (config_record form, nested names joined by dots) that differ between a saved run and the
    given flags, as "name: X in the run, Y given"."""
    lines = []
    for key in sorted(stored.keys() | given.keys()):
        before, now = stored.get(key), given.get(key)
        if isinstance(before, dict) and isinstance(now, dict):
            lines += setting_differences(before, now, f"{prefix}{key}.")
        elif before != now:
            lines.append(f"{prefix}{key}: {before} in the run, {now} given")
    return lines


def _link_final(out: Path, state: RunState) -> None:
    """OUT/final -> the last step taken (a relative symlink, replaced in one rename), or absent when no step was taken."""
    final = out / "final"
    if state.history:
        atomic_symlink(final, state.last.folder)
    elif final.is_symlink() or final.exists():
        final.unlink()
