"""Layer-scoring criteria (docs/design.md, Scoring): the one table that scoring, the CLI and sweeps read.

The table holds two kinds. A `Criterion` (a per-layer effect) turns what one layer's removal did
(`LayerEffect`: the async decoder's measurements of the drafter with and without the layer, and their
predicted speedups) into the layer's score. A `Ranking` scores every layer of a round at once without the
decoder (prune.ranking): from one forward pass per batch (ShortGPT's block influence, the angular distance
of Gromov et al.), from the drafter's training loss on held-in data without each layer (as SLEB and
Shortened LLaMA use perplexity), or from no model at all (the last layers, a seeded random order). A
ranking is also the pre-screen of a measured criterion (ScoreConfig.prescreen). Either way the pruner
removes the layers with the lowest scores first (lower = less harmful). Adding a criterion is one entry in
CRITERIA plus its function; `--criterion` and `--prescreen` choices, their help, validation and the
search space's check all follow from the table. Nothing here imports torch.
"""

from dataclasses import dataclass
from typing import Callable, ClassVar


@dataclass(frozen=True)
class LayerEffect:
    """What removing one layer did, measured on the calibration prompts.

    Attributes:
        base, without: prune.scoring.Evaluation of the drafter with all its layers and without this one
            (tau, per-prompt tau, hit and fallback rates, mean verify width, packed-pass share and size).
        base_speedup, speedup: their predicted async speedups over the target alone (None without the
            target's pass times).
    """

    base: object
    without: object
    base_speedup: float | None
    speedup: float | None


@dataclass(frozen=True)
class Criterion:
    """One scoring criterion.

    Attributes:
        name: the `--criterion` value (and the search space's `criterion` choice).
        help: what the score measures, for --help.
        score: function(LayerEffect) -> float, the layer's score (lower: removed first).
        needs_speedup: scores need predicted speedups, so the target's pass times.
        needs_expected_tau: scores need the evaluations' expected acceptance lengths (their `expected_tau`,
            computed on the target's trajectories of the calibration prompts).
    """

    name: str
    help: str
    score: Callable[[LayerEffect], float]
    needs_speedup: bool = False
    needs_expected_tau: bool = False
    ranks_round: ClassVar[bool] = False
    reads: ClassVar[str | None] = None


@dataclass(frozen=True)
class Ranking:
    """One criterion that scores every layer of a round at once, without the decoder.

    Attributes:
        name: the `--criterion` / `--prescreen` value.
        help: what the score measures, for --help.
        rank: function(drafter, prune.ranking.RankInputs) -> [score per layer] (current indices; lower: removed
            first).
        reads: what it runs the drafter on: "trajectories" (the calibration prompts' target trajectories laid
            out as block-denoising inputs, prune.ranking.denoising_batches), "loss data" (held-in distillation
            examples, ScoreConfig.loss_data) or None (no model pass).
        one_pass: every layer's score comes from one forward pass of the drafter per batch.
    """

    name: str
    help: str
    rank: Callable[[object, object], list[float]]
    reads: str | None = None
    one_pass: bool = False
    ranks_round: ClassVar[bool] = True
    needs_speedup: ClassVar[bool] = False
    needs_expected_tau: ClassVar[bool] = False


def tau_drop(effect: LayerEffect) -> float:
    """The drop in mean acceptance length (calibration tau) without the layer."""
    return effect.base.tau - effect.without.tau


def expected_tau_drop(effect: LayerEffect) -> float:
    """The drop in expected acceptance length without the layer: per calibration prompt, the mean over the
    target's trajectory of 1 + sum_k p_1 ... p_k, with p_i the drafter's probability of the target's token at
    draft slot i (prune.scoring.expected_tau_per_prompt)."""
    return effect.base.expected_tau - effect.without.expected_tau


def speedup_drop(effect: LayerEffect) -> float:
    """The drop in predicted async speedup without the layer (its tau and its shorter drafter passes)."""
    return effect.base_speedup - effect.speedup


def block_influence(drafter, inputs) -> list[float]:
    """ShortGPT's Block Influence per layer: 1 - the mean cosine between the layer's input and output hidden
    states over every token of the block-denoising inputs (clean context and mask slots)."""
    from .ranking import layer_similarity

    return [1.0 - c for c in layer_similarity(drafter, inputs).token_cosine]


def angular_distance(drafter, inputs) -> list[float]:
    """Gromov et al.'s angular distance per layer: the mean of arccos(cosine) / pi between the layer's input and
    output over the mask slots of the block-denoising inputs (the positions the drafter predicts)."""
    from .ranking import layer_similarity

    return layer_similarity(drafter, inputs).slot_angle


def loss_rise(drafter, inputs) -> list[float]:
    """The rise in the drafter's training loss (prune.training.loss.drafter_loss) on held-in examples without
    each layer."""
    from .ranking import loss_without_each_layer

    return loss_without_each_layer(drafter, inputs)


def from_the_top(drafter, inputs) -> list[float]:
    """Layer i of n scores n - 1 - i: the last layer goes first, then the one below it."""
    layers = drafter.config.num_hidden_layers
    return [float(layers - 1 - i) for i in range(layers)]


def random_order(drafter, inputs) -> list[float]:
    """Each layer's place in one random order of the original layer indices, drawn from the scoring seed: every
    round of a run removes the next remaining layers of the same order."""
    from .ranking import seeded_order

    return seeded_order(drafter, inputs.seed)


CRITERIA: dict[str, Criterion | Ranking] = {criterion.name: criterion for criterion in (
    Criterion("tau", "drop in acceptance length", tau_drop),
    Criterion("speedup", "drop in predicted speedup", speedup_drop, needs_speedup=True),
    Criterion("expected-tau", "drop in expected acceptance length on the target's trajectories (the drafter's "
              "probabilities of the target's tokens; smooth where tau on few prompts is not)", expected_tau_drop,
              needs_expected_tau=True),
    Ranking("block-influence", "1 - cosine between a layer's input and output hidden states over the tokens of the "
            "calibration trajectories, every layer from one pass (ShortGPT; no decoder)", block_influence,
            reads="trajectories", one_pass=True),
    Ranking("angular", "angular distance arccos(cos)/pi between a layer's input and output at the mask slots the "
            "drafter predicts, every layer from one pass (Gromov et al.; no decoder)", angular_distance,
            reads="trajectories", one_pass=True),
    Ranking("loss", "rise in the drafter's training loss on held-in distillation data (--loss-data) without the "
            "layer (as SLEB / Shortened LLaMA use perplexity; no decoder)", loss_rise, reads="loss data"),
    Ranking("last", "the last layers first, from the top down", from_the_top),
    Ranking("random", "a random order of the layers, drawn from --seed", random_order),
)}
DEFAULT_CRITERION = "tau"


def rankings() -> tuple[str, ...]:
    """The names of the criteria that rank a whole round at once (the `--prescreen` choices)."""
    return tuple(name for name, criterion in CRITERIA.items() if criterion.ranks_round)


def describe() -> str:
    """`name: help; ...` of every criterion, for --help."""
    return "; ".join(f"{name}: {criterion.help}" for name, criterion in CRITERIA.items())

