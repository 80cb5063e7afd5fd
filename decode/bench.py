"""The benchmark harness behind `prune bench`: every decoder on the same prompts, one JSON record.

Decoders run interleaved per prompt (ar, sync, async for prompt 1, then prompt 2, ...) after a warm-up,
so that slow drift of the machine's speed affects every decoder alike. `ar` always runs: it is the
reference output for exactness and the baseline for speedup. With replayed verification and
`replay_batch` > 1, the speculative decoders run after `ar`, that many prompts in lockstep (replay makes
the result per prompt the same as alone; see tests/test_replay.py): a whole suite part's tau costs
minutes, and the per-prompt times, meaningless for a batch, are reported as null. Recorded `ar` outputs
(an earlier run's saved outputs) can stand in for the target's decoding under replay, so comparing
drafters on one prompt set runs the target once.
"""

import platform
from dataclasses import asdict, dataclass, field, replace

import torch

from models.errors import ConfigError

from .decoders import DECODERS, DecodeConfig, DecodeResult, decode_ar, decode_speculative
from .metrics import summarize
from .prompts import Prompt
from .verifiers import LiveVerifier, ReplayVerifier

VERIFY_MODES = ("live", "replay")
# Summary fields that are per-prompt times: a lockstep batch has only the batch's, recorded ar outputs none.
UNTIMED = ("tokens_per_s", "time_per_token_ms", "decode_s", "prefill_s", "time_split_ms",
           "packed_hidden_fraction")


@dataclass
class BenchConfig:
    """What to benchmark.

    Attributes:
        decoders: any of "ar", "sync", "async" ("ar" runs regardless, as the baseline).
        verify: "live" runs the target; "replay" answers verification from the `ar` trajectory
            (greedy only; acceptance metrics are exact, times then exclude the target).
        warmup_tokens: max_new_tokens of the untimed warm-up run of each decoder on the first prompt.
        replay_batch: prompts decoded in lockstep by sync / async under replay (1: one at a time, timed).
    """

    decode: DecodeConfig = field(default_factory=DecodeConfig)
    decoders: tuple[str, ...] = DECODERS
    verify: str = "live"
    warmup_tokens: int = 16
    replay_batch: int = 1

    def validate(self) -> None:
        unknown = [d for d in self.decoders if d not in DECODERS]
        if unknown:
            raise ConfigError(f"unknown decoder {unknown[0]!r}; choose from {', '.join(DECODERS)} or all")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"unknown verify mode {self.verify!r}; choose live or replay")
        if self.verify == "replay" and self.decode.temperature > 0:
            raise ConfigError("replay verification is greedy only; use --verify live with --temperature > 0")
        if self.replay_batch < 1:
            raise ConfigError("--replay-batch must be at least 1")
        if self.replay_batch > 1 and self.verify != "replay":
            raise ConfigError("--replay-batch needs --verify replay (live verification decodes one prompt at a time)")
        if self.decode.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens must be at least 1")
        if self.decode.temperature < 0:
            raise ConfigError("--temperature must be >= 0")


def run_decoder(decoder: str, drafter, target, prompt: list[int], config: DecodeConfig, verifier=None) -> DecodeResult:
    """Decode one prompt with one decoder (live target unless a verifier is given)."""
    if decoder == "ar":
        return decode_ar(target, prompt, config)
    verifier = verifier or LiveVerifier(target, config.temperature)
    return decode_speculative(decoder, drafter, [verifier], [prompt], config)[0]


def run_bench(drafter, target, prompts: list[Prompt], config: BenchConfig, on_result=None,
              ar_outputs: list[list[int]] | None = None) -> tuple[dict, dict]:
    """Benchmark the decoders on `prompts`.

    Args:
        on_result: optional callback(prompt_index, decoder, DecodeResult), e.g. to advance a progress bar.
        ar_outputs: the target's greedy outputs per prompt, recorded by an earlier run (same target,
            prompts and max_new_tokens): used as the `ar` results instead of decoding, replay only; the
            `ar` entry then has no times.

    Returns:
        (report, outputs): the JSON-ready report `{"decoders": {...}, "prompts": N, "settings": {...}}`
        and `{decoder: [DecodeResult per prompt]}`.
    """
    config.validate()
    if ar_outputs is not None:
        check_recorded_outputs(ar_outputs, prompts, config)
    decoders = ["ar"] + [d for d in DECODERS if d in config.decoders and d != "ar"]
    block_size = drafter.config.block_size if drafter is not None else None
    warm = replace(config.decode, max_new_tokens=min(config.warmup_tokens, config.decode.max_new_tokens))
    for decoder in decoders[1:] if ar_outputs is not None else decoders:
        run_decoder(decoder, drafter, target, prompts[0].input_ids, warm)

    outputs: dict[str, list[DecodeResult]] = {d: [] for d in decoders}
    batched = config.replay_batch > 1
    for index, prompt in enumerate(prompts):
        for decoder in decoders[:1] if batched else decoders:
            verifier = None
            if decoder != "ar" and config.verify == "replay":
                verifier = _replay(prompt, outputs["ar"][index])
            if decoder == "ar" and ar_outputs is not None:
                result = DecodeResult("ar", len(prompt.input_ids), list(ar_outputs[index]))
            else:
                result = run_decoder(decoder, drafter, target, prompt.input_ids, config.decode, verifier)
            outputs[decoder].append(result)
            if on_result is not None:
                on_result(index, decoder, result)
    for decoder in decoders[1:] if batched else ():
        for start in range(0, len(prompts), config.replay_batch):
            chunk = range(start, min(start + config.replay_batch, len(prompts)))
            verifiers = [_replay(prompts[i], outputs["ar"][i]) for i in chunk]
            results = decode_speculative(decoder, drafter, verifiers, [prompts[i].input_ids for i in chunk],
                                         config.decode)
            outputs[decoder] += results
            for index, result in zip(chunk, results):
                if on_result is not None:
                    on_result(index, decoder, result)

    report = {"decoders": {}, "prompts": len(prompts), "settings": _settings(config, drafter, target)}
    ar_summary = summarize(outputs["ar"], block_size)
    for decoder in decoders:
        summary = summarize(outputs[decoder], block_size)
        if decoder == "ar" or config.decode.temperature > 0:
            summary["exact_match_vs_ar"] = None
        else:
            same = [r.output_ids == ref.output_ids for r, ref in zip(outputs[decoder], outputs["ar"])]
            summary["exact_match_vs_ar"] = all(same)
            summary["exact_match_prompts"] = sum(same)
        if (batched and decoder != "ar") or (decoder == "ar" and ar_outputs is not None):
            summary.update({key: None for key in UNTIMED if key in summary})
        timed = decoder == "ar" or config.verify == "live"
        base, own = ar_summary["time_per_token_ms"], summary["time_per_token_ms"]
        summary["speedup_vs_ar"] = base / own if timed and base and own else None
        report["decoders"][decoder] = summary
    return report, outputs


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


def _settings(config: BenchConfig, drafter, target) -> dict:
    device = next(target.parameters()).device
    return {
        "decode": asdict(config.decode),
        "verify": config.verify,
        "replay_batch": config.replay_batch,
        "warmup_tokens": config.warmup_tokens,
        "block_size": drafter.config.block_size if drafter is not None else None,
        "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None,
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "device": str(device),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "time_per_token": "aggregate: total decode time / total tokens after the prefill token",
        "tau": "tau_macro = mean of per-prompt mean (a+1); tau_micro = mean over all rounds",
    }
