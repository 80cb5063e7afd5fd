"""Layer scoring: replay equals live, the reported delta is the real effect, intervals are sane."""

import math

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


def test_screening_scores_the_lowest_layers_of_its_first_pass_on_every_prompt(setup):
    target, drafter, prompts, decode = setup  # 3 layers, 4 prompts
    trajectories = record_trajectories(target, prompts, decode)

    def scored(prompt_count, **screen):
        config = ScoreConfig(decode=decode, timing_repeats=1, **screen)
        return score_layers(drafter, prompts[:prompt_count], config, trajectories=trajectories[:prompt_count])

    full, first = scored(4, screen_prompts=0), scored(2, screen_prompts=0)
    screened = scored(4, screen_prompts=2, screen_keep=2)
    kept = {s.layer for s in sorted(first.layers, key=lambda s: (s.score, s.layer))[:2]}
    assert screened.base.tau_per_prompt == full.base.tau_per_prompt
    assert screened.settings["screen_prompts"] == 2 and screened.settings["screen_keep"] == 2
    for score, whole, half in zip(screened.layers, full.layers, first.layers):
        if score.layer in kept:  # the first pass's evaluation and the rest's pooled: the whole round's numbers
            assert score.prompts == 4
            for field in ("tau_without", "delta_tau", "score", "fallback_rate", "verify_width", "packed_share",
                          "packed_tokens", "ci_low", "ci_high"):
                assert getattr(score, field) == pytest.approx(getattr(whole, field)), field
        else:
            assert score.prompts == 2 and score.score == half.score and score.delta_tau == half.delta_tau
    assert {s.layer for s in screened.ranking()[:2]} == kept  # layers scored on every prompt rank first
    assert all(s.prompts == 4 for s in full.layers)
    assert scored(2, screen_prompts=2).settings["screen_prompts"] == 0  # as many prompts as the screen: none


def test_a_screening_round_resumes_from_its_journal(setup, tmp_path, monkeypatch):
    import prune.scoring as scoring
    from decode.cost import LayerCost
    from prune.journal import ScoringJournal

    target, drafter, prompts, decode = setup
    trajectories = record_trajectories(target, prompts, decode)
    config = ScoreConfig(decode=decode, timing_repeats=1, screen_prompts=2, screen_keep=2)
    costs = (LayerCost(1.0, 2.0), LayerCost(1.0, 3.0))  # modelled pass times: nothing timed, nothing noisy
    whole = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs).to_dict()
    real_evaluate = scoring.evaluate
    # Killed after two of the first pass's three evaluations, or after the first of the second pass's two.
    for kill_at, evaluations_left in ((2, 1 + 2), (4, 1)):
        calls, evaluated, file = [], [], tmp_path / f"journal-{kill_at}.json"

        def killed(name):
            calls.append(name)
            if len(calls) == kill_at:
                raise KeyboardInterrupt

        monkeypatch.setattr(scoring, "fault_point", killed)
        with pytest.raises(KeyboardInterrupt):
            score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs,
                         journal=ScoringJournal(file, "key"))
        monkeypatch.setattr(scoring, "fault_point", lambda name: None)
        monkeypatch.setattr(scoring, "evaluate", lambda *a, **k: evaluated.append(1) or real_evaluate(*a, **k))
        progress = []
        resumed = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs,
                               journal=ScoringJournal(file, "key"), on_layer=lambda *_: progress.append(1))
        monkeypatch.setattr(scoring, "evaluate", real_evaluate)
        assert resumed.to_dict() == whole and len(evaluated) == evaluations_left
        assert len(progress) == scoring.round_evaluations(config, 3, 4)  # restored evaluations count as done


def test_a_round_screens_by_carried_scores_while_its_candidates_stay_below_the_rest(setup, tmp_path, monkeypatch):
    """A campaign's later round: the carried ranking's lowest layers are scored on every prompt; the others keep
    their carried scores only while the candidates still score below them, else they are screened afresh."""
    from dataclasses import replace

    import prune.scoring as scoring
    from decode.cost import LayerCost
    from prune.journal import ScoringJournal

    target, drafter, prompts, decode = setup  # 3 layers, 4 prompts
    trajectories = record_trajectories(target, prompts, decode)
    config = ScoreConfig(decode=decode, timing_repeats=1, screen_prompts=2, screen_keep=2)
    costs = (LayerCost(1.0, 2.0), LayerCost(1.0, 3.0))
    full = score_layers(drafter, prompts, replace(config, screen_prompts=0), trajectories=trajectories,
                        layer_costs=costs)
    half = score_layers(drafter, prompts[:2], replace(config, screen_prompts=0), trajectories=trajectories[:2],
                        layer_costs=costs)

    def carried(*values):  # a previous round's scores of layers 0, 1, 2
        return [replace(s, score=v, age=1) for s, v in zip(full.layers, values)]

    totals = []  # what the round reports through on_total when its plan changes

    def scored(previous, journal=None):
        calls = []
        totals.clear()
        report = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs,
                              carried=previous, journal=journal, on_layer=lambda *_: calls.append(1),
                              on_total=totals.append)
        return report, len(calls)

    # Layer 1 carried far above the others: only layers 0 and 2 are evaluated, layer 1 keeps its old score.
    trusted, calls = scored(carried(0.0, 9.0, 0.1))
    assert calls == scoring.round_evaluations(config, 3, 4, carried=True) == 2 and totals == []
    assert trusted.layers[1] == carried(0.0, 9.0, 0.1)[1]
    for layer in (0, 2):
        fresh, whole = trusted.layers[layer], full.layers[layer]
        assert fresh.age is None and fresh.prompts == 4 and fresh.score == pytest.approx(whole.score)
    assert [s.layer for s in trusted.ranking()][2] == 1  # carried scores rank after this round's
    assert trusted.base.tau_per_prompt == full.base.tau_per_prompt

    # Layer 2 carried below anything the candidates 0 and 1 score now: it gets a first pass, and the kept two of
    # all three are scored on every prompt, as in a round without carried scores.
    distrusted, calls = scored(carried(-9.0, -9.0, -8.0))
    kept_all = distrusted.layers[2].prompts == 4
    assert all(s.age is None for s in distrusted.layers) and calls == 2 + 1 + kept_all
    assert totals == [2 + 1 + 1, calls]  # at most one more second pass, then the exact count
    ranked = sorted([(full.layers[0].score, 0), (full.layers[1].score, 1), (half.layers[2].score, 2)])
    assert kept_all == (2 in {layer for _, layer in ranked[:2]})
    expected = full.layers[2] if kept_all else half.layers[2]
    assert distrusted.layers[2].score == pytest.approx(expected.score)

    # A carried round killed after its first evaluation resumes from its journal to the same report.
    def killed(name):
        raise KeyboardInterrupt

    journal = tmp_path / "journal.json"
    monkeypatch.setattr(scoring, "fault_point", killed)
    with pytest.raises(KeyboardInterrupt):
        scored(carried(0.0, 9.0, 0.1), ScoringJournal(journal, "key"))
    monkeypatch.setattr(scoring, "fault_point", lambda name: None)
    assert len(ScoringJournal(journal, "key").layers) == 1
    resumed, calls = scored(carried(0.0, 9.0, 0.1), ScoringJournal(journal, "key"))
    assert resumed.to_dict() == trusted.to_dict() and calls == 2


def test_a_step_never_removes_more_layers_than_screening_scores_on_every_prompt():
    from models.errors import ConfigError
    from prune.config import RunConfig

    RunConfig(per_step=12).validate(36)
    with pytest.raises(ConfigError, match="raise --screen-keep or pass --screen-prompts 0"):
        RunConfig(per_step=13).validate(36)
    RunConfig(per_step=13, score=ScoreConfig(screen_prompts=0)).validate(36)


def test_the_score_table_lists_layers_scored_on_every_prompt_first(setup, capsys):
    from prune.commands.score import print_table

    target, drafter, prompts, decode = setup
    config = ScoreConfig(decode=decode, timing_repeats=1, screen_prompts=2, screen_keep=1)
    report = score_layers(drafter, prompts, config, trajectories=record_trajectories(target, prompts, decode))
    print_table(report.to_dict())
    out = capsys.readouterr().out
    assert "screened on the first 2, 1 layers on all" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [int(row[0]) for row in rows] == [s.layer for s in report.ranking()]
    assert [int(row[5]) for row in rows] == [4, 2, 2]  # the kept layer on all 4 prompts, the others on 2


def test_expected_acceptance_is_one_plus_the_running_products_of_the_target_tokens_probabilities():
    import torch
    from conftest import build_tiny_drafter
    from models.inference import masked_logits
    from prune.training.loss import Example, build_batch, expected_acceptance

    drafter = build_tiny_drafter(block_size=4)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()  # every id inference can propose is equally likely
    allowed = torch.isfinite(masked_logits(drafter, torch.zeros(1, drafter.config.hidden_size))).sum().item()
    u = 1.0 / allowed
    example = Example.from_prompt_response([5, 6, 7], [8, 9, 10, 11, 12, 13])  # response at positions 3..8
    anchors = [3, 4, 5, 6, 7]  # a round can start where this token and the next are response tokens
    batch = build_batch([example], 4, drafter.config.mask_token_id, 0, anchors=[anchors])
    # 3 draft slots per block of 4; the blocks at 6 and 7 run past the end after 2 and 1 slots.
    full, two, one = 1 + u + u ** 2 + u ** 3, 1 + u + u ** 2, 1 + u
    assert expected_acceptance(drafter, batch).tolist() == pytest.approx([full, full, full, two, one])


def test_expected_tau_criterion_scores_the_drop_in_expected_acceptance(setup):
    target, drafter, prompts, decode = setup
    config = ScoreConfig(decode=decode, criterion="expected-tau", timing_repeats=1)
    report = score_layers(drafter, prompts, config, target=target)
    block = drafter.config.block_size
    assert len(report.base.expected_tau_per_prompt) == len(prompts)
    assert all(1.0 <= value <= block for value in report.base.expected_tau_per_prompt)
    for score in report.layers:
        assert score.score == pytest.approx(report.base.expected_tau - score.expected_tau_without)
    assert max(score.score for score in report.layers) > 0  # the trained drafter needs its layers
    # Live verification records the trajectories it needs, and reads the same expectations.
    live = score_layers(drafter, prompts, ScoreConfig(decode=decode, criterion="expected-tau", verify="live",
                                                      timing_repeats=1), target=target)
    assert [s.score for s in live.layers] == pytest.approx([s.score for s in report.layers])
    # A screening round pools its two passes' expectations as one pass over every prompt.
    screened = score_layers(drafter, prompts, ScoreConfig(decode=decode, criterion="expected-tau", timing_repeats=1,
                                                          screen_prompts=2, screen_keep=3), target=target)
    assert screened.base.expected_tau_per_prompt == pytest.approx(report.base.expected_tau_per_prompt)
    # The decoder-only criteria do not pay for it.
    assert score_layers(drafter, prompts, ScoreConfig(decode=decode, timing_repeats=1),
                        target=target).base.expected_tau is None


def test_the_optimism_of_the_best_of_several_reads_and_the_error_of_a_paired_retention():
    import random
    import statistics

    from prune.scoring import expected_best_of, retention_error

    # E[max of n standard normals]: 0, 1/sqrt(pi), 3/(2 sqrt(pi)) in closed form for 1, 2, 3; grows with n
    assert expected_best_of(1) == 0.0 and expected_best_of(0) == 0.0
    assert expected_best_of(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_best_of(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert expected_best_of(2) < expected_best_of(4) < expected_best_of(8) < 3

    # a candidate that keeps a fixed share of every prompt's tau has no error; one prompt has none to measure
    assert retention_error([2.0, 3.0, 4.0], [2.5, 3.75, 5.0]) == pytest.approx(0.0, abs=1e-12)
    assert retention_error([2.0], [3.0]) == 0.0
    # noise around a fixed share: the error matches the spread of the retention over fresh prompt sets
    rng = random.Random(0)

    def prompts(n):
        base = [rng.uniform(1.5, 4.5) for _ in range(n)]
        return [b * 0.97 + rng.gauss(0, 0.2) for b in base], base

    spread = statistics.stdev(sum(c) / sum(b) for c, b in (prompts(16) for _ in range(4000)))
    errors = [retention_error(*prompts(16)) for _ in range(400)]
    assert statistics.mean(errors) == pytest.approx(spread, rel=0.1)
