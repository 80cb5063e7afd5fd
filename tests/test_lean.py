"""The lean forward (models/lean.py) against transformers, its static cache, and the new decoder settings:
adaptive verify width, split threads, lean against transformers' forward - all exact against ar."""

import copy
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from _pairs import prompt_ids, tiny_target, trained_drafter
from conftest import build_tiny_drafter
from decode.cost import CandidatePolicy, WidthPolicy
from decode.decoders import DecodeConfig, decode_ar, decode_speculative
from decode.engine import DraftEngine
from decode.verifiers import LiveVerifier, ReplayVerifier
from models.draft_vocab import head_rows
from models.errors import ConfigError
from models.inference import (PRODUCTS, TARGET_PRODUCTS_ENV, TransformersDecoder, decoder_runner,
                               target_products, target_runner)
import models.lean
from models.lean import LeanDecoder, can_prepack
from models.masks import BlockSpec, batch_layouts, block_layout


def tiny_qwen2():
    config = Qwen2Config(vocab_size=97, hidden_size=48, intermediate_size=53, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(3)
    return Qwen2ForCausalLM(config).eval()  # q/k/v carry biases


MODELS = {"llama": tiny_target, "qwen3 drafter": build_tiny_drafter, "qwen2": tiny_qwen2}


@pytest.mark.parametrize("fused", [False, True, "rotated apart"], ids=["exact order", "fused", "fused, rotated apart"])
@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_lean_matches_transformers_causal_with_cache(name, fused, monkeypatch):
    """Every form computes the model; the fused form's long passes rotate q and k outside the product
    (`ROTATION_IN_PRODUCT_TOKENS`), here every pass of the third case."""
    if fused == "rotated apart":
        monkeypatch.setattr(models.lean, "ROTATION_IN_PRODUCT_TOKENS", 0)
    model = MODELS[name]()
    lean = LeanDecoder(model, fused=bool(fused))
    ids = torch.tensor([prompt_ids(11, seed=1)])
    positions = torch.arange(11)[None]
    want = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    cache = lean.new_cache(1, capacity=4)  # grows twice on the way
    got = torch.cat([lean.forward(ids[:, :6], positions[:, :6], None, cache),
                     lean.forward(ids[:, 6:7], positions[:, 6:7], None, cache),
                     lean.forward(ids[:, 7:], positions[:, 7:], None, cache)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.length == 11 and cache.capacity >= 11
    cache.crop(6)  # roll back and recompute the tail
    torch.testing.assert_close(lean.forward(ids[:, 6:], positions[:, 6:], None, cache), want[:, 6:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["exact order", "fused"])
@torch.inference_mode()
def test_lean_matches_transformers_on_a_batched_block_layout(fused):
    model = build_tiny_drafter(block_size=4)
    layouts = [block_layout(0, 5, [BlockSpec(4), BlockSpec(2, guess=7)], 4), block_layout(0, 3, [BlockSpec(2)], 4)]
    batched = batch_layouts(layouts, 0, torch.float32, "cpu")
    ids = torch.randint(0, 97, (2, batched.query_len), generator=torch.Generator().manual_seed(0))
    lean, reference = LeanDecoder(model, fused=fused), TransformersDecoder(model)
    got = lean.forward(ids, batched.positions, batched.mask, lean.new_cache(2))
    want = reference.forward(ids, batched.positions, batched.mask, reference.new_cache(2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("fused", [False, True], ids=["exact order", "fused"])
@torch.inference_mode()
def test_ragged_rows_skip_the_padding_and_match_the_padded_forward(fused):
    """With `lengths`, the products run on the real tokens only: real positions match the padded forward,
    padded ones are zeros, and the cache is the same at every real slot (a second pass reads it)."""
    model = build_tiny_drafter(block_size=4)
    layouts = [block_layout(0, 5, [BlockSpec(4), BlockSpec(2, guess=7)], 4), block_layout(0, 3, [BlockSpec(2)], 4)]
    batched = batch_layouts(layouts, 0, torch.float32, "cpu")
    lengths = [layout.query_len for layout in layouts]
    assert lengths[1] < batched.query_len  # the second row is padded
    ids = torch.randint(0, 97, (2, batched.query_len), generator=torch.Generator().manual_seed(0))
    lean = LeanDecoder(model, fused=fused)
    padded_cache, ragged_cache = lean.new_cache(2), lean.new_cache(2)
    want = lean.forward(ids, batched.positions, batched.mask, padded_cache)
    got = lean.forward(ids, batched.positions, batched.mask, ragged_cache, lengths=lengths)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :n], want[row, :n], atol=1e-5, rtol=1e-5)
        assert not got[row, n:].any()
    for cache in (padded_cache, ragged_cache):
        cache.keep_rows(torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 2, 2]]))
    follow = batch_layouts([block_layout(5, 1, [], 4), block_layout(3, 1, [], 4)], 5, torch.float32, "cpu")
    step = torch.tensor([[5], [6]])
    torch.testing.assert_close(
        lean.forward(step, follow.positions, follow.mask, ragged_cache, lengths=[1, 1]),
        lean.forward(step, follow.positions, follow.mask, padded_cache), atol=1e-5, rtol=1e-5)

def test_unsupported_models_fall_back_to_transformers():
    from peft import LoraConfig, get_peft_model

    drafter = build_tiny_drafter()
    assert isinstance(decoder_runner(drafter), LeanDecoder)
    assert isinstance(decoder_runner(drafter, lean=False), TransformersDecoder)
    adapted = get_peft_model(build_tiny_drafter(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert not LeanDecoder.supports(adapted.base_model.model)  # LoRA layers are not plain Linear
    with pytest.raises(ValueError, match="not supported"):
        LeanDecoder(adapted.base_model.model)


@torch.inference_mode()
def test_static_cache_keep_rows_matches_dynamic_cache():
    model = build_tiny_drafter()
    ids = torch.tensor([prompt_ids(6, seed=2), prompt_ids(6, seed=3)])
    positions = torch.arange(6).expand(2, -1)
    lean, reference = LeanDecoder(model), TransformersDecoder(model)
    static, dynamic = lean.new_cache(2), reference.new_cache(2)
    lean.forward(ids, positions, None, static)
    reference.forward(ids, positions, None, dynamic)
    keep = torch.tensor([[0, 1, 2, 3], [0, 2, 4, 5]])
    static.keep_rows(keep)
    dynamic.keep_rows(keep)
    assert static.length == dynamic.length == 4
    for layer in range(2):
        torch.testing.assert_close(static.keys[layer][:, :, :4], dynamic.cache.layers[layer].keys)
        torch.testing.assert_close(static.values[layer][:, :, :4], dynamic.cache.layers[layer].values)


ADAPTIVE = WidthPolicy(slope=0.08, fixed=0.5)


# Where the passes cannot overlap, candidates rarely pay: the policy drafts few or none, varying per round.
FEW_CANDIDATES = CandidatePolicy(slope=0.08, draft=0.5, packed_fixed=0.4, packed_per_token=0.006, contention=0.9)


@pytest.mark.parametrize("setting", ["adaptive width", "one draft thread", "transformers forward", "few candidates",
                                     "bfloat16 drafter"])
@pytest.mark.parametrize("prompt_len", [3, 30])
def test_new_settings_are_exact_against_ar(setting, prompt_len):
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=41)
    prompt = prompt_ids(prompt_len, seed=200 + prompt_len)
    reference = decode_ar(target, prompt, config).output_ids
    if setting == "adaptive width":
        config = replace(config, width_policy=ADAPTIVE)
    elif setting == "one draft thread":
        config = replace(config, draft_threads=1)
    elif setting == "few candidates":
        config = replace(config, candidate_policy=FEW_CANDIDATES)
    elif setting == "bfloat16 drafter":  # the output is the float32 target's, whatever the drafter computes in
        drafter = copy.deepcopy(drafter).to(torch.bfloat16)
    lean = setting != "transformers forward"
    for decoder in ("sync", "async"):
        verifier = LiveVerifier(target, lean=lean)
        if not lean:
            assert isinstance(verifier.runner, TransformersDecoder)
        result = decode_speculative(decoder, drafter, [verifier], [prompt], config)[0]
        assert result.output_ids == reference, (setting, decoder)
    if setting in ("adaptive width", "few candidates"):
        replayed = decode_speculative("async", drafter, [ReplayVerifier(prompt + reference)], [prompt], config)[0]
        live = decode_speculative("async", drafter, [LiveVerifier(target)], [prompt], config)[0]
        assert replayed.round_trace == live.round_trace and replayed.widths == live.widths
        assert max(live.widths) <= drafter.config.block_size


@pytest.mark.parametrize("products", list(PRODUCTS))
def test_every_form_of_the_target_products_is_exact_against_ar(products, monkeypatch):
    """ar and the speculative decoders run the target's products in the form chosen for it (one-token steps
    and wider verify passes may take different forms): the output is ar's token for token in each."""
    target, drafter = trained_drafter()
    if not can_prepack(next(target.parameters()).device, torch.float32):
        pytest.skip("oneDNN cannot prepack here: the target runs plain products only")
    target = copy.deepcopy(target)  # a model of its own: the form is chosen once per model
    monkeypatch.setenv(TARGET_PRODUCTS_ENV, products)
    config = DecodeConfig(max_new_tokens=41, width_policy=ADAPTIVE)
    for prompt_len in (3, 30):
        prompt = prompt_ids(prompt_len, seed=200 + prompt_len)
        reference = decode_ar(target, prompt, config).output_ids
        assert target_products(target) == products
        for decoder in ("sync", "async"):
            result = decode_speculative(decoder, drafter, [LiveVerifier(target)], [prompt], config)[0]
            assert result.output_ids == reference, (products, decoder, prompt_len)


def test_adaptive_width_varies_with_the_drafters_confidence():
    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=41, width_policy=ADAPTIVE)
    widths = set()
    for seed in range(4):
        prompt = prompt_ids(3 + 9 * seed, seed=300 + seed)
        widths |= set(decode_speculative("sync", drafter, [LiveVerifier(target)], [prompt], config)[0].widths)
    assert len(widths) > 1 and widths <= set(range(2, drafter.config.block_size + 1))


def test_draft_engine_runs_transformers_forward_when_asked():
    drafter = build_tiny_drafter()
    assert isinstance(DraftEngine(drafter).runner, LeanDecoder)
    assert isinstance(DraftEngine(drafter, lean=False).runner, TransformersDecoder)
    assert isinstance(TransformersDecoder(drafter).new_cache(1).cache, DynamicCache)


def test_batched_keep_runs_outside_inference_mode():
    """A pass that outgrows the cache makes its buffers inference tensors (they grow inside the pass);
    trimming rows afterwards, from ordinary code, must still work."""
    from decode.engine import DraftRequest

    engine = DraftEngine(build_tiny_drafter(block_size=4), rows=2)
    long = engine.cache.capacity + 10
    engine.forward([DraftRequest(prompt_ids(long, seed=1), [BlockSpec(long - 1)]),
                    DraftRequest(prompt_ids(3, seed=2), [])])
    assert engine.cache.keys[0].is_inference()
    engine.keep([long, 2])
    assert engine.cache_lens == [long, 2] and engine.cache.length == long


def test_candidate_policy_skips_packed_passes_and_the_cost_model_sees_it():
    """With a policy that drafts no candidate where the passes cannot overlap, rounds skip the packed pass
    (packed_share < 1), run their fallback as sync does, and stay exact."""
    from decode.metrics import summarize

    target, drafter = trained_drafter()
    config = DecodeConfig(max_new_tokens=41, candidate_policy=CandidatePolicy(0.08, 0.5, 0.4, 0.006, 1.0))
    prompt = prompt_ids(12, seed=5)
    reference = decode_ar(target, prompt, config).output_ids
    result = decode_speculative("async", drafter, [LiveVerifier(target)], [prompt], config)[0]
    assert result.output_ids == reference
    summary = summarize([result], drafter.config.block_size)
    assert summary["packed_share"] == 0.0 and summary["hit_rate"] == 0.0
    everything = decode_speculative("async", drafter, [LiveVerifier(target)], [prompt], DecodeConfig(max_new_tokens=41))
    assert summarize(everything, drafter.config.block_size)["packed_share"] > 0.5


@torch.inference_mode()
def test_stacked_products_are_rebuilt_when_a_weight_changes():
    """The drafter's stacked q/k/v and gate/up copies follow in-place weight changes (a heal's merge writes
    through `.data`): a decoder built after the change computes with the new weights, as transformers does."""
    model = build_tiny_drafter(block_size=4)
    ids, positions = torch.tensor([prompt_ids(7, seed=2)]), torch.arange(7)[None]
    lean = LeanDecoder(model)
    assert all(w.qkv.plain is not None and w.gate_up.plain is not None for w in lean.layers)
    before = lean.forward(ids, positions, None, lean.new_cache(1))
    model.model.layers[0].self_attn.k_proj.weight.data.mul_(3.0)
    model.model.layers[1].mlp.up_proj.weight.data.add_(0.5)
    after = LeanDecoder(model).forward(ids, positions, None, LeanDecoder(model).new_cache(1))
    want = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)
    assert (after - before).abs().max() > 1e-3


@torch.inference_mode()
def test_the_fused_form_follows_every_weight_it_folds():
    """The fused form folds norm weights into its products (models.lean._fused_layer): a decoder built after
    any of them changes in place (a heal merges through `.data`) computes the changed model, logits
    included; drafters run it, targets never do."""
    model = build_tiny_drafter(block_size=4)
    ids, positions = torch.tensor([prompt_ids(9, seed=5)]), torch.arange(9)[None]

    def logits(lean):
        return lean.logits(lean.forward(ids, positions, None, lean.new_cache(1)))

    before = logits(LeanDecoder(model, fused=True))
    layer = model.model.layers[1]
    for weight in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight):
        weight.data.mul_(torch.linspace(0.5, 1.5, weight.numel()))
    after = logits(LeanDecoder(model, fused=True))
    want = model(input_ids=ids, position_ids=positions).logits[..., :head_rows(model)]
    torch.testing.assert_close(after, want, atol=1e-4, rtol=1e-4)
    assert (after - before).abs().max() > 1e-3
    assert DraftEngine(model).runner.fused and not target_runner(tiny_target()).fused


def test_the_fused_norm_scale_is_computed_in_float32():
    """The fused form's RMS scale (models.lean._inverse_rms) is computed in float32, as transformers' norms
    are: in float16 the mean square of a state of RMS 1000 (1e6) overflows, which would zero the layer's input."""
    x = torch.full((3, 64), 1000.0, dtype=torch.float16)
    scale = models.lean._inverse_rms(x, torch.tensor(1e-6))
    assert scale.dtype == torch.float16 and scale.shape == (3, 1)
    torch.testing.assert_close(scale.float(), torch.full((3, 1), 1e-3), rtol=1e-3, atol=0)


@pytest.mark.parametrize("packed_from", [None, 1, 2, "no copies"])
@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_prepacked_plain_and_mixed_products_match_transformers(name, packed_from):
    """Every form of the products (`packed_from`: none, all, from two tokens on; or the model's own weights
    read in place, as on a GPU) computes the model: prefill, one-token steps and a wider pass, logits included."""
    model = MODELS[name]()
    if packed_from == "no copies":
        lean = LeanDecoder(model, copies=False)
        assert all(layer.qkv.parts[0][0] is model.model.layers[i].self_attn.q_proj.weight
                   and layer.qkv.plain is None and layer.qkv.packed is None for i, layer in enumerate(lean.layers))
    else:
        lean = LeanDecoder(model, packed_from=packed_from)
    ids = torch.tensor([prompt_ids(12, seed=4)])
    positions = torch.arange(12)[None]
    want = model(input_ids=ids, position_ids=positions).logits[..., :head_rows(model)]  # a drafter: its proposable ids
    cache = lean.new_cache(1)
    hidden = torch.cat([lean.forward(ids[:, :6], positions[:, :6], None, cache),
                        lean.forward(ids[:, 6:7], positions[:, 6:7], None, cache),
                        lean.forward(ids[:, 7:], positions[:, 7:], None, cache)], dim=1)
    got = torch.cat([lean.logits(hidden[:, :6]), lean.logits(hidden[:, 6:7]), lean.logits(hidden[:, 7:])], dim=1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if packed_from == "no copies":
        return
    packs = can_prepack(torch.device("cpu"), torch.float32)
    for layer in lean.layers:
        assert (layer.qkv.packed is not None) == (packs and packed_from is not None)
        assert (layer.qkv.plain is not None) == (not packs or packed_from != 1)


@pytest.mark.parametrize("fixed", list(PRODUCTS))
def test_the_target_products_are_chosen_once_or_fixed_by_the_environment(fixed, monkeypatch):
    model = tiny_target()
    weight = next(model.parameters())
    if not can_prepack(weight.device, weight.dtype):
        pytest.skip("oneDNN cannot prepack here: the target runs plain products only")
    monkeypatch.setenv(TARGET_PRODUCTS_ENV, fixed)
    assert target_products(model) is None
    runner = target_runner(model)
    assert runner.packed_from == PRODUCTS[fixed] and target_products(model) == fixed
    monkeypatch.setenv(TARGET_PRODUCTS_ENV, "plain" if fixed != "plain" else "packed")
    assert target_runner(model).packed_from == PRODUCTS[fixed]  # chosen once per model
    monkeypatch.setenv(TARGET_PRODUCTS_ENV, "fast")
    with pytest.raises(ConfigError, match="D3D_PRUNE_TARGET_PRODUCTS='fast'; use packed, mixed, plain"):
        target_runner(tiny_target())
    monkeypatch.delenv(TARGET_PRODUCTS_ENV)
    measured = tiny_target()
    packed_from = target_runner(measured).packed_from
    assert packed_from in PRODUCTS.values() and target_products(measured) in PRODUCTS  # timed: any of the three
    # both forms were built to be timed; the one its decoders never read is dropped
    kept = {packed for role, packed in models.lean._PACKED[measured] if role == "layers"}
    assert kept == {1: {True}, 2: {False, True}, None: {False}}[packed_from]


@torch.inference_mode()
def test_decoders_of_one_model_share_its_derived_matrices():
    """A target's head read at one token (made on first use) does not push its layers' matrices out of the
    per-model cache: the next decoder of the model reuses every one of them."""
    model = tiny_target()
    first = LeanDecoder(model, packed_from=2)
    first.logits(torch.zeros(1, 1, model.config.hidden_size))  # one row: the head's plain form
    second = LeanDecoder(model, packed_from=2)
    for a, b in zip(first.layers, second.layers):
        assert a.qkv.plain is b.qkv.plain and a.down.packed is b.down.packed
    assert first.head.packed is second.head.packed


@torch.inference_mode()
def test_a_view_without_layers_reuses_the_fused_forms_and_head_of_the_drafter():
    """A drafter's fused layers and its head are derived per layer and per lm_head, not per model: a view of the
    drafter without some layers (models.surgery.without_layers, scoring's ablations) derives nothing, and
    computes what a copy without them computes, bit for bit."""
    from models.surgery import remove_layers, without_layers

    model = build_tiny_drafter(num_hidden_layers=4, block_size=4)
    ids, positions = torch.tensor([prompt_ids(9, seed=4)]), torch.arange(9)[None]

    def logits(lean):
        return lean.logits(lean.forward(ids, positions, None, lean.new_cache(1)))

    full = LeanDecoder(model, fused=True)
    for removed in ([1], [0, 3], [1]):
        kept = [i for i in range(4) if i not in removed]
        with without_layers(model, removed) as view:
            lean = LeanDecoder(view, fused=True)
            assert all(a is full.layers[i] for a, i in zip(lean.layers, kept, strict=True))
            assert lean.head.packed is full.head.packed
            assert torch.equal(logits(lean), logits(LeanDecoder(remove_layers(model, removed), fused=True)))
    assert all(a is b for a, b in zip(LeanDecoder(model, fused=True).layers, full.layers, strict=True))


@torch.inference_mode()
def test_without_copies_a_drafter_runs_its_own_weights_not_a_fused_copy():
    """Where the lean forward keeps no derived copies (a GPU), a drafter asked for the fused form runs its own
    weights in transformers' order instead: device memory holds one drafter."""
    model = build_tiny_drafter(block_size=4)
    ids, positions = torch.tensor([prompt_ids(9, seed=6)]), torch.arange(9)[None]
    lean = LeanDecoder(model, copies=False, fused=True)
    assert not lean.fused and all(layer not in models.lean._PACKED for layer in model.model.layers)
    weights = {p.data_ptr() for p in model.parameters()}
    assert all(w.data_ptr() in weights for layer in lean.layers for w, _ in layer.qkv.parts + layer.down.parts)
    hidden = lean.forward(ids, positions, None, lean.new_cache(1))
    want = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
    assert LeanDecoder(model, fused=True).fused  # with copies (a CPU) the fused form
