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

`report_rows` reads either layout back as (drafter, decoder, summary) rows.
"""

import platform
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable

import torch

from models.errors import ConfigError

from . import cost
from .baselines import ASSISTED, BASELINES, BaselineConfig
from .decoders import DECODERS, DecodeConfig, DecodeResult, decode_ar, decode_one, decode_speculative
from .metrics import summarize
from .prompts import Prompt
from .verifiers import ReplayVerifier

VERIFY_MODES = ("live", "replay")
SPECULATIVE = tuple(d for d in DECODERS if d != "ar")  # the rows run once per drafter
DECODER_NAMES = DECODERS + tuple(BASELINES)  # every decoder, in report order
# Summary fields that are per-prompt times: a lockstep batch has only the batch's, recorded ar outputs none.
UNTIMED = ("tokens_per_s", "time_per_token_ms", "decode_s", "prefill_s", "time_split_ms",
           "packed_hidden_fraction")
AR = (None, "ar")  # the row key of the shared baseline: (drafter name or None, decoder)


def _ar(target, prompt: list[int], config: DecodeConfig, options: BaselineConfig) -> DecodeResult:
    return decode_ar(target, prompt, config)


# Decoders that run the target alone: name -> function(target, prompt ids, DecodeConfig, BaselineConfig).
TARGET_DECODERS = {"ar": _ar, **BASELINES}


@dataclass
class BenchConfig:
    """What to benchmark.

    Attributes:
        decoders: any of DECODER_NAMES ("ar" runs regardless, as the baseline); see select_decoders.
        verify: "live" runs the target; "replay" answers the speculative rows' verification from the `ar`
            trajectory (greedy only; acceptance metrics are exact, times then exclude the target).
        warmup_tokens: max_new_tokens of the untimed warm-up run of each row on the first prompt.
        replay_batch: prompts decoded in lockstep by sync / async under replay (1: one at a time, timed).
        baselines: options of the transformers baselines (pld's lookup length).
    """

    decode: DecodeConfig = field(default_factory=DecodeConfig)
    decoders: tuple[str, ...] = DECODERS
    verify: str = "live"
    warmup_tokens: int = 16
    replay_batch: int = 1
    baselines: BaselineConfig = field(default_factory=BaselineConfig)

    def validate(self) -> None:
        check_decoder_names(self.decoders)
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"unknown verify mode {self.verify!r}; choose live or replay")
        if self.verify == "replay" and self.decode.temperature > 0:
            raise ConfigError("replay verification is greedy only; use --verify live with --temperature > 0")
        sampled_baselines = [d for d in self.decoders if d in BASELINES and self.decode.temperature > 0]
        if sampled_baselines:
            raise ConfigError(f"{sampled_baselines[0]} is a greedy baseline; drop it from --decoder or use "
                              "--temperature 0")
        if self.replay_batch < 1:
            raise ConfigError("--replay-batch must be at least 1")
        if self.replay_batch > 1 and self.verify != "replay":
            raise ConfigError("--replay-batch needs --verify replay (live verification decodes one prompt at a time)")
        if self.decode.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens must be at least 1")
        if self.decode.temperature < 0:
            raise ConfigError("--temperature must be >= 0")
        if self.baselines.pld_tokens < 1:
            raise ConfigError("--pld-tokens must be at least 1")
        if ASSISTED in self.decoders and self.baselines.assistant_model is None:
            raise ConfigError("the assisted decoder needs a draft model; pass --assistant MODEL")


def check_decoder_names(names: Iterable[str], allow_all: bool = False) -> None:
    """ConfigError naming the choices unless every name is a decoder (or "all", where allowed)."""
    known = DECODER_NAMES + (("all",) if allow_all else ())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"unknown decoder {unknown[0]!r}; choose from {', '.join(DECODER_NAMES)} or all")


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
            names |= {d for d in BASELINES if assistant or d != ASSISTED}
    return tuple(d for d in DECODER_NAMES if d in names)


def run_decoder(decoder: str, drafter, target, prompt: list[int], config: DecodeConfig, verifier=None,
                options: BaselineConfig | None = None) -> DecodeResult:
    """Decode one prompt with one decoder: the target alone, or `drafter` verified by the live target
    unless a verifier is given."""
    if decoder in TARGET_DECODERS:
        return TARGET_DECODERS[decoder](target, prompt, config, options or BaselineConfig())
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
            beside the measured `speedup_vs_ar`, and `speedup_limit` (tau x T_ar / T_verify).

    Returns:
        (report, outputs): the JSON-ready report (layout in the module docstring) and
        `{(drafter name or None, decoder): [DecodeResult per prompt]}`, the `ar` row first.
    """
    config.validate()
    names = [name for name, _ in drafters]
    twice = [name for name in names if names.count(name) > 1]
    if twice:
        raise ConfigError(f"drafter {twice[0]} is given twice; pass each drafter once")
    speculative = [d for d in SPECULATIVE if d in config.decoders]
    if speculative and not drafters:
        raise ConfigError(f"{speculative[0]} decoding needs a drafter")
    if ar_outputs is not None:
        check_recorded_outputs(ar_outputs, prompts, config)
    models = dict(drafters)
    decode_by_drafter = decode_by_drafter or {}
    times_by_drafter = times_by_drafter or {}

    def decode_of(drafter, base: DecodeConfig = config.decode) -> DecodeConfig:
        own = decode_by_drafter.get(drafter)
        return replace(own, max_new_tokens=base.max_new_tokens) if own is not None else base
    drafted = [(name, d) for name in names for d in speculative]
    rows = [AR, *drafted, *((None, d) for d in BASELINES if d in config.decoders)]
    recorded, batched = ar_outputs is not None, config.replay_batch > 1

    warm = replace(config.decode, max_new_tokens=min(config.warmup_tokens, config.decode.max_new_tokens))
    for row in rows:
        drafter, decoder = row
        if not (recorded and row == AR):
            run_decoder(decoder, models.get(drafter), target, prompts[0].input_ids, decode_of(drafter, warm),
                        options=config.baselines)

    outputs: dict[tuple, list[DecodeResult]] = {row: [] for row in rows}
    for index, prompt in enumerate(prompts):
        for row in rows:
            drafter, decoder = row
            if batched and row in drafted:
                continue  # decoded in lockstep below
            if recorded and row == AR:
                result = DecodeResult("ar", len(prompt.input_ids), list(ar_outputs[index]))
            else:
                replay = drafter is not None and config.verify == "replay"
                verifier = _replay(prompt, outputs[AR][index]) if replay else None
                result = run_decoder(decoder, models.get(drafter), target, prompt.input_ids, decode_of(drafter),
                                     verifier, config.baselines)
            outputs[row].append(result)
            if on_result is not None:
                on_result(index, decoder, drafter, result)
    for drafter, decoder in drafted if batched else ():
        for start in range(0, len(prompts), config.replay_batch):
            chunk = range(start, min(start + config.replay_batch, len(prompts)))
            verifiers = [_replay(prompts[i], outputs[AR][i]) for i in chunk]
            results = decode_speculative(decoder, models[drafter], verifiers, [prompts[i].input_ids for i in chunk],
                                         decode_of(drafter))
            outputs[drafter, decoder] += results
            for index, result in zip(chunk, results):
                if on_result is not None:
                    on_result(index, decoder, drafter, result)

    summaries = {}
    for row in rows:  # ar first: every other row's speedup is against it
        drafter, decoder = row
        untimed = (batched and row in drafted) or (recorded and row == AR)
        timed = drafter is None or config.verify == "live"  # replayed rows' times exclude the target
        summaries[row] = _summary(outputs[row], outputs[AR], summaries.get(AR), models.get(drafter), config,
                                  untimed, timed)
        if drafter in times_by_drafter:
            summaries[row].update(_predictions(decoder, times_by_drafter[drafter], summaries[row],
                                               decode_of(drafter).concurrent))
    return _report(summaries, drafters, len(prompts), config, target), outputs


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
    return summary


def _predictions(decoder: str, times: cost.PassTimes, summary: dict, concurrent: bool) -> dict:
    """The cost model's speedup for a row at its measured tau (pooled over rounds), mean verify width and
    fallback rate, and the physical limit at that tau and width."""
    tau, width = summary.get("tau_micro"), summary.get("verify_width_mean")
    if tau is None or width is None:
        return {"predicted_speedup": None, "speedup_limit": None}
    fallback = summary.get("fallback_rate") or 0.0
    share = summary.get("packed_share")
    shape = {} if share is None else {"packed_share": share, "packed_tokens": summary.get("packed_pass_tokens_mean")}
    return {"predicted_speedup": cost.predicted_speedup(decoder, times, tau, width, fallback, concurrent, **shape),
            "speedup_limit": cost.speedup_limit(times, tau, width)}


def _report(summaries: dict, drafters: list, prompts: int, config: BenchConfig, target) -> dict:
    """The JSON-ready report in the layout of the module docstring."""
    settings = _settings(config, target)
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
    baselines = {decoder: s for (owner, decoder), s in summaries.items() if owner is None}
    return {"drafters": entries, "baselines": baselines, "prompts": prompts, "settings": settings}


def report_rows(report: dict) -> list[tuple[str | None, str, dict]]:
    """(drafter name or None for target-only rows, decoder, summary) for every row of either layout, in the
    order they run per prompt: ar, each drafter's rows, the other baselines."""
    if "decoders" in report:
        drafter = report["settings"].get("drafter")
        return [(drafter if decoder in SPECULATIVE else None, decoder, summary)
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
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
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
        "tau": "tau_macro = mean of per-prompt mean (a+1); tau_micro = mean over all rounds",
    }
