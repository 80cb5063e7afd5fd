"""Speculative sampling: sync and async continuations are distributed exactly as the target's own.

A tiny target over 4 tokens; the joint law of 3 generated tokens (64 outcomes) is computed exactly from
the target, and 1500 seeded draws per decoder are compared with it by a chi-square test, with the drafter
proposing from its whole vocabulary and from a draft vocabulary of two of the four tokens. A broken
acceptance rule (accept every draft) must fail the same test, so the threshold has teeth.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

import decode.decoders as decoders
from decode.decoders import DecodeConfig, decode_speculative
from decode.verifiers import LiveVerifier
from models.draft_vocab import with_draft_vocab
from models.drafter import create_drafter

VOCAB, DRAWS, NEW_TOKENS, PROMPT = 4, 1500, 3, [1, 3]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(3)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=8)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharpen: a far-from-uniform law makes the test discriminating
    drafter = create_drafter(vocab_size=VOCAB + 1, mask_token_id=VOCAB, draft_vocab_size=VOCAB, block_size=4,
                             num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, seed=5)
    return target, drafter


def exact_law(target) -> dict[tuple, float]:
    law = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            logits = target(torch.tensor([PROMPT + list(seq)])).logits[0].float()
            probs = torch.softmax(logits, -1)
            p = 1.0
            for i, token in enumerate(seq):
                p *= probs[len(PROMPT) - 1 + i, token].item()
            law[seq] = p
    return law


def p_value(target, drafter, decoder) -> float:
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=NEW_TOKENS), 0)
    for seed in range(DRAWS):
        config = DecodeConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
        out = decode_speculative(decoder, drafter, [LiveVerifier(target, 1.0)], [PROMPT], config)[0]
        counts[tuple(out.output_ids)] += 1
    law = exact_law(target)
    keys = [k for k in counts if law[k] * DRAWS >= 1]  # pool negligible cells into one
    observed = [counts[k] for k in keys] + [DRAWS - sum(counts[k] for k in keys)]
    expected = [law[k] * DRAWS for k in keys]
    expected.append(DRAWS - sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("decoder", ["sync", "async"])
@pytest.mark.parametrize("vocab", [None, [2, 0]])
def test_speculative_sampling_matches_target_law(pair, decoder, vocab):
    target, drafter = pair
    assert p_value(target, drafter if vocab is None else with_draft_vocab(drafter, torch.tensor(vocab)), decoder) > 1e-3


def test_broken_acceptance_rule_is_detected(pair, monkeypatch):
    def accept_everything(drafts, probs, generator):
        return len(drafts), decoders.sample_token(probs[len(drafts)], generator)

    monkeypatch.setattr(decoders, "sampled_outcome", accept_everything)
    assert p_value(*pair, "sync") < 1e-6
