"""The cost model (decode/cost.py) on synthetic pass times, and the adaptive verify width."""

import pytest

from decode.cost import (LayerCost, PassTimes, WidthPolicy, equal_tau_speedup, predicted_speedup, round_ms,
                         speedup_limit, time_per_token_ms)


def times(**overrides) -> PassTimes:
    values = dict(ar_ms=40.0, per_token_ms=4.0, draft_ms=20.0, packed_ms=30.0, contention=0.0)
    values.update(overrides)
    return PassTimes(**values)


def test_verify_time_grows_with_width():
    t = times()
    assert t.verify_ms(1) == 40.0 and t.verify_ms(5) == 56.0 and t.verify_ms(3.5) == pytest.approx(50.0)


def test_sync_round_is_verify_plus_draft_and_ar_is_one_step():
    t = times()
    assert round_ms("sync", t, 5) == 56.0 + 20.0
    assert time_per_token_ms("sync", t, tau=2.0, width=5) == pytest.approx(38.0)
    assert time_per_token_ms("ar", t, tau=3.0, width=5) == 40.0  # tau does not apply to ar


def test_concurrent_against_sequential_passes():
    t = times()
    # Perfect overlap: the longer pass; no overlap: both; contention 0.5: half of the shorter one on top.
    assert round_ms("async", t, 5) == 56.0
    assert round_ms("async", t, 5, concurrent=False) == 86.0
    assert round_ms("async", times(contention=0.5), 5) == pytest.approx(56.0 + 15.0)
    assert round_ms("async", times(contention=1.0), 5) == pytest.approx(round_ms("async", t, 5, concurrent=False))


def test_hits_and_fallbacks():
    t = times()
    every_hit = round_ms("async", t, 5, fallback_rate=0.0)
    every_miss = round_ms("async", t, 5, fallback_rate=1.0)
    assert every_miss - every_hit == pytest.approx(t.draft_ms)
    assert round_ms("async", t, 5, fallback_rate=0.25) == pytest.approx(every_hit + 5.0)


def test_verify_bound_then_packed_bound_round():
    # Verify-bound: a cheaper packed pass changes nothing.
    assert round_ms("async", times(packed_ms=30.0), 5) == round_ms("async", times(packed_ms=10.0), 5) == 56.0
    # Packed-bound: the packed pass outlasts verification and sets the round; a cheaper drafter helps.
    assert round_ms("async", times(packed_ms=90.0), 5) == 90.0
    assert round_ms("async", times(packed_ms=70.0), 5) == 70.0


def test_what_a_cheaper_drafter_buys_at_equal_tau():
    full, pruned = times(draft_ms=20.0, packed_ms=30.0), times(draft_ms=15.0, packed_ms=22.0)
    # Sync pays the draft in every round: (56 + 20) / (56 + 15), whatever the tau, and it is the ratio of the
    # two drafters' predicted speedups at one tau.
    assert equal_tau_speedup("sync", full, pruned, 5) == pytest.approx(76.0 / 71.0)
    assert equal_tau_speedup("sync", full, pruned, 5) == pytest.approx(
        predicted_speedup("sync", pruned, 2.7, 5) / predicted_speedup("sync", full, 2.7, 5))
    # Async with the packed pass hidden behind verification and every draft a hit: depth buys nothing.
    assert equal_tau_speedup("async", full, pruned, 5) == 1.0
    # ... only the fallback drafts it still pays, or the packed pass where it bounds the round.
    assert equal_tau_speedup("async", full, pruned, 5, fallback_rate=0.5) == pytest.approx(66.0 / 63.5)
    assert equal_tau_speedup("async", times(packed_ms=90.0), times(packed_ms=66.0), 5) == pytest.approx(90.0 / 66.0)
    assert equal_tau_speedup("async", full, full, 5, fallback_rate=0.3) == 1.0


def test_speedup_and_limit():
    t = times()
    assert predicted_speedup("sync", t, tau=2.0, width=5) == pytest.approx(40.0 / 38.0)
    # A free, always-hitting drafter reaches the limit exactly.
    free = times(draft_ms=0.0, packed_ms=0.0)
    assert predicted_speedup("async", free, tau=2.5, width=5) == pytest.approx(speedup_limit(t, 2.5, 5))
    assert speedup_limit(t, 2.5, 5) == pytest.approx(2.5 * 40.0 / 56.0)
    with pytest.raises(ValueError, match="no cost model"):
        round_ms("beam", t, 5)


def test_width_policy_follows_the_drafters_confidence():
    policy = WidthPolicy.from_times(times())  # slope 0.1, fixed 0.5 (ratios to ar_ms)
    assert (policy.slope, policy.fixed) == (0.1, 0.5)
    assert policy.choose([0.99] * 15, 16) == 16  # a confident drafter: verify everything
    assert policy.choose([0.05] * 15, 16) == 2  # hopeless drafts: verify one
    sure_then_lost = [0.95, 0.95, 0.95, 0.02] + [0.5] * 11
    assert policy.choose(sure_then_lost, 16) == 4
    free_width = WidthPolicy(slope=0.0, fixed=0.5)
    assert free_width.choose([0.5] * 15, 16) == 16  # verifying costs nothing more: take every draft


def test_width_policy_is_robust_to_timing_noise():
    a = WidthPolicy.from_times(times(per_token_ms=4.01, draft_ms=20.05))
    b = WidthPolicy.from_times(times(per_token_ms=3.99, draft_ms=19.97))
    assert a == b


def test_pass_time_kinds_are_sampled_in_turn():
    """Every kind of pass is sampled once per round (warm-up round untimed), so load hits all alike."""
    from decode import timing

    order = []
    runs = {name: (lambda name=name: order.append(name)) for name in ("ar", "verify", "packed")}
    medians = timing._interleaved_ms(runs, repeats=3)
    assert order == ["ar", "verify", "packed"] * 4
    assert set(medians) == set(runs) and all(ms >= 0 for ms in medians.values())


@pytest.mark.measured_times
def test_measured_pass_times_of_a_tiny_pair_are_consistent():
    from _pairs import tiny_target
    from conftest import build_tiny_drafter
    from decode.decoders import DecodeConfig
    from decode.timing import measure_pass_times

    target, drafter = tiny_target(), build_tiny_drafter(block_size=4)
    times = measure_pass_times(target, drafter, DecodeConfig(packed_budget=16), repeats=2, context=16)
    assert times.ar_ms > 0 and times.draft_ms > 0 and times.packed_ms > 0
    assert times.per_token_ms >= 0 and 0.0 <= times.contention <= 1.0
    assert times.draft_tokens == 5 and times.packed_tokens == 4 + 3 * 5  # block 4, budget 16: 3 candidates


def test_the_ar_step_is_read_off_a_line_through_every_verify_width():
    from decode.timing import verify_line

    line = {w: 50.0 + 3.0 * (w - 1) for w in (1, 2, 4, 8, 16)}
    assert verify_line(line) == pytest.approx((50.0, 0.0, 3.0))
    # One slow width-1 sample (the ar step read alone) moves the fitted ar step by a fraction of its error.
    ar_ms, step, slope = verify_line({**line, 1: 65.0})
    assert 50.0 < ar_ms < 50.0 + 15.0 / 2 and step == 0.0 and 0.0 <= slope < 3.0
    # A pass that gets no slower with width (a GPU): no negative slope, the ar step is the mean.
    assert verify_line({1: 10.0, 2: 10.5, 4: 9.5, 8: 10.0, 16: 9.0}) == pytest.approx((9.8, 0.0, 0.0))
    assert verify_line({1: 42.0}) == (42.0, 0.0, 0.0)
    # Noise that tilts the line below zero at width 1 (read under load): the line through the one-token pass.
    ar_ms, step, slope = verify_line({1: 0.4, 2: 0.3, 4: 3.0, 8: 9.0, 16: 30.0})
    assert ar_ms == 0.4 and step == 0.0 and slope > 0
    ar_ms, step, slope = verify_line({2: 0.3, 4: 3.0, 8: 9.0, 16: 30.0})
    assert ar_ms > 0 and slope >= 0


def test_a_one_token_step_below_the_wider_passes_is_a_step():
    """A CPU's one-token step (matrix-vector path) under the line of the wider passes: the ar step is the
    one-token pass itself, every wider pass pays the step, and the cost model, the width policy and the
    candidate policy all see it."""
    from decode.cost import CandidatePolicy
    from decode.timing import verify_line

    measured = {1: 40.0, **{w: 52.0 + 2.0 * (w - 1) for w in (2, 4, 8, 16)}}
    assert verify_line(measured) == pytest.approx((40.0, 12.0, 2.0))
    t = times(ar_ms=40.0, per_token_ms=2.0, step_ms=12.0)
    assert t.verify_ms(1) == 40.0 and t.verify_ms(2) == 54.0 and t.verify_ms(5) == 60.0
    assert round_ms("sync", t, 5) == 60.0 + 20.0
    assert speedup_limit(t, tau=3.0, width=5) == pytest.approx(3.0 * 40.0 / 60.0)
    assert WidthPolicy.from_times(t) == WidthPolicy(slope=0.05, fixed=0.8)  # (20 + 12) / 40 per round
    policy = CandidatePolicy.from_times(t)
    assert policy.step == 0.3 and policy.round_cost(5, 1, [], []) == pytest.approx(1.0 + 0.3 + 0.05 * 4 + 0.5)
    # records measured before the step existed load with none
    assert PassTimes(**{k: v for k, v in t.to_dict().items() if k != "step_ms"}).verify_ms(5) == 48.0


@pytest.mark.measured_times
def test_drafters_measured_together_share_one_target_measurement():
    from _pairs import tiny_target
    from conftest import build_tiny_drafter
    from decode.decoders import DecodeConfig
    from decode.timing import measure_drafters
    from models.surgery import remove_layers

    target, drafter = tiny_target(), build_tiny_drafter(block_size=4)
    shallow = remove_layers(drafter, [0])
    full, pruned = measure_drafters(target, [drafter, shallow], DecodeConfig(packed_budget=16), repeats=2, context=16)
    assert (full.ar_ms, full.per_token_ms) == (pruned.ar_ms, pruned.per_token_ms)  # one target measurement
    for times in (full, pruned):
        assert times.draft_ms > 0 and times.packed_ms > 0 and 0.0 <= times.contention <= 1.0
        assert (times.draft_tokens, times.packed_tokens) == (5, 4 + 3 * 5)


def test_candidate_policy_drafts_nothing_where_the_passes_cannot_overlap():
    from decode.cost import CandidatePolicy

    values, costs = [0.3, 0.1, 0.05], [17, 17, 17]
    # Two cores, each pass saturating them: running both costs their sum, so a packed pass never pays.
    crowded = CandidatePolicy.from_times(times(packed_ms=60.0, contention=1.0, draft_tokens=17, packed_tokens=67))
    assert crowded.count(width=5, chain_tokens=5, values=values, costs=costs) == 0
    # A free overlap and a cheap pass: every candidate that raises the hit rate is worth drafting.
    roomy = CandidatePolicy.from_times(times(packed_ms=25.0, contention=0.0, draft_tokens=17, packed_tokens=67))
    assert roomy.count(width=5, chain_tokens=5, values=values, costs=costs) == 3
    # The choice is the cheapest expected round, and none is never worse than sync's verify + draft.
    for policy in (crowded, roomy):
        k = policy.count(5, 5, values, costs)
        assert policy.round_cost(5, 5, values[:k], costs[:k]) <= policy.round_cost(5, 5, [], [])


def test_packed_pass_time_is_affine_in_its_tokens_and_skipped_rounds_cost_as_sync():
    t = times(draft_ms=20.0, packed_ms=30.0, draft_tokens=17, packed_tokens=67)
    assert t.packed_ms_for(17) == 20.0 and t.packed_ms_for(67) == 30.0 and t.packed_ms_for(42) == pytest.approx(25.0)
    assert times().packed_ms_for(10) == 30.0  # token counts unknown: the measured pass
    sync = round_ms("sync", t, 5)
    assert round_ms("async", t, 5, fallback_rate=1.0, packed_share=0.0) == pytest.approx(sync)
    assert round_ms("async", t, 5, 0.0, False, packed_share=1.0, packed_tokens=42) == pytest.approx(56.0 + 25.0)


def test_a_fitted_layer_cost_reproduces_the_measured_depth_and_stays_physical():
    line = LayerCost.fit(36, 30.0, 18, 18.0)  # an ordinary pair of measurements: the line through both
    assert line.at(36) == pytest.approx(30.0) and line.at(18) == pytest.approx(18.0) and line.fixed_ms == 6.0
    # The shallow pass read under its share (noise): no negative fixed part, yet the full depth as measured.
    through_origin = LayerCost.fit(36, 27.0, 18, 12.0)
    assert through_origin.fixed_ms == 0.0 and through_origin.at(36) == pytest.approx(27.0)
    assert through_origin.at(31) == pytest.approx(27.0 * 31 / 36)
    # The shallow pass read slower than the full one: depth buys nothing, the full pass stays as measured.
    flat = LayerCost.fit(36, 27.0, 18, 28.0)
    assert flat.per_layer_ms == 0.0 and flat.at(20) == 27.0


def test_pinned_pass_times_replace_the_stopwatch(pinned_times_file):
    """With $D3D_PRUNE_PASS_TIMES set (as every test not marked measured_times has it), every measurement
    returns the pinned record's times, affine in the drafter's depth, and times nothing."""
    from _pairs import tiny_target
    from conftest import PINNED_TEST_TIMES, build_tiny_drafter
    from decode import timing
    from decode.cost import LayerCost
    from decode.decoders import DecodeConfig
    from models.draft_vocab import head_rows
    from models.surgery import remove_layers

    assert timing.pinned_times() is not None
    target, drafter = tiny_target(), build_tiny_drafter(num_hidden_layers=3, block_size=4)
    shallow = remove_layers(drafter, [0])
    full, pruned = timing.measure_drafters(target, [drafter, shallow], DecodeConfig(packed_budget=16))
    draft, packed = PINNED_TEST_TIMES["draft"], PINNED_TEST_TIMES["packed"]
    assert full.draft_ms == pytest.approx(draft["fixed_ms"] + 3 * draft["per_layer_ms"])
    assert pruned.packed_ms == pytest.approx(packed["fixed_ms"] + 2 * packed["per_layer_ms"])
    assert (full.ar_ms, full.contention, full.draft_tokens, full.packed_tokens) == (10.0, 0.25, 5, 4 + 3 * 5)
    assert timing.drafter_pass_ms(drafter, 16) == (full.draft_ms, full.packed_ms)
    rows = head_rows(drafter)  # no per_row_ms pinned: the rows cost nothing extra
    assert timing.drafter_layer_costs(drafter, 16, target=target) == (LayerCost(**draft, rows=rows),
                                                                       LayerCost(**packed, rows=rows))


@pytest.mark.measured_times
def test_pinned_pass_times_file_errors_name_the_file(tmp_path, monkeypatch):
    from decode import timing
    from models.errors import ConfigError

    assert timing.pinned_times() is None  # measured_times: nothing pinned
    file = tmp_path / "times.json"
    monkeypatch.setenv(timing.PINNED_TIMES_ENV, str(file))
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        timing.pinned_times()
    file.write_text('{"ar_ms": 10}')
    with pytest.raises(ConfigError, match=r"times.json is not a pinned pass-times record"):
        timing.pinned_times()
    file.write_text('{"ar_ms": 10, "per_token_ms": 1, "contention": 2, "draft": {"fixed_ms": 1, "per_layer_ms": 1},'
                    ' "packed": {"fixed_ms": 1, "per_layer_ms": 1}}')
    with pytest.raises(ConfigError, match="contention outside"):
        timing.pinned_times()


def test_the_head_term_prices_a_draft_vocabulary_by_its_rows():
    line = LayerCost.fit(36, 30.0, 18, 18.0).with_head(49216, 30.0, 2048, 22.0)
    per_row = 8.0 / (49216 - 2048)
    assert line.per_row_ms == pytest.approx(per_row) and line.rows == 49216
    assert line.at(36) == line.at(36, 49216) == pytest.approx(30.0)  # the measured drafter, as measured
    assert line.at(36, 2048) == pytest.approx(22.0) and line.at(30, 8192) == pytest.approx(26.0 - per_row * 41024)
    assert line.to_list() == [6.0, 2 / 3, line.per_row_ms, 49216]
    assert LayerCost(*line.to_list()) == line and LayerCost(6.0, 2 / 3).to_list() == [6.0, 2 / 3]
    # a record without the head term predicts every head at the measured one's time; a cut that read slower
    # than the whole head (noise) is no head term
    assert LayerCost(6.0, 2 / 3).at(36, 2048) == pytest.approx(30.0)
    assert LayerCost.fit(36, 30.0, 18, 18.0).with_head(49216, 30.0, 2048, 31.0).at(36, 2048) == pytest.approx(30.0)


@pytest.mark.measured_times
def test_layer_costs_are_fitted_on_depth_and_head_rows_from_probes(monkeypatch):
    """decode.timing.drafter_layer_costs on synthetic pass times: each probe's pass costs 1 + 0.5 per layer + 0.01
    per head row (the packed pass twice that); the fit recovers the line and predicts a cut, pruned drafter."""
    import torch

    from conftest import build_tiny_drafter
    from decode import timing
    from models.draft_vocab import head_rows, with_draft_vocab

    def synthetic(model, *args, **kwargs):
        draft = 1.0 + 0.5 * model.config.num_hidden_layers + 0.01 * head_rows(model)
        return draft, 2 * draft

    monkeypatch.setattr(timing, "drafter_pass_ms", synthetic)
    drafter = build_tiny_drafter(num_hidden_layers=4)
    draft, packed = timing.drafter_layer_costs(drafter, packed_budget=16)
    assert (draft.per_layer_ms, draft.per_row_ms, draft.rows) == pytest.approx((0.5, 0.01, 97))  # proposable rows
    assert packed.per_row_ms == pytest.approx(0.02)
    cut = with_draft_vocab(build_tiny_drafter(num_hidden_layers=3), torch.arange(40))
    assert draft.at(3, head_rows(cut)) == pytest.approx(synthetic(cut)[0])
    assert packed.at(3, 40) == pytest.approx(synthetic(cut)[1])
