"""Replay verification reproduces the live decoder exactly, one prompt at a time and batched."""

import pytest
import torch

from _pairs import trained_drafter
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.verifiers import LiveVerifier, ReplayVerifier

PROMPT_LENGTHS = (1, 4, 9, 17, 30)


def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def setup():
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=37, stop_ids=(11,))
    trajectories = [p + decode_ar(target, p, config).output_ids for p in prompts()]
    return target, drafter, config, trajectories


@pytest.mark.parametrize("decoder", ["sync", "async"])
def test_replay_reproduces_live_round_trace(setup, decoder):
    target, drafter, config, trajectories = setup
    for prompt, trajectory in zip(prompts(), trajectories):
        live = decode_speculative(decoder, drafter, [LiveVerifier(target)], [prompt], config)[0]
        replay = decode_speculative(decoder, drafter, [ReplayVerifier(trajectory)], [prompt], config)[0]
        assert replay.output_ids == live.output_ids == trajectory[len(prompt):]
        assert replay.round_trace == live.round_trace


@pytest.mark.parametrize("decoder", ["sync", "async"])
def test_batched_replay_equals_one_prompt_at_a_time(setup, decoder):
    _, drafter, config, trajectories = setup
    singles = [
        decode_speculative(decoder, drafter, [ReplayVerifier(t)], [p], config)[0]
        for p, t in zip(prompts(), trajectories)
    ]
    batched = decode_speculative(decoder, drafter, [ReplayVerifier(t) for t in trajectories], prompts(), config)
    assert [r.round_trace for r in batched] == [r.round_trace for r in singles]
    assert [r.output_ids for r in batched] == [r.output_ids for r in singles]
    assert any(a > 0 for r in singles for a in r.acceptance)


def test_replay_rejects_a_foreign_prompt(setup):
    _, drafter, config, trajectories = setup
    from models.errors import DataError

    with pytest.raises(DataError, match="does not start with this prompt"):
        decode_speculative("sync", drafter, [ReplayVerifier(trajectories[0])], [[1, 2, 3, 4, 5, 6]], config)


def test_replay_with_a_longer_budget_than_recorded_is_refused(setup):
    from dataclasses import replace

    from models.errors import DataError

    _, drafter, config, trajectories = setup
    longer = replace(config, max_new_tokens=config.max_new_tokens + 20, stop_ids=())
    prompt = prompts()[0]
    with pytest.raises(DataError, match="ended before the stop rule"):
        decode_speculative("async", drafter, [ReplayVerifier(trajectories[0])], [prompt], longer)


def test_an_output_recorded_under_a_larger_cap_replays_as_the_smaller_caps_greedy_output(setup):
    """StopRule.replayed: the target's output recorded with one cap (or by an engine that did not stop at the
    target's stop ids) is, cut by another stop rule, exactly what ar decodes under that rule; one that ends
    short of the cap at a token that is no stop id cannot stand in for it."""
    from dataclasses import replace

    target, _, config, _ = setup
    free = replace(config, max_new_tokens=37, stop_ids=())
    for prompt in prompts():
        recorded = decode_ar(target, prompt, free).output_ids  # 37 tokens, through any stop id
        for cap, stops in ((37, ()), (9, ()), (37, (11,)), (9, (11,)), (37, tuple(recorded[3:4]))):
            rule = replace(config, max_new_tokens=cap, stop_ids=stops)
            assert rule.stop_rule.replayed(recorded) == decode_ar(target, prompt, rule).output_ids
        shorter = replace(config, max_new_tokens=38, stop_ids=())
        assert shorter.stop_rule.replayed(recorded) is None  # recorded with a smaller cap
        assert replace(config, max_new_tokens=5).stop_rule.replayed([]) is None


def test_lookahead_keeps_every_round_and_feeds_less(setup, monkeypatch):
    """Replay's lookahead (verify first, compute only the usable candidates) changes cost, not results."""
    from dataclasses import replace

    from decode.engine import DraftEngine

    _, drafter, config, trajectories = setup
    fed = []
    forward = DraftEngine.forward

    def counting_forward(self, requests):
        fed.append(sum(len(r.chain) + sum(drafter.config.block_size for _ in r.blocks) for r in requests if r))
        return forward(self, requests)

    monkeypatch.setattr(DraftEngine, "forward", counting_forward)
    runs = {}
    for lookahead in (True, False):
        fed.clear()
        verifiers = [ReplayVerifier(t) for t in trajectories]
        runs[lookahead] = (decode_speculative("async", drafter, verifiers, prompts(), replace(config, lookahead=lookahead)),
                           sum(fed))
    (ahead, ahead_fed), (full, full_fed) = runs[True], runs[False]
    assert [r.round_trace for r in ahead] == [r.round_trace for r in full]
    assert [r.output_ids for r in ahead] == [r.output_ids for r in full]
    assert [[x.packed_tokens for x in r.rounds] for r in ahead] == [[x.packed_tokens for x in r.rounds] for r in full]
    assert any(hit for r in ahead for _, hit in r.round_trace)
    assert ahead_fed < full_fed / 2
