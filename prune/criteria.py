"""Layer-scoring criteria (docs/design.md, Scoring): the one table that scoring, the CLI and sweeps read.

A criterion turns what one layer's removal did (`LayerEffect`: the async decoder's measurements of the
drafter with and without the layer, and their predicted speedups) into the layer's score; the pruner
removes the layers with the lowest scores first (lower = less harmful). Adding a criterion is one entry
in CRITERIA plus its function; `--criterion` choices, their help, validation and the search space's
check all follow from the table. Nothing here imports torch.
"""

from dataclasses import dataclass
from typing import Callable


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


CRITERIA: dict[str, Criterion] = {criterion.name: criterion for criterion in (
    Criterion("tau", "drop in acceptance length", tau_drop),
    Criterion("speedup", "drop in predicted speedup", speedup_drop, needs_speedup=True),
    Criterion("expected-tau", "drop in expected acceptance length on the target's trajectories (the drafter's "
              "probabilities of the target's tokens; smooth where tau on few prompts is not)", expected_tau_drop,
              needs_expected_tau=True),
)}
DEFAULT_CRITERION = "tau"


def describe() -> str:
    """`name: help; ...` of every criterion, for --help."""
    return "; ".join(f"{name}: {criterion.help}" for name, criterion in CRITERIA.items())

