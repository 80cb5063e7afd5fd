"""The benchmark harness behind `prune bench`: every decoder on the same prompts, one JSON record.

A row is one decoder over all prompts. Target-only rows, `ar` and the transformers baselines of
decode.baselines (`pld`, `generate`, and `assisted` where an assistant model is given), run once per
prompt; the speculative rows (`sync`, `async`) once per prompt and drafter, so several drafters are
compared against ONE `ar` run. Rows run interleaved per prompt (ar, each drafter's sync and async, then
the baselines for prompt 1, then prompt 2, ...) after a warm-up of every row, so that slow drift of the
machine's speed affects every row alike. `ar` always runs: it is the reference output for exactness and
the baseline for speedup.

With replayed verification and `replay_batch` > 1, the speculative rows run after the prompt loop, that
many prompts in lockstep (replay makes the result per prompt the same as alone; see
tests/test_replay.py): a whole suite part's tau costs minutes, and the per-prompt times, meaningless for
a batch, are reported as null. Recorded `ar` outputs (an earlier run's saved outputs) can stand in for
the target's decoding under replay, so comparing drafters on one prompt set runs the target once.
Replay replaces only the verification of speculative rows: the baselines, when asked for by name, still
run the live target (`all` leaves them out under replay, whose point is not to pay for the target).

Report layout. With one drafter (or none) every row sits in one table:

    {"decoders": {"ar": {...}, "sync": {...}, "async": {...}, "pld": {...}, "generate": {...}},
     "prompts": N, "settings": {..., "drafter": NAME, "block_size": B, "drafter_layers": L}}

With several drafters each measurement appears once: the target-only rows under "baselines", each
drafter's rows under its own entry, every `exact_match_vs_ar` and `speedup_vs_ar` against the one `ar`:

    {"drafters": [{"drafter": NAME, "layers": L, "block_size": B, "decoders": {"sync": {...}, "async": {...}}},
                  ...],
     "baselines": {"ar": {...}, "pld": {...}, "generate": {...}},
     "prompts": N, "settings": {...}}

and every drafter after the first carries "against_first": {decoder: {...}} (`against`): its speed and tau
as ratios to the first drafter's, measured in the same run - the answer to "is the pruned drafter faster
than its source, and at what tau".

`report_rows` reads either layout back as (drafter, decoder, summary) rows.
"""

import platform
from dataclasses import asdict, dataclass, replace
from typing import Iterable

import torch

from models.errors import ConfigError
from models.inference import target_products
from models.precision import dtype_name

from . import cost, registry
from .config import BaselineConfig, BenchConfig, DecodeConfig
from .decoders import DECODERS, DecodeResult, decode_one, decode_speculative
from .metrics import paired_ratio_error, summarize
from .prompts import Prompt
from .registry import BASELINE, SPECULATIVE, check_decoder_names
from .verifiers import ReplayVerifier

DRAFTED = registry.names(SPECULATIVE)  # the rows run once per drafter
# Summary fields that are per-prompt times: a lockstep batch has only the batch's, recorded ar outputs none.
UNTIMED = ("tokens_per_s", "time_per_token_ms", "round_ms", "drafting_round_ms", "decode_s", "prefill_s",
           "time_split_ms", "packed_hidden_fraction")
AR = (None, "ar")  # the row key of the shared baseline: (drafter name or None, decoder)


def select_decoders(names: Iterable[str], temperature: float = 0.0, verify: str = "live",
                    assistant: bool = False) -> tuple[str, ...]:
    """The decoders `names` asks for, in report order, "all" expanded.

    "all" is every decoder, less the baselines where they do not apply: at temperature > 0 (they are
    greedy), under replay verification (they time the target, which a replay run avoids paying for), and
    `assisted` without an assistant model. Named explicitly, a baseline is kept (and refused by
    BenchConfig.validate where it cannot run).
    """
    names = set(names)
    check_decoder_names(names, allow_all=True)
    if "all" in names:
        names |= set(DECODERS)
        if temperature == 0 and verify == "live":
            names |= {name for name, d in registry.DECODERS.items()
                      if d.kind == BASELINE and (assistant or not d.needs_assistant)}
    return tuple(d for d in registry.DECODERS if d in names)


def run_decoder(decoder: str, drafter, target, prompt: list[int], config: DecodeConfig, verifier=None,
                options: BaselineConfig | None = None) -> DecodeResult:
    """Decode one prompt with one decoder: the target alone, or `drafter` verified by the live target
    unless a verifier is given."""
    entry = registry.DECODERS[decoder]
    if entry.kind == BASELINE:
        return entry(target, prompt, config, options or BaselineConfig())
    return decode_one(decoder, drafter, target, prompt, config, verifier)


def run_bench(drafters: list[tuple[str, torch.nn.Module]], target, prompts: list[Prompt], config: BenchConfig,
              on_result=None, ar_outputs: list[list[int]] | None = None, decode_by_drafter: dict | None = None,
              times_by_drafter: dict | None = None) -> tuple[dict, dict]:
    """Benchmark the decoders on `prompts`, each drafter's sync / async against one shared `ar`.

    Args:
        drafters: (name, model) per drafter, names unique (the CLI uses the folders); may be empty when
            only target-only decoders are asked for.
        on_result: optional callback(prompt_index, decoder, drafter name or None, DecodeResult), e.g. to
            advance a progress bar.
        ar_outputs: the target's greedy outputs per prompt, recorded by an earlier run (same target,
            prompts and max_new_tokens): used as the `ar` results instead of decoding, replay only; the
            `ar` entry then has no times.
        decode_by_drafter: per drafter name, the DecodeConfig of its rows (e.g. its own adaptive width
            policy); drafters not named use `config.decode`.
        times_by_drafter: per drafter name, its measured decode.cost.PassTimes: its rows then report
            `predicted_speedup` (the cost model at the row's measured tau, verify width and fallback rate)
            beside the measured `speedup_vs_ar` (with `speedup_error`, its standard error over the prompts,
            paired with ar's decode times), and `speedup_limit` (tau x T_ar / T_verify).

    Returns:
        (report, outputs): the JSON-ready report (layout in the module docstring) and
        `{(drafter name or None, decoder): [DecodeResult per prompt]}`, the `ar` row first.
    """
    config.validate()
    _check_drafters(drafters, config)
    if ar_outputs is not None:
        check_recorded_outputs(ar_outputs, prompts, config)
    rows = _Rows(config, dict(drafters), decode_by_drafter or {}, times_by_drafter or {}, ar_outputs)
    rows.warm_up(target, prompts[0])
    outputs = rows.decode_per_prompt(target, prompts, on_result or _ignore)
    if rows.batched:
        rows.decode_in_lockstep(prompts, outputs, on_result or _ignore)
    return _report(rows.summaries(outputs), drafters, len(prompts), config, target), outputs


def _ignore(*_) -> None:
    pass


def _check_drafters(drafters: list, config: BenchConfig) -> None:
    """ConfigError for a drafter given twice, or for speculative rows without a drafter."""
    given = [name for name, _ in drafters]
    twice = [name for name in given if given.count(name) > 1]
    if twice:
        raise ConfigError(f"drafter {twice[0]} is given twice; pass each drafter once")
    speculative = [d for d in DRAFTED if d in config.decoders]
    if speculative and not drafters:
        raise ConfigError(f"{speculative[0]} decoding needs a drafter")


@dataclass
class _Rows:
    """The rows of one benchmark and how each decodes: `rows` lists (drafter name or None, decoder) in the
    order they run per prompt (ar, each drafter's speculative rows, the baselines); `drafted` the rows of a
    drafter; `ar_outputs` recorded ar outputs standing in for the ar row (None: ar decodes)."""

    config: BenchConfig
    models: dict
    decode_by_drafter: dict
    times_by_drafter: dict
    ar_outputs: list | None

    def __post_init__(self):
        speculative = [d for d in DRAFTED if d in self.config.decoders]
        self.drafted = [(name, d) for name in self.models for d in speculative]
        baselines = [(None, d) for d in registry.names(BASELINE) if d in self.config.decoders]
        self.rows = [AR, *self.drafted, *baselines]
        self.recorded = self.ar_outputs is not None
        self.batched = self.config.replay_batch > 1

    def decode_of(self, drafter, base: DecodeConfig | None = None) -> DecodeConfig:
        """The DecodeConfig of `drafter`'s rows (its own, else `base`), with `base`'s max_new_tokens."""
        base = base or self.config.decode
        own = self.decode_by_drafter.get(drafter)
        return replace(own, max_new_tokens=base.max_new_tokens) if own is not None else base

    def warm_up(self, target, prompt: Prompt) -> None:
        """One short untimed run of every row on the first prompt."""
        decode = self.config.decode
        warm = replace(decode, max_new_tokens=min(self.config.warmup_tokens, decode.max_new_tokens))
        for drafter, decoder in self.rows:
            if not (self.recorded and (drafter, decoder) == AR):
                run_decoder(decoder, self.models.get(drafter), target, prompt.input_ids, self.decode_of(drafter, warm),
                            options=self.config.baselines)

    def decode_per_prompt(self, target, prompts: list[Prompt], on_result) -> dict:
        """Every row on every prompt, interleaved per prompt (lockstep rows are left to decode_in_lockstep)."""
        outputs: dict[tuple, list[DecodeResult]] = {row: [] for row in self.rows}
        for index, prompt in enumerate(prompts):
            for row in self.rows:
                drafter, decoder = row
                if self.batched and row in self.drafted:
                    continue
                if self.recorded and row == AR:
                    result = DecodeResult("ar", len(prompt.input_ids), list(self.ar_outputs[index]))
                else:
                    replay = drafter is not None and self.config.verify == "replay"
                    verifier = _replay(prompt, outputs[AR][index]) if replay else None
                    result = run_decoder(decoder, self.models.get(drafter), target, prompt.input_ids,
                                         self.decode_of(drafter), verifier, self.config.baselines)
                outputs[row].append(result)
                on_result(index, decoder, drafter, result)
        return outputs

    def decode_in_lockstep(self, prompts: list[Prompt], outputs: dict, on_result) -> None:
        """The drafters' rows under replay, `replay_batch` prompts in lockstep, verified from the ar outputs."""
        size = self.config.replay_batch
        for drafter, decoder in self.drafted:
            for start in range(0, len(prompts), size):
                chunk = range(start, min(start + size, len(prompts)))
                verifiers = [_replay(prompts[i], outputs[AR][i]) for i in chunk]
                results = decode_speculative(decoder, self.models[drafter], verifiers,
                                             [prompts[i].input_ids for i in chunk], self.decode_of(drafter))
                outputs[drafter, decoder] += results
                for index, result in zip(chunk, results):
                    on_result(index, decoder, drafter, result)

    def summaries(self, outputs: dict) -> dict:
        """Each row's summary, ar first: every other row's speedup is against it."""
        summaries = {}
        for row in self.rows:
            drafter, decoder = row
            untimed = (self.batched and row in self.drafted) or (self.recorded and row == AR)
            timed = drafter is None or self.config.verify == "live"  # replayed rows' times exclude the target
            summaries[row] = _summary(outputs[row], outputs[AR], summaries.get(AR), self.models.get(drafter),
                                      self.config, untimed, timed)
            if drafter in self.times_by_drafter:
                summaries[row].update(_predictions(decoder, self.times_by_drafter[drafter], summaries[row],
                                                   self.decode_of(drafter).concurrent))
        return summaries


def _summary(results: list[DecodeResult], ar: list[DecodeResult], ar_summary: dict | None, drafter,
             config: BenchConfig, untimed: bool, timed: bool) -> dict:
    """One row's metrics plus exactness and speedup against `ar` (ar_summary None: this is the ar row)."""
    summary = summarize(results, drafter.config.block_size if drafter is not None else None)
    if ar_summary is None or config.decode.temperature > 0:
        summary["exact_match_vs_ar"] = None
    else:
        same = [r.output_ids == ref.output_ids for r, ref in zip(results, ar)]
        summary["exact_match_vs_ar"] = all(same)
        summary["exact_match_prompts"] = sum(same)
    if untimed:
        summary.update({key: None for key in UNTIMED if key in summary})
    base = (ar_summary or summary)["time_per_token_ms"]
    own = summary["time_per_token_ms"]
    summary["speedup_vs_ar"] = base / own if timed and base and own else None
    summary["speedup_error"] = None
    if summary["speedup_vs_ar"] is not None and ar_summary is not None:
        # ar's and this decoder's decode times of the same prompts, paired; the tokens' ratio turns the ratio
        # of times into one of times per token (1 where the outputs are ar's)
        tokens = sum(r.timed_tokens for r in results) / sum(r.timed_tokens for r in ar)
        summary["speedup_error"] = tokens * paired_ratio_error([r.decode_s for r in ar], [r.decode_s for r in results])
    return summary


def _predictions(decoder: str, times: cost.PassTimes, summary: dict, concurrent: bool) -> dict:
    """The cost model's speedup and round time for a row at its measured tau (pooled over drafting rounds), mean
    verify width, fallback rate and share of gated rounds, and the physical limit at that tau and width. Beside
    the measured `drafting_round_ms`, `predicted_round_ms` (a drafting round) shows where a prediction misses:
    in the round, or in the ar step it is divided by."""
    tau, width = summary.get("tau_micro"), summary.get("verify_width_mean")
    if tau is None or width is None:
        return {"predicted_speedup": None, "predicted_round_ms": None, "speedup_limit": None}
    fallback = summary.get("fallback_rate") or 0.0
    gated = summary.get("gated_share") or 0.0
    shape = cost.packed_shape(summary.get("packed_share"), summary.get("packed_pass_tokens_mean"))
    return {"predicted_speedup": cost.predicted_speedup(decoder, times, tau, width, fallback, concurrent, gated,
                                                        **shape),
            "predicted_round_ms": cost.round_ms(decoder, times, width, fallback, concurrent, **shape),
            "speedup_limit": cost.speedup_limit(times, tau, width, gated)}


def _report(summaries: dict, drafters: list, prompts: int, config: BenchConfig, target) -> dict:
    """The JSON-ready report in the layout of the module docstring."""
    settings = _settings(config, target)
    # the target's dtype is settings["dtype"]; the drafters compute in one dtype of their own (models/precision.py)
    settings["drafter_dtype"] = dtype_name(next(drafters[0][1].parameters()).dtype) if drafters else None
    if len(drafters) <= 1:
        name, drafter = drafters[0] if drafters else (None, None)
        settings.update({
            "drafter": name,
            "block_size": drafter.config.block_size if drafter is not None else None,
            "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None,
        })
        return {"decoders": {decoder: s for (_, decoder), s in summaries.items()}, "prompts": prompts,
                "settings": settings}
    entries = [
        {
            "drafter": name,
            "layers": drafter.config.num_hidden_layers,
            "block_size": drafter.config.block_size,
            "decoders": {decoder: s for (owner, decoder), s in summaries.items() if owner == name},
        }
        for name, drafter in drafters
    ]
    for entry in entries[1:]:
        entry["against_first"] = {decoder: against(row, entries[0]["decoders"].get(decoder, {}))
                                  for decoder, row in entry["decoders"].items()}
    baselines = {decoder: s for (owner, decoder), s in summaries.items() if owner is None}
    return {"drafters": entries, "baselines": baselines, "prompts": prompts, "settings": settings}


def against(row: dict, first: dict) -> dict:
    """One drafter's row against the first drafter's row of the same decoder, both from one run:

        speedup_ratio      its speedup over ar / the first's (> 1: faster per generated token)
        tau_ratio          its tau (macro) / the first's
        equal_tau_speedup  the first's drafting-round time / its own: what its passes alone buy, at equal tau

    Without the speculation gate (decode.gate), time per token is about round time / tau (micro) (a last round
    cut short by the token budget commits fewer), so speedup_ratio is about equal_tau_speedup x the tau (micro)
    ratio. A ratio without both numbers
    (an untimed replay row) is None."""

    def ratio(numerator, denominator):
        return numerator / denominator if numerator is not None and denominator else None

    return {"speedup_ratio": ratio(row.get("speedup_vs_ar"), first.get("speedup_vs_ar")),
            "tau_ratio": ratio(row.get("tau_macro"), first.get("tau_macro")),
            "equal_tau_speedup": ratio(first.get("drafting_round_ms"), row.get("drafting_round_ms"))}


def report_rows(report: dict) -> list[tuple[str | None, str, dict]]:
    """(drafter name or None for target-only rows, decoder, summary) for every row of either layout, in the
    order they run per prompt: ar, each drafter's rows, the other baselines."""
    if "decoders" in report:
        drafter = report["settings"].get("drafter")
        return [(drafter if decoder in DRAFTED else None, decoder, summary)
                for decoder, summary in report["decoders"].items()]
    baselines = report["baselines"]
    drafted = [(entry["drafter"], decoder, summary)
               for entry in report["drafters"] for decoder, summary in entry["decoders"].items()]
    return [(None, "ar", baselines["ar"]), *drafted,
            *((None, decoder, summary) for decoder, summary in baselines.items() if decoder != "ar")]


def _replay(prompt: Prompt, ar: DecodeResult) -> ReplayVerifier:
    """Verification answered from the target's recorded trajectory (prompt + ar output)."""
    return ReplayVerifier(prompt.input_ids + ar.output_ids)


def check_recorded_outputs(ar_outputs: list[list[int]], prompts: list[Prompt], config: BenchConfig) -> None:
    """ConfigError unless recorded ar outputs can stand in for decoding these prompts with `config`."""
    if config.verify != "replay":
        raise ConfigError("recorded ar outputs (--ar-outputs) need --verify replay")
    if len(ar_outputs) != len(prompts):
        raise ConfigError(f"{len(ar_outputs)} recorded ar outputs for {len(prompts)} prompts")
    cap, stops = config.decode.max_new_tokens, set(config.decode.stop_ids)
    for prompt, output in zip(prompts, ar_outputs):
        # A greedy output ends at a stop token or at the cap; any other length was made with another cap.
        if len(output) > cap or (len(output) < cap and (not output or output[-1] not in stops)):
            raise ConfigError(f"the recorded ar output of prompt {prompt.id!r} has {len(output)} tokens, which "
                              f"--max-new-tokens {cap} cannot produce; record it with the same --max-new-tokens")


def _settings(config: BenchConfig, target) -> dict:
    device = next(target.parameters()).device
    return {
        "decode": asdict(config.decode),
        "verify": config.verify,
        "replay_batch": config.replay_batch,
        "warmup_tokens": config.warmup_tokens,
        "baselines": config.baselines.settings(),
        "dtype": dtype_name(next(target.parameters()).dtype),
        "target_products": target_products(target),  # prepacked or plain, as models.inference.target_runner chose
        "device": str(device),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "time_per_token": "aggregate: total decode time / total tokens after the prefill token; for pld, "
        "generate and assisted, decode time = T(generate) - T(generate with max_new_tokens=1) on the same prompt",
        "tau": "tau_macro = mean of per-prompt mean (a+1); tau_micro = mean over all rounds; both over the "
        "drafting rounds (gated_share: rounds the speculation gate ran as plain target steps)",
    }
