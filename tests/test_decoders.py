"""Exactness of the sync and async decoders against ar, scheduling invariance, and the stop rule."""

from dataclasses import replace

import pytest
import torch

from _pairs import constant_pair, prompt_ids, tiny_target, trained_drafter
from conftest import build_tiny_drafter
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.verifiers import LiveVerifier


def run(decoder, drafter, target, prompt, config):
    return decode_speculative(decoder, drafter, [LiveVerifier(target, config.temperature)], [prompt], config)[0]


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 13, 40])
def test_random_drafter_matches_ar(block_size, prompt_len):
    target = tiny_target()
    drafter = build_tiny_drafter(num_hidden_layers=2, block_size=block_size, seed=block_size)
    # 29 tokens: the last round ends mid-block for every block size here.
    config = DecodeConfig(max_new_tokens=29, packed_budget=4 * (block_size + 1))
    prompt = prompt_ids(prompt_len, seed=prompt_len)
    reference = decode_ar(target, prompt, config).output_ids
    assert len(reference) == 29
    sync = run("sync", drafter, target, prompt, config)
    concurrent = run("async", drafter, target, prompt, config)
    sequential = run("async", drafter, target, prompt, replace(config, concurrent=False))
    assert sync.output_ids == reference
    assert concurrent.output_ids == reference
    assert sequential.output_ids == reference
    assert concurrent.round_trace == sequential.round_trace
    assert sum(a + 1 for a in sync.acceptance) == len(reference) - 1


@pytest.mark.parametrize("prompt_len", [1, 6, 40])
def test_trained_drafter_matches_ar_with_long_accepts(prompt_len):
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=45)
    prompt = prompt_ids(prompt_len, seed=100 + prompt_len)
    reference = decode_ar(target, prompt, config).output_ids
    sync = run("sync", drafter, target, prompt, config)
    concurrent = run("async", drafter, target, prompt, config)
    sequential = run("async", drafter, target, prompt, replace(config, concurrent=False))
    assert sync.output_ids == concurrent.output_ids == sequential.output_ids == reference
    assert concurrent.round_trace == sequential.round_trace
    # The drafter is good enough that whole blocks are accepted and candidates hit.
    assert max(concurrent.acceptance) >= 4
    assert any(hit for _, hit in concurrent.round_trace)


def test_always_right_drafter_accepts_every_block_and_always_hits():
    block = 8
    target, drafter = constant_pair(block, drafted=7, predicted=7)
    config = DecodeConfig(max_new_tokens=1 + 3 * block + 5)
    result = run("async", drafter, target, [1, 2, 3], config)
    assert result.output_ids == decode_ar(target, [1, 2, 3], config).output_ids == [7] * config.max_new_tokens
    assert result.round_trace == [(block - 1, True)] * 3 + [(4, None)]
    assert run("sync", drafter, target, [1, 2, 3], config).acceptance == [block - 1] * 3 + [4]


def test_always_wrong_drafter_accepts_nothing():
    target, drafter = constant_pair(4, drafted=9, predicted=7)
    config = DecodeConfig(max_new_tokens=12)
    for decoder in ("sync", "async"):
        result = run(decoder, drafter, target, [5], config)
        assert result.output_ids == [7] * 12
        assert result.acceptance == [0] * 11


def test_stop_token_inside_an_accepted_block_ends_output_there():
    target, drafter = trained_drafter()
    prompt = prompt_ids(6, seed=106)
    free = run("async", drafter, target, prompt, DecodeConfig(max_new_tokens=45))
    # Output positions that were accepted drafts (not bonus tokens), excluding the prefill token.
    drafted_positions, position = [], 1
    for a in free.acceptance:
        drafted_positions += range(position, position + a)
        position += a + 1
    first_seen = {}
    for j, token in enumerate(free.output_ids):
        first_seen.setdefault(token, j)
    stop_token, stop_at = next(
        (token, j) for token, j in first_seen.items() if j in drafted_positions and j + 1 in drafted_positions
    )
    config = DecodeConfig(max_new_tokens=45, stop_ids=(stop_token,))
    reference = decode_ar(target, prompt, config).output_ids
    assert reference == free.output_ids[: stop_at + 1]
    for decoder in ("sync", "async"):
        result = run(decoder, drafter, target, prompt, config)
        assert result.output_ids == reference
        assert sum(a + 1 for a in result.acceptance) == len(reference) - 1


def test_stop_at_first_token_and_max_new_tokens_one():
    target, drafter = trained_drafter()
    prompt = prompt_ids(5, seed=3)
    first = decode_ar(target, prompt, DecodeConfig(max_new_tokens=1)).output_ids
    assert len(first) == 1
    for config in (DecodeConfig(max_new_tokens=1), DecodeConfig(max_new_tokens=30, stop_ids=(first[0],))):
        for decoder in ("sync", "async"):
            result = run(decoder, drafter, target, prompt, config)
            assert result.output_ids == first
            assert result.rounds == []


def test_smaller_verify_block_than_drafter_block_is_exact():
    target, drafter = trained_drafter()
    prompt = prompt_ids(9, seed=9)
    config = DecodeConfig(max_new_tokens=33, block_size=5)
    reference = decode_ar(target, prompt, config).output_ids
    for decoder in ("sync", "async"):
        result = run(decoder, drafter, target, prompt, config)
        assert result.output_ids == reference
        assert max(result.acceptance) <= 4


@pytest.mark.parametrize("rows, vocab, k", [(16, 49216, 5), (3, 640, 5), (2, 128, 2), (5, 100, 3), (4, 192, 4)])
def test_top_k_through_group_maxima_equals_torch_topk(rows, vocab, k):
    """decode.engine.top_k: the top k from the k best of 64 interleaved groups (vocabularies that split
    evenly into them) or torch.topk (others, and too few columns): the same values and, without ties, the
    same indices, masked (-inf) entries and a top k crowded into one group included."""
    from decode.engine import top_k

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[:, ::7] = float("-inf")
    logits[0, : 5 * (vocab // 64): vocab // 64] = 50.0 + torch.arange(len(range(0, 5 * (vocab // 64), vocab // 64)))
    values, indices = top_k(logits, k)
    want_values, want_indices = logits.topk(k, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
