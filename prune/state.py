"""The state of a pruning run, OUT/state.json: its schema, reading (older files included) and writing.

`prune.progressive` builds and updates a `RunState`; `prune.report`, `prune.tracking`, `prune.speed`, the
`prune run` command and sweep trials read it. It is saved as JSON (`indent=2, sort_keys=True`) after every
step, in this form (times in ms, tau in committed tokens per target pass, layer indices 0-based):

    {"config":  RunConfig as JSON (prune.config; what a --resume must match),
     "source":  the unpruned drafter's folder,
     "timing":  Timing: the pass times every predicted speedup of the run uses,
     "base":    BaseRecord: the unpruned drafter on the prompts that judge steps,
     "history": [StepRecord, ...]: the steps taken, in order,
     "stopped_by": the rule that ended the run (None while it runs),
     "speed":   SpeedCheck: the measured check at the end (absent until it ran),
     "heal_data": the healing data, "folder xW" per folder (absent when the run does not heal),
     "host":    Host: the machine and arithmetic the run measured with (absent in runs that predate it),
     "vocab":   the token ranking head steps cut by (prune.vocab.TokenRanking.record; absent without one)}

`RunState.from_dict` reads every form this tool has written: timing from before the cost model
(`{"layers", "draft_ms", "packed_ms", "verify_ms", "ar_ms"}`, written back as it was read) and layer
scores without the fields added later (read as None; `prompts`, added with screening, `age`, added
with carried screening, `expected_tau_without`, added with the expected-tau criterion, and `skipped`, added
with the pre-screen, are written back absent). A ranking criterion's scores (prune.ranking) hold None where
the decoder measured nothing (tau_without, delta_tau, the interval, predicted_speedup). A head step
(prune.vocab) is a StepRecord with `head_rows`, no removed layers and no scores; layer steps and records from
before head steps carry no `head_rows`.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from decode import cost
from decode.cost import LayerCost, PassTimes
from decode.timing import drafter_layer_costs, measure_pass_times
from models.checkpoint import atomic_write_text
from models.precision import cpu_name, dtype_name

from .cache import cached_json, loaded_target, timing_key
from .config import DEFAULT_DECODER, ScoreConfig
from .scoring import LayerScore

STATE_NAME = "state.json"


@dataclass
class Timing:
    """Pass times measured once per campaign, the basis of every predicted speedup (decode.cost).

    Attributes:
        layers: layer count of the drafter they were measured on (the unpruned one).
        draft, packed: the sync draft pass and the full-budget packed pass as affine functions of the drafter's
            depth and head rows (decode.cost.LayerCost: fixed_ms + per_layer_ms x layers + per_row_ms x (rows -
            the measured drafter's)), fitted on the drafter, a half-depth copy and a copy with a cut head; JSON:
            [fixed_ms, per_layer_ms, per_row_ms, rows] ([fixed_ms, per_layer_ms] in runs saved before the head
            term, which then predicts every head at the measured one's time).
        target: the pair's pass times (decode.cost.PassTimes: the target's ar step, verify slope, contention;
            JSON: its fields), or None when no target was timed.
        legacy: the timing as a state written before the cost model holds it (`layers`, `draft_ms`,
            `packed_ms`, `verify_ms`, `ar_ms`: whole passes, verify of the drafter's block of 16), else None;
            the other fields are then derived from it (drafter times proportional to depth, no contention).
    """

    layers: int
    draft: LayerCost
    packed: LayerCost
    target: PassTimes | None
    legacy: dict | None = None

    def pass_times(self, layers: int, head_rows: int | None = None) -> PassTimes | None:
        """The pair's pass times with a `layers`-layer drafter of this campaign whose head computes `head_rows`
        rows (None: the measured drafter's; models.draft_vocab.head_rows), None without target times."""
        if self.target is None:
            return None
        return self.target.with_drafter(self.draft.at(layers, head_rows), self.packed.at(layers, head_rows))

    def layer_costs(self) -> tuple[LayerCost, LayerCost]:
        """(sync draft, packed) pass time as functions of depth and head rows."""
        return self.draft, self.packed

    def packed_ms(self, layers: int, head_rows: int | None = None) -> float:
        """Modelled packed-pass time (ms) of a `layers`-layer drafter of this campaign with `head_rows` head rows."""
        return self.packed.at(layers, head_rows)

    def depth_text(self) -> str:
        """What a layer (and the head) costs on the measuring machine, in words (for the run's log and report)."""
        target = f", a {self.target.ar_ms:.1f} ms target step" if self.target is not None else ""
        head = (f" + {1000 * self.draft.per_row_ms:.2f} ms per 1000 head rows (of {self.draft.rows})"
                if self.draft.rows else "")
        return (f"a draft pass of {self.draft.fixed_ms:.1f} ms + {self.draft.per_layer_ms:.2f} ms per layer"
                f"{head}{target}")

    def to_dict(self) -> dict:
        if self.legacy is not None:
            return dict(self.legacy)
        return {"layers": self.layers, "draft": self.draft.to_list(), "packed": self.packed.to_list(),
                "target": self.target.to_dict() if self.target is not None else None}

    @classmethod
    def from_dict(cls, record: dict) -> "Timing":
        if "packed" in record:
            target = PassTimes(**record["target"]) if record.get("target") is not None else None
            return cls(record["layers"], LayerCost(*record["draft"]), LayerCost(*record["packed"]), target)
        layers = record["layers"]  # a state written before the cost model
        target = None
        if record.get("verify_ms") is not None:
            target = PassTimes(record["ar_ms"], (record["verify_ms"] - record["ar_ms"]) / 15, 0.0, 0.0, contention=0.0)
        return cls(layers, LayerCost(0.0, record["draft_ms"] / layers), LayerCost(0.0, record["packed_ms"] / layers),
                   target, legacy=dict(record))


def measure_timing(drafter, score: ScoreConfig, target=None, times: PassTimes | None = None) -> Timing:
    """The Timing of the unpruned `drafter` with the loaded `target` (decode.timing; a few seconds).

    `times`: the pair's decode.cost.PassTimes when already measured (the adaptive width's) or given (a recorded
    target's, --pass-times); else measured with `target`. Without a target the drafter's depths are timed
    alone, and without times too the Timing has no target times (no predicted speedups).
    """
    if times is None and target is not None:
        times = measure_pass_times(target, drafter, score.decode, score.timing_repeats)
    full = (times.draft_ms, times.packed_ms) if times is not None else None
    draft, packed = drafter_layer_costs(drafter, score.decode.packed_budget, score.timing_repeats, full, target)
    return Timing(drafter.config.num_hidden_layers, draft, packed, times)


def campaign_timing(drafter, score: ScoreConfig, source=None, times: PassTimes | None = None,
                    cache: Path | None = None) -> Timing:
    """`measure_timing`, kept in the cache folder under prune.cache.timing_key (measured once per drafter,
    target side, device, dtype, threads, decoder settings and pair's pass times) when `cache` and `source` are
    given: `prune score`, `prune run` and sweeps then time a pair alike, and share their score cache.
    `source`: where the target's trajectories come from (prune.trajectories.TrajectorySource; a loaded target
    is its live source); its loaded target, if any, is timed."""
    from .trajectories import as_source

    source = as_source(source)
    target = loaded_target(source) if source is not None else None
    if cache is None or source is None:
        return measure_timing(drafter, score, target, times)
    key = timing_key(drafter, source, score.decode, score.timing_repeats, times.to_dict() if times else None)
    return Timing.from_dict(cached_json(Path(cache) / "timing", key,
                                        lambda: measure_timing(drafter, score, target, times).to_dict()))


@dataclass
class BaseRecord:
    """The unpruned drafter on the prompts that judge steps: the check prompts (RunConfig.check_prompts), or the
    calibration prompts in a run without them (`RunState.judged_on`).

    Attributes:
        tau: its tau there (async decoder, the macro mean over prompts).
        fallback_rate: share of async rounds that needed a fallback draft.
        predicted_speedup: predicted async speedup over the target alone (None without target times).
        width, packed_share, packed_tokens: its async rounds' mean verify width, share of rounds with a packed
            pass and mean query tokens of those passes (decode.cost.RoundShape; None in runs saved before they
            were recorded).
    """

    tau: float
    fallback_rate: float | None
    predicted_speedup: float | None
    width: float | None = None
    packed_share: float | None = None
    packed_tokens: float | None = None

    def to_dict(self) -> dict:
        """Its JSON; the round-shape fields only where recorded, so a state saved before them writes back
        unchanged."""
        shape = ("width", "packed_share", "packed_tokens")
        return {k: v for k, v in asdict(self).items() if k not in shape or v is not None}


@dataclass
class StepRecord:
    """One step taken: layers removed, then healed, measured and exported to OUT/`folder`; or, a head step, the
    drafter's head cut to a draft vocabulary of `head_rows` ids (nothing removed, nothing scored or healed).

    Attributes:
        step: 1, 2, ...; folder: its export, "step-XX" (relative to OUT).
        removed: the removed layers' indices in the drafter the step started from.
        removed_original: the same layers' indices in the unpruned drafter.
        layers: layers left after the step.
        tau_before_heal: tau right after the removal; tau: after the heal (or without it, when the heal was
            rolled back or off); both on the prompts that judge steps (`RunState.judged_on`).
        retention: tau / the unpruned drafter's tau there (BaseRecord.tau).
        heal_rolled_back: the heal lowered tau, so the pre-heal weights were kept.
        predicted_speedup: the step's predicted async speedup (None without target times).
        heal_loss: the drafter loss of each LoRA update of the heal ([] without healing).
        scores: the scoring round that chose the step: every layer of the drafter the step started from
            (prune.scoring.LayerScore); [] for a head step.
        head_rows: a head step's draft vocabulary size (the head's rows after it); None for a layer step.
    """

    step: int
    folder: str
    removed: list[int]
    removed_original: list[int]
    layers: int
    tau_before_heal: float
    tau: float
    retention: float
    heal_rolled_back: bool
    predicted_speedup: float | None
    heal_loss: list[float]
    scores: list[LayerScore]
    head_rows: int | None = None

    @property
    def is_head_step(self) -> bool:
        return self.head_rows is not None

    def to_dict(self, scores: bool = True) -> dict:
        """As JSON; without `scores` it is the history entry of an export's report and model card. A layer step
        writes no `head_rows` (as records from before head steps)."""
        record = asdict(self)
        if record["head_rows"] is None:
            del record["head_rows"]
        if not scores:
            del record["scores"]
        for score in record.get("scores", []):
            for added in ("prompts", "age", "expected_tau_without", "skipped"):  # absent from older scores: as read
                if score[added] is None:
                    del score[added]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "StepRecord":
        return cls(**{**record, "scores": [LayerScore(**s) for s in record["scores"]]})


@dataclass
class SpeedRow:
    """One drafter in the measured speed check (async decoder, live target, held-out prompts).

    Attributes:
        tau: held-out tau (macro mean); measured_speedup: time per token of ar / of async, interleaved;
        predicted_speedup: the cost model at this check's tau, verify width and fallback rate;
        speedup_limit: tau x T_ar / T_verify; exact: every async output equals ar's.
        measured_speedup_error: the standard error of measured_speedup over the check's prompts (per-prompt
            decode times paired with ar's, decode.metrics.paired_ratio_error; None in checks saved before it).
    """

    tau: float | None
    measured_speedup: float | None
    predicted_speedup: float | None
    speedup_limit: float | None
    exact: bool | None
    measured_speedup_error: float | None = None


@dataclass
class SpeedCheck:
    """The measured end of a run (prune.speed): the unpruned (`base`) and final drafters against the target.

    Attributes:
        prompts: held-out prompts decoded; source: where they came from (a suite part or a file);
        max_new_tokens: tokens generated per prompt at most.
        base, final: each drafter's SpeedRow (`final` None when no step was taken).
        retention_error: standard error of the held-out retention final.tau / base.tau over these prompts
            (prune.scoring.retention_error; None without a final drafter, and in checks saved before it): a
            few prompts measure speed well and retention roughly.
    """

    prompts: int
    source: str
    max_new_tokens: int
    base: SpeedRow | None = None
    final: SpeedRow | None = None
    retention_error: float | None = None

    def to_dict(self) -> dict:
        record = {"prompts": self.prompts, "source": self.source, "max_new_tokens": self.max_new_tokens}
        for name, row in (("base", self.base), ("final", self.final)):
            if row:  # a check saved before the speedup's error writes back without it
                record[name] = {key: value for key, value in asdict(row).items()
                                if value is not None or key != "measured_speedup_error"}
        if self.retention_error is not None:
            record["retention_error"] = self.retention_error
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "SpeedCheck":
        rows = {name: SpeedRow(**record[name]) for name in ("base", "final") if record.get(name)}
        return cls(record["prompts"], record["source"], record["max_new_tokens"], **rows,
                   retention_error=record.get("retention_error"))


def judged_on(check_prompts: int | None) -> str:
    """The prompts the steps of a run with `check_prompts` (RunConfig.check_prompts; None in runs saved before
    they existed) are judged on: "check" prompts, or "calibration" prompts."""
    return "check" if check_prompts else "calibration"


@dataclass
class Host:
    """The machine and arithmetic a run measured with. Which layers a run removes can depend on them: a
    bfloat16 target's greedy tokens differ between CPUs after a near-tie (AMX and AVX512-BF16 kernels round
    differently), and the adaptive verify width follows the measured pass times (docs/design.md, "Runs on
    other machines").

    Attributes:
        cpu: the CPU's model name (models.precision.cpu_name).
        device: the torch device the models ran on ("cpu", "cuda:0", ...).
        threads: torch's CPU threads.
        torch: torch's version.
        target_dtype, drafter_dtype: the two models' compute dtypes ("bfloat16", "float32", ...).
    """

    cpu: str
    device: str
    threads: int
    torch: str
    target_dtype: str
    drafter_dtype: str

    @classmethod
    def of(cls, drafter, target) -> "Host":
        """The host of a campaign that runs `drafter` and `target` (None: no target, its dtype "-")."""
        weights = next(drafter.parameters())
        target_dtype = dtype_name(next(target.parameters()).dtype) if target is not None else "-"
        return cls(cpu_name(), str(weights.device), torch.get_num_threads(), torch.__version__, target_dtype,
                   dtype_name(weights.dtype))

    def text(self) -> str:
        """One line for reports and logs."""
        return (f"{self.cpu}, {self.device}, {self.threads} torch threads, torch {self.torch}, target "
                f"{self.target_dtype}, drafter {self.drafter_dtype}")


@dataclass
class RunState:
    """A pruning run (see the module docstring).

    Attributes:
        config: the run's settings as JSON (prune.progressive.config_record); a resume must match them.
        source: the unpruned drafter's folder.
        timing: the campaign's pass times (Timing).
        base: the unpruned drafter (BaseRecord).
        history: the steps taken (StepRecord), in order.
        stopped_by: the stop rule that ended the run ("layer budget", "retention floor: ...", "one layer left",
            "predicted speedup ... below the best (...)", or a caller's reason), None while it runs.
        speed: the measured speed check (SpeedCheck), None until it ran.
        heal_data: the folders the run heals on ("folder xW" each; Campaign.heal_data), None when it does not
            heal or its record predates this field.
        host: the machine it started on (Host), None in records that predate this field.
        vocab: the token ranking its head steps cut by (prune.vocab.TokenRanking.record: source, tokens,
            distinct, sha256), None without head steps; a resume must rank alike.
    """

    config: dict
    source: str
    timing: Timing
    base: BaseRecord
    history: list[StepRecord] = field(default_factory=list)
    stopped_by: str | None = None
    speed: SpeedCheck | None = None
    heal_data: list[str] | None = None
    host: Host | None = None
    vocab: dict | None = None

    @property
    def last(self) -> StepRecord | None:
        """The last step taken (None before the first)."""
        return self.history[-1] if self.history else None

    @property
    def layers(self) -> int:
        """Layers of the drafter the run has reached (the unpruned count before any step)."""
        return self.history[-1].layers if self.history else self.timing.layers

    @property
    def head_rows(self) -> int | None:
        """Rows of the head of the drafter the run has reached: the last head step's draft vocabulary, or None
        before any (the unpruned drafter's, as its timing measured it)."""
        return next((step.head_rows for step in reversed(self.history) if step.is_head_step), None)

    @property
    def judged_on(self) -> str:
        """The prompts its steps were judged on (`judged_on`)."""
        return judged_on(self.config.get("check_prompts"))

    def equal_tau_speedup(self, layers: int, head_rows: int | None = None) -> float | None:
        """Predicted: how much faster per token a `layers`-layer drafter of this campaign whose head computes
        `head_rows` rows (None: the unpruned drafter's) runs than the unpruned one at the unpruned drafter's tau
        and round shape (decode.cost.equal_tau_speedup): what removing layers and head rows buys on this machine
        before any tau it costs. None without target times or a recorded verify width."""
        base = self.base
        if self.timing is None or base.width is None or self.timing.target is None:
            return None
        before, after = self.timing.pass_times(self.timing.layers), self.timing.pass_times(layers, head_rows)
        decoder = self.config.get("score", {}).get("decoder", DEFAULT_DECODER)
        return cost.equal_tau_speedup(decoder, before, after, base.width, base.fallback_rate or 0.0,
                                      **cost.packed_shape(base.packed_share, base.packed_tokens))

    def removed_original(self) -> list[int]:
        """Every removed layer, by its index in the unpruned drafter, in the order removed."""
        return [i for step in self.history for i in step.removed_original]

    def to_dict(self) -> dict:
        record = {"config": self.config, "source": self.source, "timing": self.timing.to_dict(),
                  "base": self.base.to_dict(), "history": [step.to_dict() for step in self.history],
                  "stopped_by": self.stopped_by}
        if self.speed is not None:
            record["speed"] = self.speed.to_dict()
        if self.heal_data is not None:
            record["heal_data"] = self.heal_data
        if self.host is not None:
            record["host"] = asdict(self.host)
        if self.vocab is not None:
            record["vocab"] = self.vocab
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "RunState":
        return cls(record["config"], record["source"], Timing.from_dict(record["timing"]), BaseRecord(**record["base"]),
                   [StepRecord.from_dict(step) for step in record["history"]], record["stopped_by"],
                   SpeedCheck.from_dict(record["speed"]) if record.get("speed") else None, record.get("heal_data"),
                   Host(**record["host"]) if record.get("host") else None, record.get("vocab"))


def state_text(state: RunState) -> str:
    """The text of OUT/state.json (also what `prune run --json` prints)."""
    return json.dumps(state.to_dict(), indent=2, sort_keys=True, default=str) + "\n"


def save_state(out, state: RunState) -> None:
    """Write OUT/state.json atomically."""
    atomic_write_text(Path(out) / STATE_NAME, state_text(state))


def load_state(out) -> RunState:
    """The run saved in OUT/state.json."""
    return RunState.from_dict(json.loads((Path(out) / STATE_NAME).read_text()))


def has_run(out) -> bool:
    """Whether folder `out` holds a pruning run (its state.json) that --resume continues."""
    return (Path(out) / STATE_NAME).is_file()
