"""Exactness on every available device: CPU always, CUDA where torch sees a GPU (skipped otherwise).

On CUDA the checks run in float32 with TF32 off, where greedy decoding is exact up to near-ties that the
kernels of a 1-token and a W-token pass may round differently; the tiny random models here have none.
"""

import pytest
import torch

from _pairs import prompt_ids, trained_drafter
from decode.cost import WidthPolicy
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.engine import DraftEngine, DraftRequest
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.masks import BlockSpec

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]


@pytest.fixture
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def on(device, *models):
    return [model.to(device) for model in models]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width_policy", [None, WidthPolicy(0.08, 0.5)], ids=["fixed", "adaptive"])
def test_sync_and_async_equal_ar_and_replay_equals_live(device, width_policy, no_tf32):
    target, drafter = on(device, *trained_drafter())
    config = DecodeConfig(max_new_tokens=37, width_policy=width_policy)
    for seed in range(2):
        prompt = prompt_ids(5 + 20 * seed, seed=400 + seed)
        reference = decode_ar(target, prompt, config).output_ids
        for decoder in ("sync", "async"):
            live = decode_speculative(decoder, drafter, [LiveVerifier(target)], [prompt], config)[0]
            assert live.output_ids == reference, decoder
        replayed = decode_speculative("async", drafter, [ReplayVerifier(prompt + reference)], [prompt], config)[0]
        assert replayed.round_trace == live.round_trace


@CUDA
def test_drafter_stream_sees_weights_written_just_before_on_the_default_stream(no_tf32):
    """The default stream is kept busy, then a weight is zeroed on it; the next drafter pass (on its own
    stream) must see the zeroed weight, not the old one."""
    _, drafter = on("cuda", *trained_drafter())
    engine = DraftEngine(drafter)
    request = DraftRequest(prompt_ids(6, seed=1), [BlockSpec(5)])
    before = engine.forward([request])[0][0]
    engine.keep([0])
    with torch.inference_mode():
        torch.cuda._sleep(200_000_000)  # about 0.1 s of work queued ahead of the weight update
        drafter.lm_head.weight.mul_(0.0)
    after = engine.forward([request])[0][0]
    assert before.probs != after.probs
    # Zero logits over the proposable ids: a uniform distribution (the mask id and padding rows are -inf).
    assert max(after.probs) == pytest.approx(1.0 / drafter.config.draft_vocab_size, rel=1e-3)
