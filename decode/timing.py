"""Pass times measured on the decoding device: the inputs of the cost model (decode/cost.py).

Every time is the median time (ms) of `repeats` passes after one untimed warm-up, over a context of
`context` cached tokens, through the same runners, caches and worker thread as the decoders; the kinds of
pass measured together are sampled in turn, so load on a shared machine skews them alike. The
concurrent measurement runs a verify pass and a packed pass at once, split over the cores as the async
decoder splits them, so the cost model's contention is that of the real round rather than an ideal.

On the CPU a time is wall time. On CUDA it is device time between two CUDA events on the caller's
stream: one recorded before the pass is queued, one after it ends, recorded once that stream has waited
for the drafter's stream (decode.worker.draft_stream), so a pass on either stream, or both at once, is
timed from the moment the device could start it to the moment its last kernel finished.

Pinned pass times replace the stopwatch: with `$D3D_PRUNE_PASS_TIMES` naming a JSON file (`PinnedTimes`),
every measurement here returns times computed from that file instead of timing passes. Every decision that
reads pass times (verify width, candidate count, gate, predicted speedups, stop rules) then comes out the
same on any machine under any load; the test suite runs on pinned times, and a user can pin a record to
reproduce a run's decisions elsewhere. Cache keys hold the pinned record (prune.cache.pass_times_key).
"""

import contextlib
import functools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .cost import LayerCost, PassTimes
from .config import DecodeConfig
from .engine import DraftEngine, DraftRequest
from .verifiers import LiveVerifier
from .worker import draft_stream, draft_worker, thread_split
from models.masks import BlockSpec
from models.surgery import without_layers


PINNED_TIMES_ENV = "D3D_PRUNE_PASS_TIMES"


@dataclass(frozen=True)
class PinnedTimes:
    """Pass times given instead of measured (see the module docstring), in ms.

    The target's passes are PassTimes' (ar_ms, per_token_ms, step_ms, contention); a drafter's sync draft
    and full-budget packed pass are affine in its depth (`draft`, `packed`: decode.cost.LayerCost), so
    pruned drafters read cheaper as measured ones do, and in its head's rows where `per_row_ms` is given
    (a draft vocabulary, models/draft_vocab.py). The JSON file holds these fields, the two layer costs as
    {"fixed_ms": F, "per_layer_ms": L, "per_row_ms": R (optional)}.
    """

    ar_ms: float
    per_token_ms: float
    draft: LayerCost
    packed: LayerCost
    contention: float = 0.0
    step_ms: float = 0.0

    def layer_costs(self, rows: int) -> tuple[LayerCost, LayerCost]:
        """(sync draft, packed) LayerCost of a drafter whose head computes `rows` rows: the pinned record's
        `per_row_ms` counts every row (a record without it has no head term)."""
        def at_rows(cost: LayerCost) -> LayerCost:
            return LayerCost(cost.fixed_ms + cost.per_row_ms * rows, cost.per_layer_ms, cost.per_row_ms, rows)

        return at_rows(self.draft), at_rows(self.packed)

    def for_drafter(self, drafter, packed_budget: int) -> PassTimes:
        """The PassTimes `measure_pass_times` would return for `drafter` at `packed_budget`."""
        from models.draft_vocab import head_rows

        layers = drafter.config.num_hidden_layers
        draft, packed = self.layer_costs(head_rows(drafter))
        draft_tokens, packed_tokens = pass_tokens(drafter.config.block_size, packed_budget)
        return PassTimes(self.ar_ms, self.per_token_ms, draft.at(layers), packed.at(layers),
                         self.contention, draft_tokens, packed_tokens, self.step_ms)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict, where: str = "pinned pass times") -> "PinnedTimes":
        from models.errors import ConfigError

        try:
            fields = {**record, "draft": LayerCost(**record["draft"]), "packed": LayerCost(**record["packed"])}
            times = cls(**fields)
        except (KeyError, TypeError) as error:
            raise ConfigError(f"{where} is not a pinned pass-times record ({error}); it needs ar_ms, per_token_ms, "
                              "draft and packed ({\"fixed_ms\": F, \"per_layer_ms\": L}), optionally contention "
                              "and step_ms") from None
        if min(times.ar_ms, times.per_token_ms, times.step_ms, *asdict(times.draft).values(),
               *asdict(times.packed).values()) < 0 or times.ar_ms <= 0 or not 0 <= times.contention <= 1:
            raise ConfigError(f"{where} holds a negative time, a zero ar_ms or a contention outside [0, 1]; fix the file")
        return times


def pinned_times() -> PinnedTimes | None:
    """The pass times pinned by `$D3D_PRUNE_PASS_TIMES` (a JSON file), or None when it is unset or empty."""
    from models.errors import ConfigError

    path = os.environ.get(PINNED_TIMES_ENV)
    if not path:
        return None
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"${PINNED_TIMES_ENV} names {path}, which is not a readable JSON file ({error}); "
                          f"fix it or unset {PINNED_TIMES_ENV} to measure pass times") from None
    return PinnedTimes.from_dict(record, where=f"${PINNED_TIMES_ENV} file {path}")


def pass_tokens(block_size: int, packed_budget: int) -> tuple[int, int]:
    """(query tokens of a sync draft pass, of a full-budget packed pass): the chain's block and the most
    candidate blocks of block_size + 1 tokens that `packed_budget` holds (at least one)."""
    candidates = max(1, min(block_size - 1, packed_budget // (block_size + 1)))
    return 1 + block_size, block_size + candidates * (block_size + 1)


def elapsed_ms(run, device: torch.device) -> float:
    """Time (ms) of `run()` on `device`: wall time on the CPU, CUDA events on CUDA (see the module docstring)."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return 1000 * (time.perf_counter() - start)
    stream, drafter = torch.cuda.current_stream(device), draft_stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    run()
    if drafter is not None:
        stream.wait_stream(drafter)  # a drafter pass ends the interval too
    end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end)


def _interleaved_ms(runs: dict, repeats: int, device: torch.device = torch.device("cpu"),
                    before: dict | None = None) -> dict:
    """Median time (ms, `elapsed_ms` on `device`) of each of `runs` (name -> callable), sampled in turn,
    `repeats` rounds after one untimed warm-up round. A moment of load on a shared machine then slows every
    measurement alike, so the ratios the cost model lives on survive it (measured one after another, a
    noisy moment inflated one pass time by 20 % and moved the predicted speedup as much). `before`: name ->
    an untimed callable run right before that run's every sample."""
    samples: dict = {name: [] for name in runs}
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            if before and name in before:
                before[name]()
            ms = elapsed_ms(run, device)
            if round_index:
                samples[name].append(ms)
    return {name: statistics.median(values) for name, values in samples.items()}


def _context_ids(count: int, vocab: int) -> list[int]:
    return (torch.arange(count) % max(2, vocab)).tolist()  # the tokens' values do not change the cost


class _DrafterProbe:
    """A drafter engine holding `context` cached tokens, with a sync-draft and a full packed request."""

    def __init__(self, drafter, packed_budget: int, context: int):
        block = drafter.config.block_size
        ids = _context_ids(context, drafter.config.mask_token_id)
        self.draft_tokens, self.packed_tokens = pass_tokens(block, packed_budget)  # query tokens of each pass
        candidates = (self.packed_tokens - block) // (block + 1)
        self.draft = DraftRequest(ids[:1], [BlockSpec(context)])
        self.packed = DraftRequest(ids[:block], [BlockSpec(context + a, guess=ids[a]) for a in range(candidates)])
        self.engine = DraftEngine(drafter, rows=1)
        self.engine.forward([DraftRequest(ids, [])])
        self.engine.keep([context])

    def run(self, request: DraftRequest) -> None:
        self.engine.forward([request])
        self.engine.keep([0])  # back to the same cached context for the next sample


class _TargetProbe:
    """A live verifier holding `context` cached tokens; `run(width)` verifies `width` tokens and rolls back."""

    def __init__(self, target, context: int):
        self.context = context
        self.ids = _context_ids(context, 100)
        self.verifier = LiveVerifier(target)
        self.verifier.prefill(self.ids)

    def run(self, width: int) -> None:
        self.verifier.verify(self.ids[:width])
        self.verifier.commit(self.context)


def drafter_pass_ms(drafter, packed_budget: int, repeats: int = 7, context: int = 64) -> tuple[float, float]:
    """(sync draft pass, full-budget packed pass) of `drafter`, ms."""
    pinned = pinned_times()
    if pinned is not None:
        times = pinned.for_drafter(drafter, packed_budget)
        return times.draft_ms, times.packed_ms
    probe = _DrafterProbe(drafter, packed_budget, context)
    times = _interleaved_ms({"draft": lambda: probe.run(probe.draft), "packed": lambda: probe.run(probe.packed)},
                            repeats, probe.engine.device)
    return times["draft"], times["packed"]


def measure_pass_times(target, drafter, config: DecodeConfig, repeats: int = 7, context: int = 64) -> PassTimes:
    """Everything the cost model needs for this pair on this device (`measure_drafters` with one drafter)."""
    return measure_drafters(target, [drafter], config, repeats, context)[0]


def measure_drafters(target, drafters, config: DecodeConfig, repeats: int = 7, context: int = 64) -> list[PassTimes]:
    """The pass times of `target` with each of `drafters` (same block size), all measured in one
    interleaved measurement (`repeats` + 1 passes of each kind): the target's passes once, shared by every
    drafter, and each drafter's draft, packed and concurrent passes in turn with the others'. Drafters
    compared in one benchmark are then measured under the same load: measured one after the other, two
    measurements of the same drafter on this 2-core machine read 46 and 55 ms for the same step (21
    repeats each), more than the gap between drafters a few layers apart.

    The target's ar step, the step up to wider passes and their slope come from passes of widths 1, 2,
    B/4, B/2 and B (B the block size; `verify_line`); contention comes from a verify pass of width B/2 and the packed
    pass run concurrently, as the async decoder runs them (packed pass on the worker thread, cores split
    by `config.draft_threads`). Pinned times (`pinned_times`) are returned without timing anything.
    """
    pinned = pinned_times()
    if pinned is not None:
        return [pinned.for_drafter(drafter, config.packed_budget) for drafter in drafters]
    block = config.verify_block(drafters[0].config.block_size)
    widths = sorted({1, 2, max(2, block // 4), max(2, block // 2), block})
    width = max(2, block // 2)
    target_probe = _TargetProbe(target, context)
    probes = [_DrafterProbe(drafter, config.packed_budget, context) for drafter in drafters]
    device = next(drafters[0].parameters()).device

    def together(probe):
        with thread_split(device, config.draft_threads):
            probe.engine.mark_ready()
            future = draft_worker().submit(probe.run, probe.packed)
            target_probe.run(width)
            future.result()

    runs = {w: (lambda w=w: target_probe.run(w)) for w in widths}
    for index, probe in enumerate(probes):
        runs.update({(index, "draft"): functools.partial(probe.run, probe.draft),
                     (index, "packed"): functools.partial(probe.run, probe.packed),
                     (index, "together"): functools.partial(together, probe)})
    # A drafter pass in decoding follows a verify pass, which has pushed the drafter out of the caches.
    verify = functools.partial(target_probe.run, width)
    before = {(index, kind): verify for index in range(len(probes)) for kind in ("draft", "packed")}
    ms = _interleaved_ms(runs, repeats, device, before=before)
    ar_ms, step, slope = verify_line({w: ms[w] for w in widths})
    times = []
    for index, probe in enumerate(probes):
        alone = (ms[width], ms[(index, "packed")])
        contention = (ms[(index, "together")] - max(alone)) / min(alone) if min(alone) > 0 else 0.0
        times.append(PassTimes(ar_ms, slope, ms[(index, "draft")], ms[(index, "packed")],
                               min(1.0, max(0.0, contention)), probe.draft_tokens, probe.packed_tokens, step))
    return times


def verify_line(ms_by_width: dict[int, float]) -> tuple[float, float, float]:
    """(ar_ms, step_ms, per_token_ms) of the target's pass from the median times of verify passes of
    several widths: ms = ar_ms at width 1 and ar_ms + step_ms + per_token_ms x (width - 1) from width 2 on
    (decode.cost.PassTimes; step_ms and per_token_ms >= 0).

    The wider passes give a least-squares line. On a CPU it lies well above the one-token step, which runs
    on the matrix-vector path (2 AVX-512 cores, demo target: 43 ms at one token, a line of 56 + 2.3 ms per
    token from two on): the step is that gap, and a single line through every width, as this was fitted
    before, read the ar step 20 % high and every predicted speedup with it. Where the one-token step does
    not lie below the line (a GPU, whose pass is flat in width, or a slow width-1 sample), there is no step
    and the ar step is read off one line through every width, which averages a single noisy median away:
    on this project's 2-core machine one median of 7 width-1 passes read 72.8 ms where the same
    benchmark's ar decoding ran at 59.1 ms per step.
    """
    widths = sorted(ms_by_width)
    wide = {w: ms for w, ms in ms_by_width.items() if w > 1}
    if 1 in ms_by_width and len(wide) >= 2:
        level, slope = _line(wide)
        if level > ms_by_width[1]:
            return ms_by_width[1], level - ms_by_width[1], slope
    if len(widths) == 1:
        return ms_by_width[widths[0]], 0.0, 0.0
    level, slope = _line(ms_by_width)
    return level, 0.0, slope


def _line(ms_by_width: dict[int, float]) -> tuple[float, float]:
    """(value at width 1, slope >= 0) of the least-squares line through `ms_by_width`, kept physical: where
    noise tilts the line so steeply that it reads zero or less at width 1 (seen on a 2-core machine kept busy
    by other work: -0.9 ms), the least-squares line through the narrowest pass's median instead."""
    widths = sorted(ms_by_width)
    mean_w = sum(widths) / len(widths)
    mean_ms = sum(ms_by_width.values()) / len(widths)
    spread = sum((w - mean_w) ** 2 for w in widths)
    slope = max(0.0, sum((w - mean_w) * (ms_by_width[w] - mean_ms) for w in widths) / spread)
    level = mean_ms - slope * (mean_w - 1)
    if level > 0:
        return level, slope
    first, first_ms = widths[0], ms_by_width[widths[0]]
    spread = sum((w - first) ** 2 for w in widths)
    slope = max(0.0, sum((w - first) * (ms_by_width[w] - first_ms) for w in widths) / spread)
    slope = min(slope, first_ms / first) if first > 1 else slope  # the line stays above zero at width 1
    return first_ms - slope * (first - 1), slope


# A cut head is timed at this many rows (or a quarter of the head, if less): the smallest draft vocabulary a
# campaign tries (prune.config.RunConfig.vocab_sizes), so its predictions interpolate.
HEAD_PROBE_ROWS = 2048


@contextlib.contextmanager
def head_probe(drafter):
    """Within the block, (a view of `drafter` whose head computes `HEAD_PROBE_ROWS` of its rows, a quarter where
    it has fewer; that row count). The view shares every tensor (models.surgery.without_layers), so timing
    the head costs no copy of the drafter; which ids does not matter to the time."""
    from models.draft_vocab import cut_ids, draft_vocab, head_rows, set_draft_vocab

    rows = max(1, min(HEAD_PROBE_ROWS, head_rows(drafter) // 4))
    ids = cut_ids(draft_vocab(drafter), torch.zeros(0, dtype=torch.int64), rows, drafter.config)
    with without_layers(drafter, []) as view:
        yield set_draft_vocab(view, ids), rows


def drafter_layer_costs(drafter, packed_budget: int, repeats: int = 5, full: tuple[float, float] | None = None,
                        target=None, context: int = 64) -> tuple[LayerCost, LayerCost]:
    """(sync draft, packed) pass time as affine functions of depth and head rows, fitted on `drafter`, on a view
    of it without its second half of layers (models.surgery.without_layers: no weight copied) and on a copy
    of it whose head computes a few of its rows (`head_probe`; decode.cost.LayerCost).

    With `target`, both depths are timed in one interleaved measurement, each pass right after an untimed
    verify pass of width B/2 as in decoding (measure_pass_times does the same): a small drafter timed
    alone stays in the caches and looked cheaper than it decodes, so pruned drafters were predicted too
    fast (1.28x predicted, 1.04x measured at 8 of 36 layers removed). `full`: the drafter's own pass times
    when already measured (measure_pass_times); the fit then passes through them. Without a target the
    half-depth view is timed alone. Pinned times (`pinned_times`) give their own layer costs.
    """
    from models.draft_vocab import head_rows

    layers, rows = drafter.config.num_hidden_layers, head_rows(drafter)
    pinned = pinned_times()
    if pinned is not None:
        return pinned.layer_costs(rows)
    with contextlib.ExitStack() as views:
        cut, cut_rows = views.enter_context(head_probe(drafter))
        models = {"full": drafter, "head": cut}
        if layers >= 2:  # the view keeps the first layers at their own indices: the drafter runs beside it
            models["half"] = views.enter_context(without_layers(drafter, range(layers // 2, layers)))
        ms, measured = _probe_ms(models, full, packed_budget, repeats, context, target)
        half_depth = models["half"].config.num_hidden_layers if layers >= 2 else None
    return _fitted(layers, rows, full or measured, measured, ms, half_depth, cut_rows)


def _probe_ms(models: dict, full, packed_budget: int, repeats: int, context: int, target):
    """({name: (draft, packed) ms} of `models` and the full drafter's measured pair), `drafter_layer_costs`'
    measurement: interleaved after verify passes with `target`, each alone without it."""
    if target is None:
        ms = {name: drafter_pass_ms(model, packed_budget, repeats, context) for name, model in models.items()
              if name != "full" or full is None}
        measured = ms.get("full", full)
    else:
        probes = {name: _DrafterProbe(model, packed_budget, context) for name, model in models.items()}
        runs = {(name, kind): functools.partial(probe.run, getattr(probe, kind))
                for name, probe in probes.items() for kind in ("draft", "packed")}
        target_probe = _TargetProbe(target, context)
        verify = functools.partial(target_probe.run, max(2, models["full"].config.block_size // 2))
        times = _interleaved_ms(runs, repeats, probes["full"].engine.device, before={name: verify for name in runs})
        ms = {name: (times[(name, "draft")], times[(name, "packed")]) for name in models}
        measured = ms["full"]
    return ms, measured


def _fitted(layers: int, rows: int, full, measured, ms: dict, half_depth: int | None, cut_rows: int):
    """The (sync draft, packed) LayerCost of `drafter_layer_costs` from its probes' times `ms`.

    With the pair's own pass times (`full`), the depth and head dependence come from this measurement (every
    probe under the same conditions) and the level from the pair's times, so the fit meets them at full depth:
    a separate measurement of the full drafter here read 36 ms where the pair's read 46 ms, and every
    prediction moved with it."""
    scaled = {name: tuple(f * s / m for f, s, m in zip(full, ms[name], measured)) for name in ms if name != "full"}
    costs = []
    for kind in range(2):
        if layers < 2:
            cost = LayerCost(0.0, full[kind] / layers)
        else:
            cost = LayerCost.fit(layers, full[kind], half_depth, scaled["half"][kind])
        costs.append(cost.with_head(rows, full[kind], cut_rows, scaled["head"][kind]))
    return costs[0], costs[1]
