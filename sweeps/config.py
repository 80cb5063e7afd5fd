"""Settings of a sweep: the one home of their defaults and choices, read by sweeps/ and by `prune sweep`
(nothing here imports torch or optuna)."""

from dataclasses import dataclass, field

from models.errors import ConfigError, one_of
from models.shards import DEFAULT_MAX_SHARD_SIZE
from prune.config import DEFAULT_VOCAB_SIZES, HealConfig, ScoreConfig

COSTS = ("layers", "packed_ms")  # the cost objective of the Pareto mode: layers left, predicted packed-pass ms
MODES = (("maximize",), ("maximize", "minimize"))  # --directions: predicted speedup; retention vs cost
PRUNERS = ("median", "none")  # stop unpromising trials early (Optuna's median pruner), or never
TRIAL_BOOTSTRAP = 200  # bootstrap resamples of a trial's scoring rounds: its intervals are reported, never used


@dataclass
class SweepConfig:
    """Settings of a sweep.

    Attributes:
        study: the Optuna study name (also the W&B group of its trials).
        out: the folder that receives OUT/trial-NNNN of each trial run by this worker.
        directions: ("maximize",): predicted speedup; ("maximize", "minimize"): retention vs cost.
        retention_floor: least eval retention of a feasible trial; also the least `min_retention`.
        cost: the cost objective of the multi-objective mode: "layers" or "packed_ms".
        seed: seeds the samplers (per trial number, so workers never repeat each other's draws).
        score, heal: campaign settings that the search space does not set (decoding, verify, batch...).
        export_dtype: dtype of the trials' exported steps; "source": the dtype the drafter is stored in.
        max_shard_size: largest weight file of the trials' exported steps (bytes or "5GB"); heavier steps are
            written as shards (models/shards.py).
        vocab_sizes: the draft vocabulary sizes trials' head steps may try (prune.config.RunConfig.vocab_sizes),
            down to the space's `vocab_size` where it sets one; () when the sweep has no ids' ranking.
    """

    study: str
    out: str
    directions: tuple[str, ...] = MODES[0]
    retention_floor: float = 0.95
    cost: str = COSTS[0]
    seed: int = 0
    score: ScoreConfig = field(default_factory=ScoreConfig)
    heal: HealConfig = field(default_factory=HealConfig)
    export_dtype: str = "source"
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    vocab_sizes: tuple[int, ...] = DEFAULT_VOCAB_SIZES

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) == 2

    def objective_names(self) -> list[str]:
        return ["eval_retention", self.cost] if self.multi_objective else ["predicted_speedup"]

    def validate(self) -> None:
        directions = tuple(self.directions)
        if directions not in MODES:
            raise ConfigError(
                f"--directions {' '.join(directions)} is not a mode of prune sweep: use `maximize` (predicted "
                "speedup under a retention floor) or `maximize minimize` (retention vs drafter cost, Pareto front)"
            )
        if not 0 < self.retention_floor <= 1:
            raise ConfigError(f"--retention-floor {self.retention_floor} must be in (0, 1]")
        if self.cost not in COSTS:
            raise ConfigError(f"unknown cost {self.cost!r}; choose {one_of(COSTS)} (--cost)")
        if not self.study or any(c in self.study for c in "/\\"):
            raise ConfigError(f"study name {self.study!r} must be non-empty without slashes (--study)")

    def record(self) -> dict:
        return {"directions": list(self.directions), "objectives": self.objective_names(),
                "retention_floor": self.retention_floor, "cost": self.cost}
