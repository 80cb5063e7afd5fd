"""Settings of scoring, healing and a pruning campaign: one dataclass per concern, the one home of their
defaults and validation, read by the library and by the `prune` command line (nothing here imports torch).
"""

import json
from dataclasses import asdict, dataclass, field, is_dataclass, replace

from decode.config import VERIFY_MODES, DecodeConfig
from decode.registry import SPECULATIVE, names
from models.errors import ConfigError, one_of

from .criteria import CRITERIA, DEFAULT_CRITERION, rankings
from .training.config import TrainConfig

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The speculative decoder scoring measures with, by default D3D's own; a drafter served by an engine that drafts
# and verifies in turn (vLLM and SGLang do) is measured as it will run with "sync".
DEFAULT_DECODER = "async"
SCORING_DECODERS = names(SPECULATIVE)
# The draft vocabulary sizes a campaign's head steps try (RunConfig.vocab_sizes), largest first.
DEFAULT_VOCAB_SIZES = (32768, 16384, 8192, 4096, 2048)


@dataclass
class ScoreConfig:
    """How layers are scored (prune.scoring).

    Attributes:
        criterion: a name of prune.criteria.CRITERIA: a per-layer effect measured through the decoder ("tau":
            drop in mean acceptance length, "speedup": drop in predicted speedup, "expected-tau": drop in
            expected acceptance length) or a ranking of the whole round without it ("block-influence",
            "angular", "loss", "last", "random"; prune.ranking).
        decoder: the speculative decoder (decode.registry) whose tau and predicted speedup are measured:
            "async" (D3D's) or "sync".
        verify: "replay" (recorded target trajectories; drafter cost only) or "live".
        decode: decoder settings (greedy; max_new_tokens, budget, stop ids).
        batch_size: prompts per batched drafter pass in replay.
        bootstrap: resamples for the confidence interval; confidence: its level.
        timing_repeats: timed passes per measurement (the median is kept).
        seed: seeds the bootstrap.
        screen_prompts: a first pass evaluates every layer on the first `screen_prompts` prompts; only the
            `screen_keep` layers that score lowest there are evaluated on the rest. The others keep their
            first-pass score (LayerScore.prompts says on how many prompts a score stands) and rank after
            every layer scored on all prompts. 0, or at least as many as there are prompts: every layer on
            every prompt. (A layer that scores far above the least harmful ones on half the prompts is not
            removed in this step whatever the other half says; the round then costs about two thirds.)
        screen_keep: layers scored on every prompt after the first pass (at least the layers a step removes).
        prescreen: None, or a ranking criterion (prune.criteria.rankings) that ranks every layer first: only the
            `prescreen_keep` layers it ranks most removable are measured by `criterion`; the others are recorded
            as skipped (LayerScore.skipped) and rank after every measured layer.
        prescreen_keep: layers a pre-screen leaves to be measured (at least the layers a step removes).
        loss_data: distillation data folders (prune distill output) the "loss" criterion reads (held-in
            data: what the drafter was trained on); empty where nothing reads them.
        loss_examples: sequences drawn from them (seeded by `seed`), 16 blocks each.
    """

    criterion: str = DEFAULT_CRITERION
    verify: str = "replay"
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    batch_size: int = 16
    bootstrap: int = 1000
    confidence: float = 0.95
    timing_repeats: int = 5
    seed: int = 0
    screen_prompts: int = 8
    screen_keep: int = 12
    prescreen: str | None = None
    prescreen_keep: int = 12
    loss_data: tuple[str, ...] = ()
    loss_examples: int = 64
    decoder: str = DEFAULT_DECODER

    @property
    def needs_expected_tau(self) -> bool:
        """The criterion scores by expected acceptance length (prune.scoring.expected_tau_per_prompt)."""
        return CRITERIA[self.criterion].needs_expected_tau

    @property
    def needs_trajectories(self) -> bool:
        """Scoring reads the target's recorded trajectories: to replay them, for expected acceptance, or as the
        inputs of a ranking (its own or the pre-screen's; a ranking criterion's round replays nothing)."""
        if CRITERIA[self.criterion].ranks_round:
            return "trajectories" in self.reads
        return self.verify == "replay" or self.needs_expected_tau or "trajectories" in self.reads

    @property
    def reads(self) -> set:
        """What the round's rankings (the criterion's, the pre-screen's) run the drafter on (Ranking.reads)."""
        names = [self.criterion] + ([self.prescreen] if self.prescreen else [])
        return {CRITERIA[name].reads for name in names if name in CRITERIA and CRITERIA[name].reads}

    def key_record(self) -> dict:
        """The settings as a round's cache key holds them (prune.cache.score_key): those of the pre-screen and of
        the loss criterion only where the round reads them, the decoder only where it is not the default, so that
        rounds which do not read them keep the keys they had before these settings existed
        """
        unread = [] if self.prescreen else ["prescreen", "prescreen_keep"]
        unread += [] if "loss data" in self.reads else ["loss_data", "loss_examples"]
        unread += ["decoder"] if self.decoder == DEFAULT_DECODER else []
        return {k: v for k, v in settings_record(self).items() if k not in unread}

    def screen(self, prompts: int) -> int:
        """Prompts of the first pass for a round on `prompts` prompts (0: no screening)."""
        return self.screen_prompts if 0 < self.screen_prompts < prompts else 0

    def validate(self) -> None:
        if self.criterion not in CRITERIA:
            raise ConfigError(f"unknown criterion {self.criterion!r}; choose {one_of(CRITERIA)} (--criterion)")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"unknown verify mode {self.verify!r}; choose {one_of(VERIFY_MODES)} (--verify)")
        if self.decoder not in SCORING_DECODERS:
            raise ConfigError(f"scoring measures a speculative decoder, not {self.decoder!r}; choose "
                              f"{one_of(SCORING_DECODERS)} (--decoder)")
        if self.decode.temperature != 0:
            raise ConfigError("layer scoring is greedy; use temperature 0")
        if self.batch_size < 1 or self.bootstrap < 1 or not 0 < self.confidence < 1:
            raise ConfigError("batch_size and bootstrap must be >= 1 and confidence in (0, 1)")
        if self.screen_prompts < 0 or self.screen_keep < 1:
            raise ConfigError(f"--screen-prompts {self.screen_prompts} must be >= 0 and --screen-keep "
                              f"{self.screen_keep} >= 1")
        self._validate_rankings()

    def _validate_rankings(self) -> None:
        """The pre-screen and what the rankings read."""
        if self.prescreen is not None:
            if self.prescreen not in rankings():
                raise ConfigError(f"unknown pre-screen {self.prescreen!r}; choose {one_of(rankings())} (--prescreen)")
            if CRITERIA[self.criterion].ranks_round:
                measured = [name for name in CRITERIA if name not in rankings()]
                raise ConfigError(f"--criterion {self.criterion} ranks every layer without the decoder, so there is "
                                  f"nothing to pre-screen; drop --prescreen, or choose --criterion {one_of(measured)}")
        if self.prescreen_keep < 1 or self.loss_examples < 1:
            raise ConfigError(f"--prescreen-keep {self.prescreen_keep} and loss examples {self.loss_examples} must "
                              "be >= 1")
        if "loss data" in self.reads and not self.loss_data:
            raise ConfigError("the loss criterion needs held-in distillation data; pass --loss-data DIR (prune "
                              "distill output)")


@dataclass(frozen=True)
class HealWeights:
    """What a heal trains (HealConfig.train; prune.heal.TRAINERS builds each).

    Attributes:
        help: one line for --help.
        lr: its default peak learning rate.
    """

    help: str
    lr: float


# Adapters are the default (a few MB to checkpoint, merged after). A full fine-tune of the decoder layers kept
# lowering the loss over three times the updates where adapters had stopped, and held about 0.7 point more
# held-out tau on average (docs/design.md, Healing a finished drafter); its lr is lower since every weight moves.
DEFAULT_HEAL_WEIGHTS = "lora"
HEAL_WEIGHTS: dict[str, HealWeights] = {
    "lora": HealWeights("LoRA adapters on the attention and MLP projections (rank, alpha), merged into the "
                        "weights after", 5e-4),
    "full": HealWeights("every decoder layer's weights and the final norm (the embedding and the tied head stay "
                        "as they are)", 1e-4),
}


@dataclass
class HealConfig:
    """Healing settings (prune.heal).

    Attributes:
        steps: optimizer updates (0 disables healing).
        train: a name of HEAL_WEIGHTS: what the heal trains, LoRA adapters ("lora") or the decoder layers
            themselves ("full").
        rank, alpha, dropout: LoRA rank, scaling numerator (scale = alpha / rank) and dropout (train "lora").
        target_modules: module names that get adapters (train "lora").
        lr, batch_size, warmup_steps, blocks_per_sequence, max_length, gamma: as in
            `prune.training.config.TrainConfig`.
        distill_weight: share of the loss that matches the teacher passed to `prune.heal.heal` (a campaign
            passes the unpruned drafter) instead of the target's tokens (`TrainConfig.distill_weight`). 1: KL
            to the teacher only; cross entropy on the target's tokens left held-out tau flat on the demo pair,
            KL raised it (docs/design.md, Progressive pruning).
        min_drop: a campaign heals a step only when its drafter has lost at least this fraction of the
            unpruned drafter's tau on the prompts that judge steps (RunConfig.check_prompts; 0: every step). A
            drafter still at the unpruned tau has nothing to recover, and 16 prompts judge a heal against noise
            of about this size (docs/design.md, Progressive pruning).
        seed: seeds adapter initialisation, batch order and anchors.
    """

    steps: int = 40
    train: str = DEFAULT_HEAL_WEIGHTS
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    lr: float = HEAL_WEIGHTS[DEFAULT_HEAL_WEIGHTS].lr
    batch_size: int = 4
    warmup_steps: int = 5
    blocks_per_sequence: int = 16
    max_length: int = 320
    gamma: float = TrainConfig.gamma
    distill_weight: float = 1.0
    min_drop: float = 0.01
    seed: int = 0

    def validate(self) -> None:
        if self.train not in HEAL_WEIGHTS:
            raise ConfigError(f"unknown heal weights {self.train!r}; choose {one_of(HEAL_WEIGHTS)} (--train)")
        if not 0 <= self.min_drop <= 1:
            raise ConfigError(f"--heal-min-drop {self.min_drop} must be in [0, 1]")
        if self.steps < 0 or self.rank < 1 or self.alpha <= 0:
            raise ConfigError(
                f"heal steps {self.steps} must be >= 0, LoRA rank {self.rank} >= 1 and alpha {self.alpha} > 0 "
                "(--heal-steps, --heal-rank, --heal-alpha)"
            )


# `prune heal`: one longer heal of a finished drafter, distilled from the drafter it was pruned from. On the
# demo pair CE on the target's tokens left held-out tau where it was after 160 updates and KL to the unpruned
# drafter raised it; docs/design.md (Healing a finished drafter) says why, docs/results.md (Healing) measures it.
FINISHING_HEAL = HealConfig(steps=160, distill_weight=1.0, warmup_steps=10, min_drop=0.0)


@dataclass
class RunConfig:
    """Settings of a pruning campaign (prune.progressive).

    Attributes:
        layers_to_remove: stop after removing this many layers (None: only the other rules stop).
        min_retention: never take a step whose tau falls below this fraction of the unpruned tau (both on the
            prompts that judge steps, `check_prompts`).
        per_step: layers removed per step.
        stop_on_speedup: stop before a step whose predicted speedup falls `speedup_tolerance` or more below the
            best so far (the unpruned drafter's or a step's).
        speedup_tolerance: how far below the best predicted speedup a step may fall and still be taken, as a
            fraction (0, the default: every step must improve on the best). A layer buys about half a percent
            of predicted speedup on the demo pair while 16 calibration prompts measure tau within about 2 %, so
            a positive tolerance prunes deeper; but the layers that score lowest on the calibration prompts
            lose more on held-out prompts than on them, and the strict rule is what keeps held-out tau
            (docs/design.md, Progressive pruning; docs/results.md has both measured).
        check_prompts: prompts, disjoint from the calibration prompts, on which every step is judged: the unpruned
            drafter's tau, each step's tau before and after its heal, and so the retention floor, the heal rule and
            rollback and the speedup stop all read them. The calibration prompts chose the step's layers because
            their removal measured well there (the lowest of dozens of noisy scores is biased low), so a step's
            tau on them overstates what it keeps; on other prompts it does not (docs/design.md, Progressive
            pruning). 0: judge on the calibration prompts. A campaign (prune.progressive.Campaign) carries
            exactly this many.
        check_tokens: tokens each check prompt decodes (None: as many as the calibration prompts,
            `score.decode.max_new_tokens`, as runs saved before it). A step's retention read on 16 prompts x 64
            tokens of the demo pair has a standard error of about 1.5 % of tau, on 24 x 128 about 0.9 %, where a
            layer buys under 1 % of round time on a 2-core host (docs/design.md, Discounting later tries, and
            reading steps closer). It costs about three times the decoding per judged drafter (16 x 64 tokens
            took 8 s there) and nothing in the scoring rounds.
        check_candidates: with check prompts and one layer per step, the layers a step may try, lowest score
            first: it takes the first whose removal the stop rules accept and that lost less than
            `heal.min_drop` of the unpruned tau (healing on or off), and when none is, the one judged best,
            healed when it lost enough (prune.progressive._take_step). 1: the lowest only.
        check_try_discount: a step's i-th candidate is judged at its check tau lowered by this many times the
            optimism of the best of i noisy reads (prune.scoring.expected_best_of, in standard errors of its
            retention on the check prompts, prune.scoring.retention_error): taking the first of several tries
            that passes selects on the check prompts, and without the discount a run's check retention climbs
            above what held-out prompts measure (docs/design.md, Discounting later tries). 0: judge every
            try as it reads; the first try is never discounted.
        carry_screen: a screening round after the first step screens by the previous round's scores instead
            of a first pass over every layer (prune.scoring.score_layers, `carried`): it scores the previous
            round's `screen_keep` lowest layers on every prompt, and the others only when those no longer
            score below them. False: every round screens every layer afresh.
        vocab_sizes: the draft vocabulary sizes a head step may cut the drafter's head to (models/draft_vocab.py),
            tried from the largest below the head's rows now: before each layer step the run tries cutting the
            head to the next of them, judged as a layer step is (on the check prompts, by the retention floor
            and the speedup stop; never healed: no weight changes), and takes it when the rules accept it.
            The ids are the best-ranked of the target's answers to training prompts (prune.vocab). On a small
            drafter the head is a large share of each pass (the demo drafter's 49216 x 192 head, 38 % of its
            multiply-adds), and the 8192 ids its target says most hold 99.6 % of what it says. Empty: no
            head steps.
        score: scoring settings (criterion, verify mode, decoding).
        heal: LoRA healing settings (steps = 0 disables healing).
    """

    layers_to_remove: int | None = None
    min_retention: float = 0.99
    per_step: int = 1
    stop_on_speedup: bool = True
    speedup_tolerance: float = 0.0
    check_prompts: int = 24
    check_tokens: int | None = 128
    check_candidates: int = 3
    check_try_discount: float = 1.0
    carry_screen: bool = True
    vocab_sizes: tuple[int, ...] = DEFAULT_VOCAB_SIZES
    score: ScoreConfig = field(default_factory=ScoreConfig)
    heal: HealConfig = field(default_factory=HealConfig)

    @property
    def check_score(self) -> ScoreConfig:
        """The settings the check prompts are decoded with: `score`, `check_tokens` tokens per prompt."""
        if self.check_tokens is None:
            return self.score
        return replace(self.score, decode=replace(self.score.decode, max_new_tokens=self.check_tokens))

    def validate(self, num_layers: int) -> None:
        if not 0 < self.min_retention <= 1:
            raise ConfigError(f"--min-retention {self.min_retention} must be in (0, 1]")
        if not 0 <= self.speedup_tolerance < 1:
            raise ConfigError(f"--speedup-tolerance {self.speedup_tolerance} must be in [0, 1)")
        if self.per_step < 1:
            raise ConfigError(f"--per-step {self.per_step} must be at least 1")
        if self.check_tokens is not None and self.check_tokens < 1:
            raise ConfigError(f"--check-tokens {self.check_tokens} must be >= 1")
        if self.check_try_discount < 0:
            raise ConfigError(f"--check-try-discount {self.check_try_discount} must be >= 0")
        if any(size < 1 for size in self.vocab_sizes):
            raise ConfigError(f"--vocab-sizes {','.join(map(str, self.vocab_sizes))} must all be >= 1")
        if self.check_prompts < 0 or self.check_candidates < 1:
            raise ConfigError(f"--check-prompts {self.check_prompts} must be >= 0 and --check-candidates "
                              f"{self.check_candidates} >= 1")
        if self.score.prescreen and self.per_step > self.score.prescreen_keep:
            raise ConfigError(f"--per-step {self.per_step} removes more layers than the {self.score.prescreen_keep} "
                              "that the pre-screen leaves; raise --prescreen-keep")
        if self.score.screen_prompts and self.per_step > self.score.screen_keep:
            raise ConfigError(f"--per-step {self.per_step} removes more layers than the {self.score.screen_keep} "
                              "that screening scores on every prompt; raise --screen-keep or pass "
                              "--screen-prompts 0")
        if self.layers_to_remove is not None and not 0 < self.layers_to_remove < num_layers:
            raise ConfigError(
                f"--layers-to-remove {self.layers_to_remove} must be in 1..{num_layers - 1}: the drafter has "
                f"{num_layers} layers and at least one must remain"
            )
        self.score.validate()
        self.heal.validate()


def settings_record(settings) -> dict:
    """A settings dataclass (or a dict holding some) as plain JSON values, the form state.json and a heal's
    checkpoint marker store and compare."""
    return json.loads(json.dumps(asdict(settings) if is_dataclass(settings) else settings, default=str))


def complete_settings(stored: dict, defaults: dict, before: dict | None = None) -> dict:
    """`stored` settings (a settings_record an older version wrote) with the settings added since at their
    `defaults` (nested records merged alike), or, for a name in `before`, at the value that reproduces what
    that version did: what it saved continues under the same flags."""
    before = before or {}
    merged = dict(stored)
    for key, value in defaults.items():
        if key not in merged:
            merged[key] = before.get(key, value)
        elif isinstance(value, dict) and isinstance(merged[key], dict):
            merged[key] = complete_settings(merged[key], value, before)
    return merged
