"""Layer scoring: replay equals live, the reported delta is the real effect, intervals are sane."""

import pytest

from _pairs import prompt_ids, trained_drafter
from decode.decoders import DecodeConfig
from models.surgery import remove_layers
from prune.scoring import ScoreConfig, evaluate, record_trajectories, score_layers


@pytest.fixture(scope="module")
def setup():
    target, drafter = trained_drafter(num_layers=3)
    prompts = [prompt_ids(n, seed=n) for n in (2, 5, 9, 14)]
    decode = DecodeConfig(max_new_tokens=30, packed_budget=27)
    return target, drafter, prompts, decode


def test_replay_scores_equal_live_scores(setup):
    target, drafter, prompts, decode = setup
    replay = score_layers(drafter, prompts, ScoreConfig(decode=decode, timing_repeats=1), target=target)
    live = score_layers(drafter, prompts, ScoreConfig(decode=decode, verify="live", timing_repeats=1), target=target)
    assert [s.delta_tau for s in replay.layers] == [s.delta_tau for s in live.layers]
    assert replay.base.tau_per_prompt == live.base.tau_per_prompt
    assert [s.layer for s in replay.ranking()] == [s.layer for s in live.ranking()]


def test_removing_the_top_layer_changes_tau_by_its_delta(setup):
    target, drafter, prompts, decode = setup
    config = ScoreConfig(decode=decode, timing_repeats=1)
    trajectories = record_trajectories(target, prompts, decode)
    report = score_layers(drafter, prompts, config, trajectories=trajectories)
    top = max(report.layers, key=lambda s: s.delta_tau)
    assert top.delta_tau > 0  # the trained drafter needs its layers
    without = evaluate(remove_layers(drafter, [top.layer]), prompts, config, trajectories)
    assert report.base.tau - without.tau == pytest.approx(top.delta_tau)
    for score in report.layers:
        assert score.ci_low <= score.delta_tau <= score.ci_high
        assert score.original_layer == score.layer and score.predicted_speedup is None


def test_batched_replay_scoring_equals_unbatched(setup):
    target, drafter, prompts, decode = setup
    trajectories = record_trajectories(target, prompts, decode)
    one = score_layers(drafter, prompts, ScoreConfig(decode=decode, batch_size=1, timing_repeats=1),
                       trajectories=trajectories)
    many = score_layers(drafter, prompts, ScoreConfig(decode=decode, batch_size=4, timing_repeats=1),
                        trajectories=trajectories)
    assert [s.delta_tau for s in one.layers] == [s.delta_tau for s in many.layers]


def test_speedup_criterion_and_original_indices_after_pruning(setup):
    target, drafter, prompts, decode = setup
    pruned = remove_layers(drafter, [0])
    report = score_layers(pruned, prompts, ScoreConfig(decode=decode, criterion="speedup", timing_repeats=1),
                          target=target)
    assert [s.original_layer for s in report.layers] == [1, 2]
    assert report.base_predicted_speedup is not None and report.target_verify_ms > 0
    for score in report.layers:
        assert score.score == pytest.approx(report.base_predicted_speedup - score.predicted_speedup)
