"""transformers' baselines (decode.baselines) against our ar, and the bench's choice of decoders and layout."""

import pytest

from _pairs import prompt_ids, tiny_target
from decode.config import BaselineConfig
from decode.registry import BASELINES
from decode.bench import DECODERS, BenchConfig, run_bench, select_decoders
from decode.decoders import DecodeConfig, decode_ar
from decode.prompts import Prompt
from models.errors import ConfigError


def test_generate_baselines_match_ar_under_our_stop_rule():
    target = tiny_target()
    prompt = prompt_ids(8)
    free = decode_ar(target, prompt, DecodeConfig(max_new_tokens=30)).output_ids
    # The model's own EOS is no stop unless it is a stop id, as for our decoders.
    target.generation_config.eos_token_id = free[4]
    stop = free[12]
    configs = (DecodeConfig(max_new_tokens=30), DecodeConfig(max_new_tokens=30, stop_ids=(stop,)),
               DecodeConfig(max_new_tokens=5), DecodeConfig(max_new_tokens=1))
    options = BaselineConfig(pld_tokens=4, assistant_model=tiny_target(seed=2, layers=1, hidden=24))
    for config in configs:
        ar = decode_ar(target, prompt, config)
        for name, baseline in BASELINES.items():
            result = baseline(target, prompt, config, options)
            assert result.decoder == name and result.output_ids == ar.output_ids, (name, config)
            assert result.rounds == [] and result.prompt_len == len(prompt)
            assert result.prefill_s > 0 and result.decode_s >= 0
    assert len(decode_ar(target, prompt, configs[1]).output_ids) == free.index(stop) + 1


def test_decoder_selection():
    assert select_decoders(["all"]) == ("ar", "sync", "async", "pld", "generate")
    assert select_decoders(["all"], temperature=0.5) == DECODERS  # greedy baselines left out
    assert select_decoders(["all"], verify="replay") == DECODERS
    assert select_decoders(["generate", "ar", "pld"]) == ("ar", "pld", "generate")
    assert select_decoders(["all"], assistant=True) == ("ar", "sync", "async", "pld", "generate", "assisted")
    with pytest.raises(ConfigError, match="choose from ar, sync, async, pld, generate, assisted or all"):
        select_decoders(["ar", "fast"])
    with pytest.raises(ConfigError, match="--assistant"):
        BenchConfig(DecodeConfig(), decoders=("ar", "assisted")).validate()
    with pytest.raises(ConfigError, match="greedy"):
        BenchConfig(DecodeConfig(temperature=0.5), decoders=("ar", "generate")).validate()


def test_target_only_bench_without_drafters():
    target = tiny_target()
    prompts = [Prompt(f"p{i}", prompt_ids(6, seed=i)) for i in range(2)]
    seen = []
    config = BenchConfig(DecodeConfig(max_new_tokens=8), ("ar", "generate"))
    report, outputs = run_bench([], target, prompts, config,
                                on_result=lambda index, decoder, drafter, _: seen.append((index, decoder, drafter)))
    assert seen == [(0, "ar", None), (0, "generate", None), (1, "ar", None), (1, "generate", None)]
    assert list(outputs) == [(None, "ar"), (None, "generate")] and set(report["decoders"]) == {"ar", "generate"}
    assert report["decoders"]["generate"]["exact_match_vs_ar"] is True and report["settings"]["drafter"] is None
    with pytest.raises(ConfigError, match="needs a drafter"):
        run_bench([], target, prompts, BenchConfig(DecodeConfig(max_new_tokens=8), ("ar", "sync")))


def test_the_measured_speedup_carries_its_standard_error_over_the_prompts():
    """speedup = ar's time per token over the decoder's; its error pairs each prompt's two decode times
    (decode.metrics.paired_ratio_error): none where every prompt gains alike, and as large as the spread of
    the per-prompt gains otherwise (checked against the closed form for two prompts)."""
    from decode.bench import _summary
    from decode.decoders import DecodeResult

    def results(decoder, seconds):
        return [DecodeResult(decoder, 3, list(range(11)), decode_s=s) for s in seconds]

    config = BenchConfig(decode=DecodeConfig(max_new_tokens=10))
    ar = results("ar", [2.0, 4.0])
    ar_summary = _summary(ar, ar, None, None, config, untimed=False, timed=True)
    assert ar_summary["speedup_vs_ar"] == 1.0 and ar_summary["speedup_error"] is None
    even = _summary(results("sync", [1.0, 2.0]), ar, ar_summary, None, config, untimed=False, timed=True)
    assert even["speedup_vs_ar"] == pytest.approx(2.0) and even["speedup_error"] == pytest.approx(0.0, abs=1e-12)
    uneven = _summary(results("sync", [1.0, 4.0]), ar, ar_summary, None, config, untimed=False, timed=True)
    # R = 6 / 5; residuals 2 - 1.2 = 0.8 and 4 - 4.8 = -0.8; sqrt(1.28 / 2) / 2.5 = 0.32
    assert uneven["speedup_vs_ar"] == pytest.approx(1.2) and uneven["speedup_error"] == pytest.approx(0.32)
    replayed = _summary(results("sync", [1.0, 4.0]), ar, ar_summary, None, config, untimed=False, timed=False)
    assert replayed["speedup_vs_ar"] is None and replayed["speedup_error"] is None


def test_pass_times_read_at_another_speed_of_the_machine_are_named():
    """The bench notes pass times whose one-token step lies far from ar's measured time per token in the same
    run (a probe cached from a slower or faster moment of the machine), and names the record to delete."""
    from pathlib import Path

    from prune.commands.bench import stale_pass_times_note

    def report(probe_ms):
        return {"decoders": {"ar": {"time_per_token_ms": 45.0}, "async": {"time_per_token_ms": 40.0}},
                "settings": {"pass_times": {"d": {"ar_ms": probe_ms}}}}

    assert stale_pass_times_note(report(38.0), Path("c/pass-times/k.json")) is None  # the usual 0.8-0.9
    note = stale_pass_times_note(report(97.5), Path("c/pass-times/k.json"))
    assert "97.5 ms where ar decoded at 45.0 ms" in note
    assert note.endswith("delete c/pass-times/k.json to measure them again")
    assert "run again" in stale_pass_times_note(report(20.0), None)
    assert stale_pass_times_note({"decoders": {"ar": {"time_per_token_ms": None}}, "settings": {}}, None) is None

    def drafted(round_ms):  # a drafter's rounds priced at 2 steps of a 40 ms probe, timed at round_ms
        return {"decoders": {"ar": {"time_per_token_ms": 45.0},
                             "sync": {"drafting_round_ms": round_ms, "predicted_round_ms": 80.0}},
                "settings": {"drafter": "d", "pass_times": {"d": {"ar_ms": 40.0}}}}

    assert stale_pass_times_note(drafted(95.0), None) is None  # 2.11 steps measured against 2 modelled
    note = stale_pass_times_note(drafted(200.0), Path("k.json"))  # 4.44 steps: the draft probe ran fast
    assert "price a sync round of d at 2.00 target steps where its rounds took 4.44" in note
    assert note.endswith("delete k.json to measure them again")
