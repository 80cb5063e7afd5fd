"""Layer importance: how much acceptance length drops when one layer is removed (DESIGN sections 5-6).

Score(layer) = tau(current drafter) - tau(current drafter without that layer), measured by the real
async decoder on calibration prompts. With `verify="replay"` the target runs once per prompt to record
its greedy trajectory, and every evaluation after that costs drafter passes only (prompts are batched
into one drafter pass); `verify="live"` runs the target in every evaluation. A paired bootstrap over
prompts gives a confidence interval per layer, so a too-small calibration set shows as wide intervals.

The `speedup` criterion scores a layer by the drop in predicted speedup instead: the async round is
modelled as max(verify pass, packed pass) + fallback rate x sync draft pass, with pass times measured
on this machine, and predicted speedup = tau x (ar time per token) / (round time).
"""

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from decode.decoders import DecodeConfig, DecodeResult, decode_ar, decode_speculative
from decode.engine import DraftEngine, DraftRequest
from decode.metrics import summarize
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.errors import ConfigError
from models.masks import BlockSpec
from models.surgery import remove_layers

CRITERIA = ("tau", "speedup")


@dataclass
class ScoreConfig:
    """How layers are scored.

    Attributes:
        criterion: "tau" (drop in mean acceptance length) or "speedup" (drop in predicted speedup).
        verify: "replay" (recorded target trajectories; drafter cost only) or "live".
        decode: decoder settings (greedy; max_new_tokens, budget, stop ids).
        batch_size: prompts per batched drafter pass in replay.
        bootstrap: resamples for the confidence interval; confidence: its level.
        timing_repeats: timed passes per measurement (the median is kept).
        seed: seeds the bootstrap.
    """

    criterion: str = "tau"
    verify: str = "replay"
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    batch_size: int = 16
    bootstrap: int = 1000
    confidence: float = 0.95
    timing_repeats: int = 5
    seed: int = 0

    def validate(self) -> None:
        if self.criterion not in CRITERIA:
            raise ConfigError(f"unknown criterion {self.criterion!r}; choose tau or speedup (--criterion)")
        if self.verify not in ("replay", "live"):
            raise ConfigError(f"unknown verify mode {self.verify!r}; choose replay or live (--verify)")
        if self.decode.temperature != 0:
            raise ConfigError("layer scoring is greedy; use temperature 0")
        if self.batch_size < 1 or self.bootstrap < 1 or not 0 < self.confidence < 1:
            raise ConfigError("batch_size and bootstrap must be >= 1 and confidence in (0, 1)")


@dataclass
class Evaluation:
    """The async decoder's measurements of one drafter on the calibration prompts."""

    tau_per_prompt: list[float]
    tau: float
    hit_rate: float | None
    fallback_rate: float | None

    @classmethod
    def of(cls, results: list[DecodeResult], block_size: int) -> "Evaluation":
        summary = summarize(results, block_size)
        return cls(summary["tau_per_prompt"], summary["tau_macro"], summary["hit_rate"], summary["fallback_rate"])


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

    def ranking(self) -> list[LayerScore]:
        """Layers from least to most harmful to remove."""
        return sorted(self.layers, key=lambda s: (s.score, s.layer))

    def to_dict(self) -> dict:
        return asdict(self)


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


def pass_times_ms(drafter, config: ScoreConfig, context: int = 64) -> tuple[float, float]:
    """Median wall time (ms) of a sync draft pass and of a full-budget packed pass after `context` tokens."""
    block = drafter.config.block_size
    ids = (torch.arange(context) % max(2, drafter.config.mask_token_id)).tolist()
    chain = ids[:block]  # the tokens' values do not change the cost
    candidates = max(1, min(block - 1, config.decode.packed_budget // (block + 1)))
    requests = {
        "draft": DraftRequest(chain[:1], [BlockSpec(context)]),
        "packed": DraftRequest(chain, [BlockSpec(context + a, guess=chain[a]) for a in range(candidates)]),
    }
    engine = DraftEngine(drafter, rows=1)
    engine.forward([DraftRequest(ids, [])])
    engine.keep([context])
    times = {}
    for name, request in requests.items():
        samples = []
        for _ in range(config.timing_repeats + 1):  # the first run warms up
            start = time.perf_counter()
            engine.forward([request])
            samples.append(1000 * (time.perf_counter() - start))
            engine.keep([0])  # back to the same `context` cached tokens for the next sample
        times[name] = statistics.median(samples[1:])
    return times["draft"], times["packed"]


def target_times_ms(target, block: int, repeats: int, context: int = 64) -> tuple[float, float]:
    """Median wall time (ms) of a target verify pass of `block` tokens and of a one-token (ar) pass."""
    ids = (torch.arange(context) % 100).tolist()
    times = []
    for fed in (block, 1):
        samples = []
        for _ in range(repeats + 1):
            verifier = LiveVerifier(target)
            verifier.prefill(ids)
            start = time.perf_counter()
            verifier.verify(ids[:fed])
            samples.append(1000 * (time.perf_counter() - start))
        times.append(statistics.median(samples[1:]))
    return times[0], times[1]


def predicted_speedup(evaluation: Evaluation, draft_ms: float, packed_ms: float, verify_ms, ar_ms) -> float | None:
    """tau x ar time per token / modelled async round time (ideal overlap of verify and packed pass)."""
    if verify_ms is None or ar_ms is None:
        return None
    round_ms = max(verify_ms, packed_ms) + (evaluation.fallback_rate or 0.0) * draft_ms
    return evaluation.tau * ar_ms / round_ms


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
                 on_layer=None) -> ScoreReport:
    """Score every layer of `drafter` (see the module docstring).

    Args:
        prompts: calibration prompts (token ids).
        target: the target model; needed for live verification, for recording trajectories when none
            are given, and for the target pass times of the speedup prediction.
        trajectories: recorded greedy trajectories (prompt + output) per prompt, for replay.
        on_layer: optional callback(layer index, LayerScore) after each layer, e.g. a progress bar.
    """
    config.validate()
    if config.verify == "replay" and trajectories is None:
        if target is None:
            raise ConfigError("replay scoring needs the target once to record trajectories, or trajectories")
        trajectories = record_trajectories(target, prompts, config.decode)
    if config.verify == "live" and target is None:
        raise ConfigError("live scoring needs the target model")
    block = config.decode.block_size or drafter.config.block_size
    verify_ms = ar_ms = None
    if target is not None:
        verify_ms, ar_ms = target_times_ms(target, block, config.timing_repeats)
    base = evaluate(drafter, prompts, config, trajectories, target)
    base_draft_ms, base_packed_ms = pass_times_ms(drafter, config)
    base_speedup = predicted_speedup(base, base_draft_ms, base_packed_ms, verify_ms, ar_ms)
    if config.criterion == "speedup" and base_speedup is None:
        raise ConfigError("the speedup criterion needs the target's pass times; pass the target")
    original = list(getattr(drafter.config, "original_layer_indices", None) or range(drafter.config.num_hidden_layers))
    scores = []
    for layer in range(drafter.config.num_hidden_layers):
        reduced = remove_layers(drafter, [layer])
        evaluation = evaluate(reduced, prompts, config, trajectories, target)
        deltas = [b - r for b, r in zip(base.tau_per_prompt, evaluation.tau_per_prompt)]
        low, high = bootstrap_interval(deltas, config.bootstrap, config.confidence, config.seed + layer)
        draft_ms, packed_ms = pass_times_ms(reduced, config)
        speedup = predicted_speedup(evaluation, draft_ms, packed_ms, verify_ms, ar_ms)
        delta = base.tau - evaluation.tau
        score = delta if config.criterion == "tau" else base_speedup - speedup
        scores.append(LayerScore(layer, original[layer], evaluation.tau, evaluation.fallback_rate, delta, low, high,
                                 draft_ms, packed_ms, speedup, score))
        if on_layer is not None:
            on_layer(layer, scores[-1])
        del reduced
    settings = {"criterion": config.criterion, "verify": config.verify, "decode": asdict(config.decode),
                "prompts": len(prompts), "bootstrap": config.bootstrap, "confidence": config.confidence,
                "seed": config.seed, "layers": "0-based; original_layer = index in the unpruned drafter"}
    return ScoreReport(base, base_draft_ms, base_packed_ms, base_speedup, verify_ms, ar_ms, scores, settings)


def fingerprint(*parts) -> str:
    """A stable sha256 over JSON-able parts and tensors' bytes (for cache keys)."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.nn.Module):
            for name, tensor in sorted(part.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cached_json(folder: Path | None, key: str, compute):
    """`compute()` once per key: the JSON result is kept in `folder/key.json` (written atomically)."""
    if folder is None:
        return compute()
    file = Path(folder) / f"{key}.json"
    if file.is_file():
        return json.loads(file.read_text())
    result = compute()
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    tmp.replace(file)
    return result
