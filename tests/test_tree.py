"""Draft trees: how a tree is grown and walked, its mask, and that tree verification stays exact."""

import random
from dataclasses import replace

import pytest
import torch

from _pairs import prompt_ids, replays_in_a_batch_and_alone, tiny_target, trained_drafter
from decode import cost
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.tree import greedy_path, grow
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.masks import tree_mask

POLICY = cost.WidthPolicy(slope=0.05, fixed=0.8)
FREE_WIDTH = cost.WidthPolicy(slope=0.0, fixed=1.0)  # every node pays: trees as wide as allowed


def _slots(rng: random.Random, count: int):
    drafts = [rng.randrange(100, 200) for _ in range(count)]
    confidences = [rng.uniform(0.2, 0.95) for _ in range(count)]
    alternatives = [[(300 + 10 * d + k, (1 - c) * 0.5 ** (k + 1)) for k in range(3)]
                    for d, c in enumerate(confidences)]
    return drafts, confidences, alternatives


def test_a_tree_without_branches_is_the_chain_the_width_policy_chooses():
    rng = random.Random(0)
    for _ in range(50):
        drafts, confidences, alternatives = _slots(rng, 7)
        tree = grow(5, drafts, confidences, alternatives, branches=0, max_nodes=7, policy=POLICY)
        width = POLICY.choose(confidences, 8)
        assert tree.tokens == [5] + drafts[: width - 1]
        assert tree.parents == list(range(-1, width - 1)) and tree.is_chain


def test_a_tree_feeds_its_main_chain_first_and_every_parent_before_its_children():
    rng = random.Random(1)
    wide = 0
    for _ in range(50):
        drafts, confidences, alternatives = _slots(rng, 7)
        tree = grow(5, drafts, confidences, alternatives, branches=2, max_nodes=7, policy=POLICY)
        assert len(tree.tokens) <= 8 and tree.parents[0] == -1
        assert all(0 <= parent < i for i, parent in enumerate(tree.parents) if i)
        assert tree.tokens[: tree.chain] == [5] + drafts[: tree.chain - 1]
        assert tree.parents[: tree.chain] == list(range(-1, tree.chain - 1))
        # siblings differ (a walk has at most one child to follow)
        siblings = [(parent, token) for parent, token in zip(tree.parents, tree.tokens)]
        assert len(set(siblings)) == len(siblings)
        wide += not tree.is_chain
    assert wide > 10  # next-best ids were taken where they pay
    drafts, confidences, alternatives = _slots(rng, 7)
    full = grow(5, drafts, confidences, alternatives, branches=2, max_nodes=7, policy=None)
    assert len(full.tokens) == 8  # no policy: as many nodes as allowed


def test_the_walk_follows_the_targets_choices_through_the_tree():
    # t -> a (1) -> c (3); t -> b (2) -> d (4)
    tokens, parents = [9, 11, 12, 13, 14], [-1, 0, 0, 1, 2]
    assert greedy_path(tokens, parents, [12, -1, 14, -1, 77]) == ([2, 4], 77)  # off the main chain, to a leaf
    assert greedy_path(tokens, parents, [11, 13, -1, 55, -1]) == ([1, 3], 55)
    assert greedy_path(tokens, parents, [50, -1, -1, -1, -1]) == ([], 50)


def test_the_tree_mask_shows_each_token_its_ancestors_and_a_chain_is_causal():
    mask = tree_mask([-1, 0, 0, 1, 2], 3, torch.float32, "cpu")[0, 0]
    visible = (mask == 0).int().tolist()
    assert visible == [[1, 1, 1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 0, 1, 0, 0],
                       [1, 1, 1, 1, 1, 0, 1, 0],
                       [1, 1, 1, 1, 0, 1, 0, 1]]
    chain = tree_mask([-1, 0, 1, 2], 2, torch.float32, "cpu")[0, 0] == 0
    assert torch.equal(chain, torch.ones(4, 6, dtype=torch.bool).tril(2))


@pytest.mark.parametrize("lean", [True, False])
def test_a_tree_verify_answers_as_the_chain_of_each_path_and_keeps_the_accepted_paths_cache(lean):
    target = tiny_target()
    prompt = prompt_ids(9, seed=3)
    tree = [prompt[-1], 21, 22, 23, 24, 25]
    parents = [-1, 0, 0, 1, 2, 4]  # paths t-21-23 and t-22-24-25
    live = LiveVerifier(target, lean=lean)
    live.prefill(prompt)
    answers = live.verify(tree, parents).tokens
    for path in ([0, 1, 3], [0, 2, 4, 5]):
        chain = LiveVerifier(target, lean=lean)
        chain.prefill(prompt)
        assert chain.verify([tree[i] for i in path]).tokens == [answers[i] for i in path]
    # Commit t-22-24 and go on: the moved cache slots answer as a chain verifier that fed only the path.
    live.commit(len(prompt) + 2, [0, 2, 4])
    reference = LiveVerifier(target, lean=lean)
    reference.prefill(prompt)
    reference.verify([tree[0], 22, 24])
    reference.commit(len(prompt) + 2)
    for step in ([31, 32, 33], [34], [35, 36]):
        assert live.verify(step).tokens == reference.verify(step).tokens
        live.commit(live.length)
        reference.commit(reference.length)


def test_a_replayed_tree_answers_on_the_trajectory_and_nowhere_else():
    trajectory = [1, 2, 3, 4, 5, 6]
    replay = ReplayVerifier(trajectory)
    assert replay.prefill([1, 2]).tokens == [3]
    replay.commit(2)  # t = 3 at position 2
    out = replay.verify([3, 4, 9, 5, 8], [-1, 0, 0, 1, 1])  # 4 (on the trajectory) and 9 (off), 5 and 8 under 4
    assert out.tokens == [4, 5, -1, 6, -1]


class _Recording(LiveVerifier):
    """A live verifier that counts the trees it verified and the commits that kept a node off the main chain."""

    trees = off_chain = 0

    def verify(self, tokens, parents=None):
        _Recording.trees += parents is not None
        return super().verify(tokens, parents)

    def commit(self, length, kept=None):
        _Recording.off_chain += kept is not None and kept != list(range(len(kept)))
        super().commit(length, kept)


@pytest.mark.parametrize("decoder,concurrent", [("sync", True), ("async", True), ("async", False)])
def test_tree_decoding_equals_ar_and_replay_makes_the_live_decisions(decoder, concurrent):
    target, drafter = trained_drafter(steps=40)  # an imperfect drafter: its next-best ids matter
    config = DecodeConfig(max_new_tokens=40, width_policy=POLICY, tree_branches=3, concurrent=concurrent)
    _Recording.trees = _Recording.off_chain = 0
    for prompt in [prompt_ids(n, seed=60 + n) for n in (3, 8, 12)]:
        ar = decode_ar(target, prompt, config).output_ids
        live = decode_speculative(decoder, drafter, [_Recording(target)], [prompt], config)[0]
        replayed = decode_speculative(decoder, drafter, [ReplayVerifier(prompt + ar)], [prompt], config)[0]
        assert live.output_ids == ar == replayed.output_ids
        assert live.round_trace == replayed.round_trace and live.widths == replayed.widths
    assert _Recording.trees > 0 and _Recording.off_chain > 0  # trees were verified and left their main chains


def test_tree_rows_in_a_replayed_batch_decide_as_each_prompt_alone():
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=32, width_policy=FREE_WIDTH, tree_branches=3)
    prompts = [prompt_ids(n, seed=70 + n) for n in (2, 6, 10)]
    for _, batched, singles in replays_in_a_batch_and_alone(target, drafter, prompts, config):
        assert [r.round_trace for r in batched] == [r.round_trace for r in singles]


def test_sampling_verifies_chains():
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=16, width_policy=FREE_WIDTH, tree_branches=2, temperature=0.8, seed=3)
    chains = replace(config, tree_branches=0)
    prompt = prompt_ids(5, seed=9)
    sampled = decode_speculative("sync", drafter, [LiveVerifier(target, 0.8)], [prompt], config)[0]
    reference = decode_speculative("sync", drafter, [LiveVerifier(target, 0.8)], [prompt], chains)[0]
    assert sampled.output_ids == reference.output_ids and sampled.widths == reference.widths
