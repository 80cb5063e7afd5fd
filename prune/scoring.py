"""Layer importance: how much acceptance length drops when one layer is removed (docs/design.md, Scoring).

A layer's score compares the drafter with and without it, both measured by a real speculative decoder
(ScoreConfig.decoder: async by default) on calibration prompts; the criterion (prune.criteria) says how: by
default tau(current drafter) - tau(current drafter without that layer). The drafter without a layer is a view
sharing the drafter's tensors and their derived fast-path forms (models.surgery.without_layers), so a round
holds one drafter's weights however many layers it scores. With `verify="replay"` the target's greedy
trajectory per prompt is recorded once (or read from a file of its recorded outputs: prune.trajectories says
where they come from), and every evaluation after that costs drafter passes only (prompts are batched
into one drafter pass); `verify="live"` runs the target in every evaluation. A paired bootstrap over
prompts gives a confidence interval per layer, so a too-small calibration set shows as wide intervals.

The `speedup` criterion scores a layer by the drop in predicted speedup instead (decode.cost: the
target's pass times measured once, each reduced drafter's own pass times, its tau, verify width and
fallback rate). The `expected-tau` criterion adds, beside the decoder's measurements, the drafter's
expected acceptance length on the target's trajectories (`expected_tau_per_prompt`), which moves with every
change of the drafter's probabilities and so ranks layers on calibration sets too small for tau to tell
them apart (docs/design.md, Scoring). Settings: prune.config.ScoreConfig; reports are cached by
prune.cache.score_key.
"""

import functools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from decode import cost
from decode.config import DecodeConfig
from decode.decoders import DecodeResult, decode_ar, decode_speculative
from decode.metrics import paired_ratio_error, summarize
from decode.timing import drafter_pass_ms, measure_pass_times
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.draft_vocab import head_rows
from models.drafter_config import original_layers
from models.errors import ConfigError
from models.faults import fault_point
from models.surgery import without_layers

from .cache import cached_json, loaded_target, score_key
from .config import DEFAULT_DECODER, ScoreConfig
from .criteria import CRITERIA, LayerEffect


@dataclass
class Evaluation:
    """A speculative decoder's measurements of one drafter on the calibration prompts (width: mean verify
    width; `decoder`: which decoder, ScoreConfig.decoder), and, where the criterion asks for it, the drafter's
    expected acceptance length per prompt (`expected_tau_per_prompt`; their mean is `expected_tau`)."""

    tau_per_prompt: list[float]
    tau: float
    hit_rate: float | None
    fallback_rate: float | None
    width: float | None = None
    packed_share: float | None = None
    packed_tokens: float | None = None
    rounds: int | None = None
    judged_rounds: int | None = None
    expected_tau_per_prompt: list[float] | None = None
    expected_tau: float | None = None
    decoder: str = DEFAULT_DECODER

    @classmethod
    def of(cls, results: list[DecodeResult], block_size: int, expected: list[float] | None = None) -> "Evaluation":
        summary = summarize(results, block_size)
        judged = sum(rnd.hit is not None for r in results for rnd in r.rounds)
        return cls(summary["tau_per_prompt"], summary["tau_macro"], summary.get("hit_rate"),
                   summary.get("fallback_rate"),
                   summary["verify_width_mean"], summary.get("packed_share"), summary.get("packed_pass_tokens_mean"),
                   summary["rounds"], judged, expected, sum(expected) / len(expected) if expected else None,
                   results[0].decoder if results else DEFAULT_DECODER)

    @classmethod
    def merge(cls, first: "Evaluation", second: "Evaluation") -> "Evaluation":
        """The evaluation of two disjoint sets of prompts together, as `of` gives it for their results
        at once: per-prompt tau concatenated, each rate weighted by the rounds it is a share of."""

        def pooled(name: str, weights: tuple[float, float]) -> float | None:
            parts = [(getattr(e, name), w) for e, w in zip((first, second), weights) if w]
            total = sum(w for _, w in parts)
            return sum(v * w for v, w in parts) / total if total and all(v is not None for v, _ in parts) else None

        rounds = (first.rounds, second.rounds)
        judged = (first.judged_rounds, second.judged_rounds)
        packed = tuple((e.packed_share or 0.0) * e.rounds for e in (first, second))
        per_prompt = first.tau_per_prompt + second.tau_per_prompt
        both = first.expected_tau_per_prompt is not None and second.expected_tau_per_prompt is not None
        expected = first.expected_tau_per_prompt + second.expected_tau_per_prompt if both else None
        return cls(per_prompt, sum(per_prompt) / len(per_prompt), pooled("hit_rate", judged),
                   pooled("fallback_rate", judged), pooled("width", rounds), pooled("packed_share", rounds),
                   pooled("packed_tokens", packed), sum(rounds), sum(judged), expected,
                   sum(expected) / len(expected) if expected else None, first.decoder)

    def predicted_speedup(self, times: cost.PassTimes | None) -> float | None:
        """Predicted speedup of this drafter's decoder with pass times `times` (None without target times)."""
        if times is None or self.width is None:
            return None
        return cost.predicted_speedup(self.decoder, times, self.tau, self.width, self.fallback_rate or 0.0,
                                      **cost.packed_shape(self.packed_share, self.packed_tokens))


@dataclass
class LayerScore:
    """One layer's score; indices are 0-based (current numbering and in the unpruned drafter). `prompts`:
    the calibration prompts it stands on (fewer than the round's where screening left the layer out after
    its first pass; None in reports from before screening). `age`: None for a score measured in this round;
    k for one carried from the round k steps before (a campaign's round that screens by the previous
    round's ranking keeps the old score of a layer it does not evaluate again). `expected_tau_without`: the
    expected acceptance length without the layer, where the criterion measures it. A ranking criterion's
    score (prune.ranking) measures nothing through the decoder: tau_without, fallback_rate, delta_tau, the
    interval and predicted_speedup are None. `skipped`: True for a layer a pre-screen left unmeasured
    (ScoreConfig.prescreen; its score is the pre-screen's, and it ranks after every measured layer)."""

    layer: int
    original_layer: int
    tau_without: float
    fallback_rate: float | None
    delta_tau: float
    ci_low: float
    ci_high: float
    draft_pass_ms: float
    packed_pass_ms: float
    predicted_speedup: float | None
    score: float
    verify_width: float | None = None
    packed_share: float | None = None
    packed_tokens: float | None = None
    prompts: int | None = None
    age: int | None = None
    expected_tau_without: float | None = None
    skipped: bool | None = None


@dataclass
class ScoreReport:
    """Scores of every layer of one drafter, plus the unpruned baseline (JSON-ready via `to_dict`; `base` None in
    the round of a ranking criterion, which runs no decoder)."""

    base: Evaluation | None
    base_draft_pass_ms: float
    base_packed_pass_ms: float
    base_predicted_speedup: float | None
    target_verify_ms: float | None
    target_ar_ms: float | None
    layers: list[LayerScore]
    settings: dict
    pass_times: dict | None = None

    def ranking(self) -> list[LayerScore]:
        """Layers from least to most harmful to remove: those scored in this round on every prompt first,
        then those a screening round scored on its first prompts only (ScoreConfig.screen_prompts), then
        scores carried from an earlier round (LayerScore.age)."""
        return sorted(self.layers, key=rank_key(self.layers))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, document: dict) -> "ScoreReport":
        """The report of `to_dict` (or of the JSON it was saved as)."""
        fields = {**document, "base": Evaluation(**document["base"]) if document["base"] else None,
                  "layers": [LayerScore(**s) for s in document["layers"]]}
        return cls(**fields)


def rank_key(scores: list[LayerScore]):
    """The sort key of `ScoreReport.ranking` for the layer scores `scores` of one round."""
    every = max((s.prompts or 0) for s in scores) if scores else 0
    return lambda s: (bool(s.skipped), (s.age or 0) > 0, (s.prompts or every) < every, s.score, s.layer)


def carried_scores(previous: list[LayerScore], removed: list[int]) -> list[LayerScore]:
    """The scores of a round, `previous`, carried to the drafter without its layers `removed` (indices in
    the drafter that round scored): the remaining layers' scores, renumbered, one round older."""
    removed = set(removed)
    kept = [s for s in sorted(previous, key=lambda s: s.layer) if s.layer not in removed]
    return [replace(s, layer=index, age=(s.age or 0) + 1) for index, s in enumerate(kept)]


def record_trajectories(target, prompts: list[list[int]], config: DecodeConfig) -> list[list[int]]:
    """The target's greedy trajectory (prompt + output) for each prompt, with the decoders' stop rule."""
    return [prompt + decode_ar(target, prompt, config).output_ids for prompt in prompts]


def expected_tau_per_prompt(drafter, prompts: list[list[int]], trajectories: list[list[int]],
                            blocks_per_pass: int = 32) -> list[float]:
    """`drafter`'s expected acceptance length on each prompt's target trajectory (prompt + greedy output): the
    mean over every anchor of the output (a position whose token and next token are output tokens, where a
    round can start) of prune.training.loss.expected_acceptance, the drafter teacher-forced on the trajectory
    in the sync draft's geometry. One pass lays out the trajectory and `blocks_per_pass` blocks, so memory
    stays linear in the output's length. A prompt whose output has no anchor scores 1 (a round commits its
    bonus token)."""
    from .training.loss import Example, anchor_positions, build_batch, expected_acceptance

    device, dtype = next(drafter.parameters()).device, next(drafter.parameters()).dtype
    means = []
    for prompt, trajectory in zip(prompts, trajectories):
        example = Example.from_prompt_response(trajectory[:len(prompt)], trajectory[len(prompt):])
        anchors = anchor_positions(example.loss_mask).tolist()
        values = [expected_acceptance(drafter, build_batch([example], drafter.config.block_size,
                                                           drafter.config.mask_token_id, 0, anchors=[chunk],
                                                           mask_dtype=dtype).to(device)).double().cpu()
                  for chunk in (anchors[i:i + blocks_per_pass] for i in range(0, len(anchors), blocks_per_pass))]
        means.append(float(torch.cat(values).mean()) if values else 1.0)
    return means


def evaluate(drafter, prompts, config: ScoreConfig, trajectories=None, target=None,
             expected: bool = False) -> Evaluation:
    """tau (and hits) of `drafter` with the decoder of `config`, replayed in batches or live per prompt (`target`:
    the loaded target); with `expected` (a scoring round whose criterion reads it), its expected acceptance
    length per prompt too."""
    block = config.decode.block_size or drafter.config.block_size
    results: list[DecodeResult] = []
    if config.verify == "replay":
        for start in range(0, len(prompts), config.batch_size):
            chunk = slice(start, start + config.batch_size)
            verifiers = [ReplayVerifier(t) for t in trajectories[chunk]]
            results += decode_speculative(config.decoder, drafter, verifiers, prompts[chunk], config.decode)
    else:
        if target is None:
            raise ConfigError("live verification needs the loaded target; load it, or score with --verify replay")
        for prompt in prompts:
            results += decode_speculative(config.decoder, drafter, [LiveVerifier(target)], [prompt], config.decode)
    per_prompt = expected_tau_per_prompt(drafter, prompts, trajectories) if expected else None
    return Evaluation.of(results, block, per_prompt)


def bootstrap_interval(deltas: list[float], resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile interval of the mean of `deltas` under resampling prompts with replacement."""
    values = torch.tensor(deltas, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, len(deltas), (resamples, len(deltas)), generator=generator)
    means = values[index].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def retention_error(candidate: list[float], base: list[float]) -> float:
    """Standard error of the retention mean(candidate) / mean(base), the two measured on the same prompts
    (per-prompt tau, paired; decode.metrics.paired_ratio_error): 0.0 with fewer than two prompts."""
    return paired_ratio_error(candidate, base)


@functools.cache
def expected_best_of(reads: int) -> float:
    """E[max of `reads` independent standard normal draws]: how many standard errors the best of that many
    noisy reads lies above its own true value on average (0 for one read; 0.56, 0.85, 1.03 for 2, 3, 4)."""
    if reads <= 1:
        return 0.0
    # the integral of x * d/dx Phi(x)^reads over [-10, 10], by the midpoint rule: exact to 6 digits
    steps, low, high = 4000, -10.0, 10.0
    width = (high - low) / steps
    total = 0.0
    for i in range(steps):
        x = low + (i + 0.5) * width
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * reads * density * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (reads - 1)
    return total * width


class ScoringMemory:
    """A scoring round's evaluations so far (kept in memory; prune.journal.ScoringJournal keeps them on disk):
    `base` (Evaluation of the drafter on every prompt), `screen_base` (on the first pass's prompts, when the
    round screens), `screened` ({layer: (Evaluation, LayerScore)} of the first pass) and `layers` ({layer:
    LayerScore}, final)."""

    def __init__(self):
        self.base: Evaluation | None = None
        self.screen_base: Evaluation | None = None
        self.screened: dict[int, tuple[Evaluation, LayerScore]] = {}
        self.layers: dict[int, LayerScore] = {}

    def add_base(self, base: Evaluation | None, screen_base: Evaluation | None = None) -> None:
        self.base, self.screen_base = base, screen_base
        self._save()

    def add_screened(self, layer: int, evaluation: Evaluation, score: LayerScore) -> None:
        self.screened[layer] = (evaluation, score)
        self._save()

    def add_layer(self, score: LayerScore) -> None:
        self.layers[score.layer] = score
        self._save()

    def add_layers(self, scores: list[LayerScore]) -> None:
        """Record several final scores at once (a pre-screen's skipped layers: all of them or none)."""
        self.layers.update({score.layer: score for score in scores})
        self._save()

    def record(self, base: Evaluation, layers: list[LayerScore]) -> None:
        """Record a whole round at once (one taken from the score cache)."""
        self.base = base
        self.layers = {score.layer: score for score in layers}
        self._save()

    def _save(self) -> None:
        """Nothing to save in memory."""


def round_evaluations(config: ScoreConfig, layers: int, prompts: int, carried: bool = False) -> int:
    """Evaluations (calls of `on_layer`) in a scoring round of `layers` layers on `prompts` prompts: one per
    layer, and one more per layer that a screening round scores on the rest of the prompts. A screening round
    with `carried` scores (score_layers) evaluates only the carried candidates, unless they fail its check
    (score_layers then reports its new total through `on_total`). A ranking criterion's round calls it once per
    layer; a pre-screened round evaluates only the layers the pre-screen keeps, and carries no scores."""
    if CRITERIA[config.criterion].ranks_round:
        return layers
    if config.prescreen:
        layers, carried = min(layers, config.prescreen_keep), False
    if not config.screen(prompts):
        return layers
    return min(config.screen_keep, layers) if carried else layers + min(config.screen_keep, layers)


def score_layers(drafter, prompts: list[list[int]], config: ScoreConfig, target=None, trajectories=None,
                 on_layer=None, times: cost.PassTimes | None = None,
                 layer_costs: tuple[cost.LayerCost, cost.LayerCost] | None = None, journal=None,
                 carried: list[LayerScore] | None = None, take: int = 1, on_total=None) -> ScoreReport:
    """Score every layer of `drafter` (see the module docstring).

    Args:
        prompts: calibration prompts (token ids).
        target: the target model; needed for live verification, for recording trajectories when none
            are given, and for the target pass times of the speedup prediction.
        trajectories: recorded greedy trajectories (prompt + output) per prompt, for replay.
        on_layer: optional callback(layer index, LayerScore) after each evaluation of a layer, e.g. a progress
            bar (`round_evaluations` calls in all, more when carried scores fail their check; a screened
            layer's first call has its first-pass score).
        on_total: optional callback(evaluations) when the round's count of `on_layer` calls changes from
            `round_evaluations`' (carried scores that fail their check): at once with its most, and again
            with the exact count once the screening pass has ranked the layers.
        times: the pair's pass times (decode.timing.measure_pass_times); None measures them when a target
            is given. The target's times are shared by every layer.
        layer_costs: (sync draft, packed) pass time as functions of depth and head rows
            (decode.timing.drafter_layer_costs):
            the drafters' pass times are then modelled, not timed per layer (a pruning campaign passes its
            own, so a scoring round spends no time on timing and its speedup scores carry no timing noise);
            None times the drafter and every reduced drafter.
        journal: optional store of this round's evaluations (a ScoringMemory; prune.journal.ScoringJournal
            keeps it on disk): what it holds is not evaluated again and each new evaluation is added as it
            finishes, so a killed round resumes at the evaluation it was running.
        carried: the previous round's scores of this drafter's layers (`carried_scores`), in a screening round
            of a campaign: they replace the first pass. The `screen_keep` lowest are scored on every prompt;
            when the `take` lowest of those (the layers the step will remove) still score no higher than every
            other carried score, the others keep their carried scores, else they get a first pass and the
            round screens as usual. Without screening, carried scores are not used.
        take: layers the caller removes after this round (the check above).

    A ranking criterion scores the round at once without the decoder (prune.ranking.rank_round). With a
    pre-screen (ScoreConfig.prescreen) only the layers it keeps are evaluated (prune.ranking.prescreen; the
    others are recorded as skipped), and carried scores are not used.
    """
    from .ranking import prescreen, rank_round

    config.validate()
    if config.needs_trajectories and trajectories is None:
        if target is None:
            raise ConfigError(f"{config.verify} scoring by {config.criterion} needs the target once to record "
                              "trajectories, or trajectories")
        trajectories = record_trajectories(target, prompts, config.decode)
    if CRITERIA[config.criterion].ranks_round:
        return rank_round(drafter, prompts, config, trajectories, layer_costs, journal, on_layer)
    if config.verify == "live" and target is None:
        raise ConfigError("live scoring needs the target model")
    block = config.decode.block_size or drafter.config.block_size
    if times is None and target is not None:
        times = measure_pass_times(target, drafter, config.decode, config.timing_repeats)
    screen = config.screen(len(prompts))
    first = slice(0, screen or len(prompts))

    def run(model, part: slice = slice(None)) -> Evaluation:
        return evaluate(model, prompts[part], config, trajectories and trajectories[part], target,
                        config.needs_expected_tau)

    journal = journal if journal is not None else ScoringMemory()
    skipped = prescreen(drafter, prompts, config, trajectories, journal, layer_costs)
    carried = None if config.prescreen else carried
    if screen and journal.screen_base is None:
        journal.add_base(journal.base, run(drafter, first))
    if journal.base is None:
        base = Evaluation.merge(journal.screen_base, run(drafter, slice(screen, None))) if screen else run(drafter)
        journal.add_base(base, journal.screen_base)
    base, screen_base = journal.base, journal.screen_base or journal.base

    def pass_ms(model) -> tuple[float, float]:
        if layer_costs is not None:
            return tuple(c.at(model.config.num_hidden_layers, head_rows(model)) for c in layer_costs)
        return drafter_pass_ms(model, config.decode.packed_budget, config.timing_repeats)

    def speedup_of(evaluation: Evaluation) -> float | None:
        return evaluation.predicted_speedup(times and times.with_drafter(base_draft_ms, base_packed_ms))

    base_draft_ms, base_packed_ms = pass_ms(drafter)
    base_speedup = speedup_of(base)
    if CRITERIA[config.criterion].needs_speedup and base_speedup is None:
        raise ConfigError(f"the {config.criterion} criterion needs the target's pass times; pass the target, or "
                          "where its outputs are recorded its pass times (--pass-times FILE.json)")
    layers = drafter.config.num_hidden_layers
    original = original_layers(drafter.config)

    def done(layer: int, score: LayerScore) -> None:
        """One evaluation finished (or restored from the journal): the round's progress."""
        if on_layer is not None:
            on_layer(layer, score)

    def score_fully(layer: int, first: tuple[Evaluation, LayerScore] | None = None) -> None:
        """Score `layer` on every prompt: pooling its first-pass evaluation `first` with the other prompts when
        it has one, else on all of them."""
        with without_layers(drafter, [layer]) as reduced:
            if first is None:
                evaluation, ms = run(reduced), pass_ms(reduced)
            else:
                evaluation = Evaluation.merge(first[0], run(reduced, slice(screen, None)))
                ms = (first[1].draft_pass_ms, first[1].packed_pass_ms)
        journal.add_layer(_layer_score(layer, original[layer], base, evaluation, ms, times, base_speedup, config,
                                       prompts=len(prompts)))
        fault_point("score-layer")
        done(layer, journal.layers[layer])

    # A campaign's later rounds screen by the previous round's ranking (`carried`): its lowest layers are scored
    # on every prompt, and while the lowest `take` of them still score below every layer left out, the others
    # keep their carried scores; otherwise the left-out layers get a first pass as in any screening round.
    candidates: list[int] = []
    trusted = False
    if screen and carried:
        order = sorted(carried, key=rank_key(carried))
        candidates = [s.layer for s in order[:config.screen_keep]]
        for layer in candidates:
            if layer in journal.layers:
                done(layer, journal.layers[layer])
            else:
                score_fully(layer)
        left_out = order[config.screen_keep:]
        lowest = sorted(journal.layers[layer].score for layer in candidates)[:take]
        trusted = not left_out or max(lowest) <= min(s.score for s in left_out)
        if trusted:
            for carried_score in left_out:
                if carried_score.layer not in journal.layers:
                    journal.add_layer(carried_score)

    if not trusted:
        if candidates and on_total is not None:  # the left-out layers get a first pass, the best a second
            rest = layers - len(candidates)
            on_total(len(candidates) + rest + min(config.screen_keep, rest))
        screen_speedup = speedup_of(screen_base)
        first_pass = {}  # layer -> (its evaluation on the first prompts, its score there); screening rounds only
        for layer in (layer for layer in range(layers) if layer not in candidates and layer not in skipped):
            if layer in journal.screened or layer in journal.layers:
                first_pass[layer] = journal.screened.get(layer)
                done(layer, first_pass[layer][1] if first_pass[layer] else journal.layers[layer])
                continue
            with without_layers(drafter, [layer]) as reduced:
                evaluation, ms = run(reduced, first), pass_ms(reduced)
            score = _layer_score(layer, original[layer], screen_base, evaluation, ms, times, screen_speedup, config,
                                 prompts=len(evaluation.tau_per_prompt))
            if screen:
                journal.add_screened(layer, evaluation, score)
                first_pass[layer] = (evaluation, score)
            else:
                journal.add_layer(score)
            fault_point("score-layer")
            done(layer, score)
        if screen:
            # Layers scored on every prompt already (carried candidates) take their places among the kept.
            ranked = sorted([(entry[1].score, layer) for layer, entry in first_pass.items() if entry is not None]
                            + [(journal.layers[layer].score, layer) for layer in candidates])
            kept = {layer for _, layer in ranked[:config.screen_keep]}
            if candidates and on_total is not None:
                on_total(layers + len(kept - set(candidates)))
            for _, layer in ranked:
                if layer in candidates:
                    continue
                if layer not in kept:
                    if layer not in journal.layers:
                        journal.add_layer(first_pass[layer][1])  # left out: its first-pass score is final
                elif layer in journal.layers:
                    done(layer, journal.layers[layer])
                else:
                    score_fully(layer, first_pass[layer])

    scores = [journal.layers[layer] for layer in range(layers)]
    settings = {"criterion": config.criterion, "decoder": config.decoder, "verify": config.verify,
                "decode": asdict(config.decode),
                "prompts": len(prompts), "screen_prompts": screen,
                "screen_keep": config.screen_keep if screen else None, "bootstrap": config.bootstrap,
                "confidence": config.confidence, "seed": config.seed,
                "prescreen": config.prescreen, "prescreen_keep": config.prescreen_keep if config.prescreen else None,
                "layers": "0-based; original_layer = index in the unpruned drafter"}
    verify_ms = times.verify_ms(base.width or block) if times is not None else None
    return ScoreReport(base, base_draft_ms, base_packed_ms, base_speedup, verify_ms,
                       times.ar_ms if times is not None else None, scores, settings,
                       times.to_dict() if times is not None else None)


def _layer_score(layer: int, original: int, base: Evaluation, evaluation: Evaluation, pass_ms: tuple[float, float],
                 times: cost.PassTimes | None, base_speedup: float | None, config: ScoreConfig,
                 prompts: int) -> LayerScore:
    """The score of `layer` (`original`: its index in the unpruned drafter) from the evaluation of the drafter
    without it; `pass_ms` = (sync draft, packed) pass times of that drafter in ms."""
    deltas = [b - r for b, r in zip(base.tau_per_prompt, evaluation.tau_per_prompt)]
    low, high = bootstrap_interval(deltas, config.bootstrap, config.confidence, config.seed + layer)
    speedup = evaluation.predicted_speedup(times and times.with_drafter(*pass_ms))
    score = CRITERIA[config.criterion].score(LayerEffect(base, evaluation, base_speedup, speedup))
    return LayerScore(layer, original, evaluation.tau, evaluation.fallback_rate, base.tau - evaluation.tau, low, high,
                      *pass_ms,
                      speedup, score, evaluation.width, evaluation.packed_share, evaluation.packed_tokens, prompts,
                      expected_tau_without=evaluation.expected_tau)


def cached_trajectories(folder: Path | None, source, prompts: list[list[int]], decode: DecodeConfig) -> list:
    """The target's greedy trajectories of `prompts` from `source` (prune.trajectories.TrajectorySource, or a
    loaded target: `record_trajectories`, cached under `folder` by prune.cache.trajectory_key; no cache when
    folder is None)."""
    from .trajectories import as_source

    return as_source(source).trajectories(prompts, decode, folder)


def cached_scores(folder: Path | None, drafter, prompts: list[list[int]], config: ScoreConfig, timing, source,
                  trajectories=None, on_layer=None, journal=None, store: bool = True,
                  carried: list[LayerScore] | None = None, take: int = 1, on_total=None) -> ScoreReport:
    """`score_layers` with the pass times of a campaign's `timing` (prune.state.Timing), cached under `folder`
    by prune.cache.score_key (no cache when folder or source is None; `store` False reads the cache but adds
    nothing to it): `prune score`, `prune run` and sweep trials with the same drafter, prompts, target side
    and settings share the report. `source`: where the target's trajectories come from
    (prune.trajectories.TrajectorySource; a loaded target is its live source). A report taken from the cache
    calls `on_layer` for no layer and is recorded in `journal` whole, as a computed round leaves it. A round
    that uses `carried` scores (score_layers) is never stored: it is not the full round that `prune score`
    caches."""
    from .trajectories import as_source

    source = as_source(source)
    target = loaded_target(source) if source is not None else None
    layers = drafter.config.num_hidden_layers
    if trajectories is None and config.needs_trajectories and source is not None:
        # Live scoring by expected acceptance: the trajectories once, not in every round.
        trajectories = source.trajectories(prompts, config.decode, folder)

    def score() -> ScoreReport:
        return score_layers(drafter, prompts, config, target=target, trajectories=trajectories, on_layer=on_layer,
                            times=timing.pass_times(layers, head_rows(drafter)), layer_costs=timing.layer_costs(),
                            journal=journal,
                            carried=carried, take=take, on_total=on_total)

    if folder is None or source is None:
        return score()
    key = score_key(drafter, source, prompts, config, timing.to_dict())
    store = store and not (carried and config.screen(len(prompts)))
    report = ScoreReport.from_dict(cached_json(Path(folder) / "scores", key, lambda: score().to_dict(), store))
    if journal is not None and len(journal.layers) < len(report.layers):
        journal.record(report.base, report.layers)
    return report
