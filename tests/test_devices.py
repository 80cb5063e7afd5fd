"""The decoders on every available device: CPU always, CUDA where torch sees a GPU (skipped otherwise).

Exactness of sync/async against ar and of replay against live; the drafter stream's ordering against
weight changes queued on the default stream just before a pass (a weight edit, a layer removal, an
optimizer step, a LoRA merge); the ordering rules themselves with a stand-in stream API (on any machine);
the CUDA pass's staged inputs against host-built ones; sampling with probabilities left on the device;
pass timing (CUDA events on CUDA). On CUDA the checks run in float32 with TF32 off, where greedy decoding
is exact up to near-ties that the kernels of a 1-token and a W-token pass may round differently; the tiny
random models here have none.
"""

import copy

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
    """Copies of `models` on `device` (moving the shared trained pair itself would move it for later tests)."""
    return [copy.deepcopy(model).to(device) for model in models]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width_policy,tree_branches", [(None, 0), (WidthPolicy(0.08, 0.5), 0),
                                                        (WidthPolicy(0.02, 0.5), 2)], ids=["fixed", "adaptive", "tree"])
def test_sync_and_async_equal_ar_and_replay_equals_live(device, width_policy, tree_branches, no_tf32):
    target, drafter = on(device, *trained_drafter())
    config = DecodeConfig(max_new_tokens=37, width_policy=width_policy, tree_branches=tree_branches)
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


# ------------------------------------------------------------------------------------------------------
# Weight changes on the caller's stream right before a drafter pass, as the pruner makes them: the pass
# right after each one must equal the same pass made once the device is idle. The default stream is kept
# busy first, so without the drafter stream's wait the pass would read the weights before the change.
# ------------------------------------------------------------------------------------------------------

BUSY = 200_000_000  # torch.cuda._sleep cycles: about 0.1 s of work queued ahead of the change


def replayed(drafter, target):
    prompts = [prompt_ids(n, seed=500 + n) for n in (4, 9, 15)]
    config = DecodeConfig(max_new_tokens=24)
    trajectories = [p + decode_ar(target, p, config).output_ids for p in prompts]

    def run(model):
        verifiers = [ReplayVerifier(t) for t in trajectories]
        return [r.round_trace for r in decode_speculative("async", model, verifiers, prompts, config)]

    return run


def right_after_and_when_idle(run, change):
    """(run() right after change() was queued behind busy work, run() again once the device is idle)."""
    torch.cuda._sleep(BUSY)
    model = change()
    first = run(model)
    torch.cuda.synchronize()
    return first, run(model)


@CUDA
def test_a_replayed_evaluation_sees_the_layer_removed_just_before(no_tf32):
    from models.surgery import remove_layers

    target, drafter = on("cuda", *trained_drafter())
    run = replayed(drafter, target)
    first, idle = right_after_and_when_idle(run, lambda: remove_layers(drafter, [0]))  # a deep copy, queued
    assert first == idle


@CUDA
def test_a_replay_right_after_an_optimizer_step_sees_the_stepped_weights(no_tf32):
    target, model = on("cuda", *trained_drafter())
    run = replayed(model, target)
    before = run(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)

    def step():
        optimizer.step()
        return model

    first, idle = right_after_and_when_idle(run, step)
    assert first == idle and idle != before


@CUDA
def test_an_evaluation_right_after_a_lora_merge_sees_the_merged_weights(no_tf32):
    from prune.heal import HealConfig, add_lora

    target, drafter = on("cuda", *trained_drafter())
    peft_model = add_lora(drafter, HealConfig(rank=2, alpha=64))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter))
    run = replayed(drafter, target)
    first, idle = right_after_and_when_idle(run, lambda: peft_model.merge_and_unload().eval())
    assert first == idle and idle != run(drafter)


@CUDA
def test_engines_share_one_drafter_stream_and_allocate_on_it():
    _, drafter = on("cuda", *trained_drafter())
    a, b = DraftEngine(drafter), DraftEngine(drafter, rows=3)
    assert a.stream is b.stream is not None and a.stream != torch.cuda.current_stream()


# ------------------------------------------------------------------------------------------------------
# The ordering rules themselves, on any machine: a stand-in for the CUDA stream API records what the engine
# asks of it (decode/engine.py, module docstring).
# ------------------------------------------------------------------------------------------------------


class _Recorder:
    """A stand-in CUDA stream: logs waits; `record_event` returns a named event."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", event))

    def record_event(self):
        self.log.append(("record", self.name))
        return f"event on {self.name}"

    def __repr__(self):
        return self.name


def test_every_drafter_pass_waits_for_the_callers_stream_and_the_cache_lives_on_the_drafters(monkeypatch):
    import contextlib

    import decode.engine as engine_module
    from models.lean import LeanDecoder

    log = []
    drafter_stream, caller = _Recorder("drafter", log), _Recorder("caller", log)

    @contextlib.contextmanager
    def entered(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    real_new_cache = LeanDecoder.new_cache
    monkeypatch.setattr(LeanDecoder, "new_cache", lambda *a, **k: log.append("new cache") or real_new_cache(*a, **k))
    monkeypatch.setattr(engine_module, "draft_stream", lambda device: drafter_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", entered)
    _, drafter = on("cpu", *trained_drafter())
    engine = DraftEngine(drafter, rows=2)
    assert log == [("enter", "drafter"), "new cache", ("exit", "drafter")]

    def logged(action):
        log.clear()
        action()
        return list(log)

    passed = [("wait_stream", "caller"), ("enter", "drafter"), ("exit", "drafter")]
    request = DraftRequest(prompt_ids(6, seed=1), [BlockSpec(5)])
    assert logged(lambda: engine.forward([request, None])) == passed
    assert logged(lambda: engine.keep([6, 0])) == passed
    # mark_ready: the next pass (the async packed pass) waits for that point only, the one after for all.
    assert logged(engine.mark_ready) == [("record", "caller")]
    request = DraftRequest([3], [BlockSpec(6)])
    assert logged(lambda: engine.forward([request, None]))[0] == ("wait_event", "event on caller")
    assert logged(lambda: engine.keep([1, 0]))[0] == ("wait_stream", "caller")
    # A pass with nothing to feed drops the mark: the next pass waits for the caller's whole stream.
    engine.mark_ready()
    assert logged(lambda: engine.forward([None, None])) == []
    assert logged(lambda: engine.keep([0, 0]))[0] == ("wait_stream", "caller")


# ------------------------------------------------------------------------------------------------------
# The CUDA pass's inputs (one upload, the mask built on the device) give the same predictions as the CPU's
# (built on the host): run both ways on every device.
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_staged_inputs_predict_exactly_as_host_built_ones(device, lean, no_tf32):
    _, drafter = on(device, *trained_drafter())
    engines = [DraftEngine(drafter, rows=3, lean=lean) for _ in range(2)]
    engines[1].staged = not engines[0].staged
    prompts = [prompt_ids(n, seed=600 + n) for n in (3, 11, 7)]
    rounds = [
        ([DraftRequest(p, [BlockSpec(len(p) - 1)]) for p in prompts], [3, 11, 7]),
        # unequal rows: padding, guesses, blocks anchored inside the cache, a row that feeds nothing
        ([DraftRequest([5, 6], [BlockSpec(3), BlockSpec(4, guess=9)]), None,
          DraftRequest([1, 2, 3, 4], [BlockSpec(9, guess=2), BlockSpec(10), BlockSpec(2)])], [1, 0, 4]),
        ([DraftRequest([8], [BlockSpec(4)]), DraftRequest([2], [BlockSpec(11, guess=5)]), None], [1, 1, 0]),
    ]
    for requests, counts in rounds:
        a, b = (engine.forward(requests) for engine in engines)
        assert a == b
        for engine in engines:
            engine.keep(counts)
    assert engines[0].cache_lens == engines[1].cache_lens == [5, 12, 11]


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_keeps_probabilities_on_the_device_and_is_reproducible(device):
    target, drafter = on(device, *trained_drafter())
    config = DecodeConfig(max_new_tokens=20, temperature=0.9, seed=3)
    prompt = prompt_ids(7, seed=9)
    verifier = LiveVerifier(target, temperature=0.9)
    assert verifier.prefill(prompt).probs.device.type == device
    for decoder in ("sync", "async"):
        runs = [decode_speculative(decoder, drafter, [LiveVerifier(target, 0.9)], [prompt], config)[0]
                for _ in range(2)]
        assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 20


@pytest.mark.measured_times
@pytest.mark.parametrize("device", DEVICES)
def test_pass_times_on_the_device(device):
    from decode.timing import elapsed_ms, measure_pass_times

    target, drafter = on(device, *trained_drafter())
    engine = DraftEngine(drafter)
    request = DraftRequest(prompt_ids(6, seed=1), [BlockSpec(5)])
    assert elapsed_ms(lambda: engine.forward([request]), torch.device(device)) > 0
    times = measure_pass_times(target, drafter, DecodeConfig(packed_budget=27), repeats=1, context=16)
    assert min(times.ar_ms, times.draft_ms, times.packed_ms) > 0 and 0 <= times.contention <= 1
