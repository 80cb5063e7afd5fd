"""The speculation gate: when it closes, how long it waits, and that gated decoding stays exact."""

from dataclasses import replace

import pytest

from _pairs import constant_pair, prompt_ids, replays_in_a_batch_and_alone, tiny_target, trained_drafter
from conftest import build_tiny_drafter
from decode import cost
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.gate import GatePolicy
from decode.metrics import summarize
from decode.verifiers import LiveVerifier, ReplayVerifier

# A drafting round costs 2 one-token steps at any width: a round must commit 2 tokens to break even.
TWO_STEPS = cost.WidthPolicy(slope=0.0, fixed=1.0)


def test_the_gate_closes_waits_probes_and_doubles_its_wait_while_probes_fail():
    gate = GatePolicy(TWO_STEPS, first_wait=8).gate()  # threshold 0.9, smoothing 0.5, start 1.5, waits 8 .. 32
    trace = []

    def draft_round(committed):
        assert gate.drafting
        gate.observe(committed, 4)
        trace.append(("draft", round(gate.efficiency, 4), gate.drafting, gate.wait))

    def target_steps(count):
        for _ in range(count):
            assert not gate.drafting
            gate.observe(1, None)
        trace.append(("steps", count, gate.drafting))

    draft_round(1)  # efficiency (1.5 + 0.5) / 2 = 1.0: still drafting
    draft_round(1)  # 0.75 < 0.9: closed for 8 tokens
    target_steps(8)  # then a probe
    draft_round(1)  # 0.625: the probe failed, the wait doubles
    target_steps(16)
    draft_round(1)  # fails again: 32
    target_steps(32)
    draft_round(1)  # stays at max_wait
    target_steps(32)
    draft_round(8)  # efficiency 4 counts at half: (0.2109 + 4) / 2
    draft_round(1)  # 1.30: drafting on
    draft_round(1)  # 0.90: at the threshold, still drafting
    draft_round(1)  # 0.70: closed, and the wait starts again at 8 (no probe failed)
    assert trace == [
        ("draft", 1.0, True, 0), ("draft", 0.75, False, 8), ("steps", 8, True),
        ("draft", 0.625, False, 16), ("steps", 16, True),
        ("draft", 0.5625, False, 32), ("steps", 32, True),
        ("draft", 0.5312, False, 32), ("steps", 32, True),
        ("draft", 2.2656, True, 0), ("draft", 1.3828, True, 0), ("draft", 0.9414, True, 0),
        ("draft", 0.7207, False, 8),
    ]


def test_target_steps_count_the_tokens_they_commit():
    gate = GatePolicy(TWO_STEPS, first_wait=3).gate()
    gate.observe(1, 2)
    gate.observe(1, 2)
    assert not gate.drafting and gate.wait == 3
    gate.observe(2, None)  # a step that commits 2 (a stop rule cannot, but the count is what matters)
    assert not gate.drafting
    gate.observe(1, None)
    assert gate.drafting


def test_a_drafter_that_pays_for_itself_is_never_gated():
    target, drafter = constant_pair(8, drafted=7, predicted=7)
    config = DecodeConfig(max_new_tokens=40, gate_policy=GatePolicy(TWO_STEPS))
    for decoder in ("sync", "async"):
        result = decode_speculative(decoder, drafter, [LiveVerifier(target)], [[1, 2, 3]], config)[0]
        assert all(rnd.drafted for rnd in result.rounds)
        assert result.acceptance[:4] == [7, 7, 7, 7]


def _gated_config(**fields) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=61, gate_policy=GatePolicy(TWO_STEPS, first_wait=4, max_wait=8), **fields)


@pytest.mark.parametrize("prompt_len", [1, 13])
def test_gated_decoding_equals_ar_and_replays_live_decisions(prompt_len):
    target = tiny_target()
    drafter = build_tiny_drafter(num_hidden_layers=2, block_size=8, seed=3)  # random: almost never right
    config = _gated_config(packed_budget=36)
    prompt = prompt_ids(prompt_len, seed=prompt_len)
    reference = decode_ar(target, prompt, config).output_ids
    trajectory = prompt + reference
    for decoder in ("sync", "async"):
        for variant in (config, replace(config, concurrent=False)):
            live = decode_speculative(decoder, drafter, [LiveVerifier(target)], [prompt], variant)[0]
            replay = decode_speculative(decoder, drafter, [ReplayVerifier(trajectory)], [prompt], variant)[0]
            assert live.output_ids == replay.output_ids == reference
            assert [r.drafted for r in live.rounds] == [r.drafted for r in replay.rounds]
            assert live.round_trace == replay.round_trace
            gated = [r for r in live.rounds if not r.drafted]
            assert gated and all(r.accepted == 0 and r.width == 1 and r.hit is None for r in gated)
            # it probes again after each wait: drafting rounds follow gated ones
            assert any(not a.drafted and b.drafted for a, b in zip(live.rounds, live.rounds[1:]))


def test_a_trained_drafter_gated_in_a_batch_is_exact_and_batch_independent():
    target, drafter = trained_drafter()
    config = replace(_gated_config(), gate_policy=GatePolicy(cost.WidthPolicy(slope=0.0, fixed=1.6)))
    prompts = [prompt_ids(n, seed=40 + n) for n in (2, 7, 11)]
    for _, batched, singles in replays_in_a_batch_and_alone(target, drafter, prompts, config):
        assert [r.round_trace for r in batched] == [r.round_trace for r in singles]
        assert [[rnd.drafted for rnd in r.rounds] for r in batched] == [[rnd.drafted for rnd in r.rounds]
                                                                      for r in singles]
        assert any(not rnd.drafted for r in batched for rnd in r.rounds)
        assert any(a > 0 for r in batched for a in r.acceptance)


def test_tau_counts_the_drafting_rounds_and_the_rest_are_gated():
    target = tiny_target()
    drafter = build_tiny_drafter(num_hidden_layers=2, block_size=8, seed=3)
    result = decode_speculative("sync", drafter, [LiveVerifier(target)], [prompt_ids(5)], _gated_config())[0]
    drafting = [r.accepted + 1 for r in result.rounds if r.drafted]
    summary = summarize([result], 8)
    assert summary["tau_micro"] == pytest.approx(sum(drafting) / len(drafting))
    assert summary["gated_share"] == pytest.approx(1 - len(drafting) / len(result.rounds))
    assert sum(summary["acceptance_histogram"]) == len(drafting)
    # every committed token is accounted for: drafting rounds' a + 1 and one per target step
    assert sum(drafting) + (len(result.rounds) - len(drafting)) == len(result.output_ids) - 1


def test_the_cost_model_mixes_gated_steps_into_the_time_per_token():
    times = cost.PassTimes(ar_ms=10.0, per_token_ms=1.0, draft_ms=8.0, packed_ms=12.0, step_ms=2.0)
    drafting = cost.round_ms("sync", times, 3)  # 10 + 2 + 2 + 8 = 22
    assert cost.predicted_speedup("sync", times, 2.0, 3, gated_share=0.0) == pytest.approx(10 * 2 / drafting)
    # half the rounds gated: 0.5 x 22 + 0.5 x 10 ms for 0.5 x 2 + 0.5 tokens
    assert cost.time_per_token_ms("sync", times, 2.0, 3, gated_share=0.5) == pytest.approx(16 / 1.5)
    assert cost.predicted_speedup("sync", times, 2.0, 3, gated_share=1.0) == pytest.approx(1.0)
    assert cost.speedup_limit(times, 2.0, 3, gated_share=1.0) == pytest.approx(1.0)
    assert cost.speedup_limit(times, 2.0, 3, gated_share=0.5) == pytest.approx(1.5 * 10 / (0.5 * 14 + 5))


def test_the_gate_reads_the_round_cost_the_width_policy_maximises_against():
    times = cost.PassTimes(ar_ms=40.0, per_token_ms=2.0, draft_ms=30.0, packed_ms=50.0, step_ms=10.0)
    policy = GatePolicy.from_times(times)
    assert policy.cost == cost.WidthPolicy.from_times(times)
    assert policy.cost.round_cost(4) == pytest.approx(1 + 0.05 * 3 + 1.0)
    assert DecodeConfig().tuned_to(times, gate=True).gate_policy == policy
    assert DecodeConfig().tuned_to(times).gate_policy is None


def test_the_gate_study_replays_recorded_rounds_and_bounds_them_by_the_oracle():
    from scripts.gate_study import oracle, simulate

    # (a, W) of a drafting round at each position: a run of hits, then nothing but misses
    rounds = [(3, 4)] * 8 + [(0, 2)] * 40
    tokens, cost_without = simulate(rounds, TWO_STEPS, None)
    assert tokens == len(rounds)
    assert cost_without == pytest.approx(2 * 2 + 2 * 40)  # positions 0 and 4 (4 tokens each), then 40 misses
    _, cost_gated = simulate(rounds, TWO_STEPS, GatePolicy(TWO_STEPS))
    _, cost_best = oracle(rounds, TWO_STEPS)
    assert cost_best == pytest.approx(2 * 2 + 40)  # draft the hits, step through the misses
    assert cost_best <= cost_gated < cost_without
