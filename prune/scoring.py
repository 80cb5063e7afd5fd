"""Layer importance: how much acceptance length drops when one layer is removed (docs/design.md, Scoring).

A layer's score compares the drafter with and without it, both measured by the real async decoder on
calibration prompts; the criterion (prune.criteria) says how: by default tau(current drafter) - tau(current
drafter without that layer). With `verify="replay"` the target runs once per prompt to record
its greedy trajectory, and every evaluation after that costs drafter passes only (prompts are batched
into one drafter pass); `verify="live"` runs the target in every evaluation. A paired bootstrap over
prompts gives a confidence interval per layer, so a too-small calibration set shows as wide intervals.

The `speedup` criterion scores a layer by the drop in predicted async speedup instead (decode.cost: the
target's pass times measured once, each reduced drafter's own pass times, its tau, verify width and
fallback rate). Settings: prune.config.ScoreConfig; reports are cached by prune.cache.score_key.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from decode import cost
from decode.config import DecodeConfig
from decode.decoders import DecodeResult, decode_ar, decode_speculative
from decode.metrics import summarize
from decode.timing import drafter_pass_ms, measure_pass_times
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.errors import ConfigError
from models.faults import fault_point
from models.surgery import remove_layers

from .cache import cached_json, score_key, trajectory_key
from .config import ScoreConfig
from .criteria import CRITERIA, LayerEffect


@dataclass
class Evaluation:
    """The async decoder's measurements of one drafter on the calibration prompts (width: mean verify width)."""

    tau_per_prompt: list[float]
    tau: float
    hit_rate: float | None
    fallback_rate: float | None
    width: float | None = None
    packed_share: float | None = None
    packed_tokens: float | None = None

    @classmethod
    def of(cls, results: list[DecodeResult], block_size: int) -> "Evaluation":
        summary = summarize(results, block_size)
        return cls(summary["tau_per_prompt"], summary["tau_macro"], summary["hit_rate"], summary["fallback_rate"],
                   summary["verify_width_mean"], summary.get("packed_share"), summary.get("packed_pass_tokens_mean"))

    def predicted_speedup(self, times: cost.PassTimes | None) -> float | None:
        """Predicted async speedup of this drafter with pass times `times` (None without target times)."""
        if times is None or self.width is None:
            return None
        shape = {} if self.packed_share is None else {"packed_share": self.packed_share,
                                                      "packed_tokens": self.packed_tokens}
        return cost.predicted_speedup("async", times, self.tau, self.width, self.fallback_rate or 0.0, **shape)


@dataclass
class LayerScore:
    """One layer's score; indices are 0-based (current numbering and in the unpruned drafter)."""

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


@dataclass
class ScoreReport:
    """Scores of every layer of one drafter, plus the unpruned baseline (JSON-ready via `to_dict`)."""

    base: Evaluation
    base_draft_pass_ms: float
    base_packed_pass_ms: float
    base_predicted_speedup: float | None
    target_verify_ms: float | None
    target_ar_ms: float | None
    layers: list[LayerScore]
    settings: dict
    pass_times: dict | None = None

    def ranking(self) -> list[LayerScore]:
        """Layers from least to most harmful to remove."""
        return sorted(self.layers, key=lambda s: (s.score, s.layer))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, document: dict) -> "ScoreReport":
        """The report of `to_dict` (or of the JSON it was saved as)."""
        fields = {**document, "base": Evaluation(**document["base"]),
                  "layers": [LayerScore(**s) for s in document["layers"]]}
        return cls(**fields)


def record_trajectories(target, prompts: list[list[int]], config: DecodeConfig) -> list[list[int]]:
    """The target's greedy trajectory (prompt + output) for each prompt, with the decoders' stop rule."""
    return [prompt + decode_ar(target, prompt, config).output_ids for prompt in prompts]


def evaluate(drafter, prompts, config: ScoreConfig, trajectories=None, target=None) -> Evaluation:
    """tau (and hits) of `drafter` with the async decoder, replayed in batches or live per prompt."""
    block = config.decode.block_size or drafter.config.block_size
    results: list[DecodeResult] = []
    if config.verify == "replay":
        for start in range(0, len(prompts), config.batch_size):
            chunk = slice(start, start + config.batch_size)
            verifiers = [ReplayVerifier(t) for t in trajectories[chunk]]
            results += decode_speculative("async", drafter, verifiers, prompts[chunk], config.decode)
    else:
        for prompt in prompts:
            results += decode_speculative("async", drafter, [LiveVerifier(target)], [prompt], config.decode)
    return Evaluation.of(results, block)


def bootstrap_interval(deltas: list[float], resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile interval of the mean of `deltas` under resampling prompts with replacement."""
    values = torch.tensor(deltas, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, len(deltas), (resamples, len(deltas)), generator=generator)
    means = values[index].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def score_layers(drafter, prompts: list[list[int]], config: ScoreConfig, target=None, trajectories=None,
                 on_layer=None, times: cost.PassTimes | None = None,
                 layer_costs: tuple[cost.LayerCost, cost.LayerCost] | None = None, journal=None) -> ScoreReport:
    """Score every layer of `drafter` (see the module docstring).

    Args:
        prompts: calibration prompts (token ids).
        target: the target model; needed for live verification, for recording trajectories when none
            are given, and for the target pass times of the speedup prediction.
        trajectories: recorded greedy trajectories (prompt + output) per prompt, for replay.
        on_layer: optional callback(layer index, LayerScore) after each layer, e.g. a progress bar.
        times: the pair's pass times (decode.timing.measure_pass_times); None measures them when a target
            is given. The target's times are shared by every layer.
        layer_costs: (sync draft, packed) pass time as functions of depth (decode.timing.drafter_layer_costs):
            the drafters' pass times are then modelled, not timed per layer (a pruning campaign passes its
            own, so a scoring round spends no time on timing and its speedup scores carry no timing noise);
            None times the drafter and every reduced drafter.
        journal: optional store of this round's evaluations (prune.journal.ScoringJournal: `base`, `layers`
            {index: LayerScore}, `add_base`, `add_layer`): what it holds is not evaluated again and each new
            evaluation is added as it finishes, so a killed round resumes at the layer it was evaluating.
    """
    config.validate()
    if config.verify == "replay" and trajectories is None:
        if target is None:
            raise ConfigError("replay scoring needs the target once to record trajectories, or trajectories")
        trajectories = record_trajectories(target, prompts, config.decode)
    if config.verify == "live" and target is None:
        raise ConfigError("live scoring needs the target model")
    block = config.decode.block_size or drafter.config.block_size
    if times is None and target is not None:
        times = measure_pass_times(target, drafter, config.decode, config.timing_repeats)
    base = journal.base if journal is not None and journal.base is not None else None
    if base is None:
        base = evaluate(drafter, prompts, config, trajectories, target)
        if journal is not None:
            journal.add_base(base)

    def pass_ms(model) -> tuple[float, float]:
        if layer_costs is not None:
            return tuple(c.at(model.config.num_hidden_layers) for c in layer_costs)
        return drafter_pass_ms(model, config.decode.packed_budget, config.timing_repeats)

    base_draft_ms, base_packed_ms = pass_ms(drafter)
    base_speedup = base.predicted_speedup(times and times.with_drafter(base_draft_ms, base_packed_ms))
    if CRITERIA[config.criterion].needs_speedup and base_speedup is None:
        raise ConfigError(f"the {config.criterion} criterion needs the target's pass times; pass the target")
    original = list(getattr(drafter.config, "original_layer_indices", None) or range(drafter.config.num_hidden_layers))
    scores = []
    for layer in range(drafter.config.num_hidden_layers):
        if journal is not None and layer in journal.layers:
            scores.append(journal.layers[layer])
        else:
            reduced = remove_layers(drafter, [layer])
            evaluation = evaluate(reduced, prompts, config, trajectories, target)
            scores.append(_layer_score(layer, original[layer], base, evaluation, pass_ms(reduced), times,
                                       base_speedup, config))
            del reduced
            if journal is not None:
                journal.add_layer(scores[-1])
            fault_point("score-layer")
        if on_layer is not None:
            on_layer(layer, scores[-1])
    settings = {"criterion": config.criterion, "verify": config.verify, "decode": asdict(config.decode),
                "prompts": len(prompts), "bootstrap": config.bootstrap, "confidence": config.confidence,
                "seed": config.seed, "layers": "0-based; original_layer = index in the unpruned drafter"}
    verify_ms = times.verify_ms(base.width or block) if times is not None else None
    return ScoreReport(base, base_draft_ms, base_packed_ms, base_speedup, verify_ms,
                       times.ar_ms if times is not None else None, scores, settings,
                       times.to_dict() if times is not None else None)


def _layer_score(layer: int, original: int, base: Evaluation, evaluation: Evaluation, pass_ms: tuple[float, float],
                 times: cost.PassTimes | None, base_speedup: float | None, config: ScoreConfig) -> LayerScore:
    """The score of `layer` (`original`: its index in the unpruned drafter) from the evaluation of the drafter
    without it; `pass_ms` = (sync draft, packed) pass times of that drafter in ms."""
    deltas = [b - r for b, r in zip(base.tau_per_prompt, evaluation.tau_per_prompt)]
    low, high = bootstrap_interval(deltas, config.bootstrap, config.confidence, config.seed + layer)
    speedup = evaluation.predicted_speedup(times and times.with_drafter(*pass_ms))
    score = CRITERIA[config.criterion].score(LayerEffect(base, evaluation, base_speedup, speedup))
    return LayerScore(layer, original, evaluation.tau, evaluation.fallback_rate, base.tau - evaluation.tau, low, high,
                      *pass_ms,
                      speedup, score, evaluation.width, evaluation.packed_share, evaluation.packed_tokens)


def cached_trajectories(folder: Path | None, target, prompts: list[list[int]], decode: DecodeConfig) -> list:
    """`record_trajectories`, cached under `folder` by prune.cache.trajectory_key (no cache when folder is None)."""
    key = trajectory_key(target, prompts, decode)
    return cached_json(folder and Path(folder) / "trajectories", key,
                       lambda: record_trajectories(target, prompts, decode))


def cached_scores(folder: Path | None, drafter, prompts: list[list[int]], config: ScoreConfig, timing, target,
                  trajectories=None, on_layer=None, journal=None, store: bool = True) -> ScoreReport:
    """`score_layers` with the pass times of a campaign's `timing` (prune.state.Timing), cached under `folder`
    by prune.cache.score_key (no cache when folder or target is None; `store` False reads the cache but adds
    nothing to it): `prune score`, `prune run` and sweep trials with the same drafter, prompts, target and
    settings share the report. A report taken from the cache calls `on_layer` for no layer and is recorded
    in `journal` whole, as a computed round leaves it."""
    layers = drafter.config.num_hidden_layers

    def score() -> ScoreReport:
        return score_layers(drafter, prompts, config, target=target, trajectories=trajectories, on_layer=on_layer,
                            times=timing.pass_times(layers), layer_costs=timing.layer_costs(), journal=journal)

    if folder is None or target is None:
        return score()
    key = score_key(drafter, target, prompts, config, timing.to_dict())
    report = ScoreReport.from_dict(cached_json(Path(folder) / "scores", key, lambda: score().to_dict(), store))
    if journal is not None and len(journal.layers) < len(report.layers):
        journal.record(report.base, report.layers)
    return report
