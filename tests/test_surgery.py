"""Layer surgery (models.surgery.remove_layers) and the export of a pruned drafter (docs/design.md, Layer surgery)."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from models.drafter import load_drafter, save_drafter, validate_checkpoint
from models.errors import ConfigError
from models.surgery import remove_layers, without_layers

N_LAYERS = 36
REMOVED = (0, 17, 35)
KEPT = [i for i in range(N_LAYERS) if i not in REMOVED]
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def original(make_tiny_drafter):
    return make_tiny_drafter(num_hidden_layers=N_LAYERS, seed=3)


@pytest.fixture(scope="module")
def original_snapshot(original):
    """State, config and module indices of the original before any surgery touches it."""
    return {
        "state": {k: v.clone() for k, v in original.state_dict().items()},
        "config": original.config.to_dict(),
        "layer_idx": [layer.self_attn.layer_idx for layer in original.model.layers],
    }


@pytest.fixture(scope="module")
def pruned(original, original_snapshot):
    return remove_layers(original, REMOVED)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))


def layer_state(model, index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    return {k[len(prefix) :]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


def layer_indices_of_modules(model) -> list[list[int]]:
    """For each decoder layer, the layer_idx of every submodule that has one."""
    return [
        [m.layer_idx for m in layer.modules() if hasattr(m, "layer_idx")] for layer in model.model.layers
    ]


def assert_cached_equals_uncached(model, ids: torch.Tensor, cache: DynamicCache, prefill: int = 4):
    """Prefill `prefill` tokens into `cache`, then feed the rest one token at a time."""
    want = model(ids, use_cache=False).logits
    got = [model(ids[:, :prefill], cache=cache, use_cache=True).logits]
    for t in range(prefill, ids.shape[1]):
        assert cache.get_seq_length() == t, f"cache holds {cache.get_seq_length()} positions, expected {t}"
        got.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    got = torch.cat(got, dim=1)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, f"cached forward differs from the uncached one by {diff:.3g}"


# ----------------------------------------------------------------------------------------------------
# In memory
# ----------------------------------------------------------------------------------------------------


def test_pruned_structure_and_renumbering(pruned):
    config = pruned.config
    assert len(pruned.model.layers) == 33
    assert config.num_hidden_layers == 33
    assert len(config.layer_types) == 33
    assert config.original_layer_indices == KEPT
    for i, row in enumerate(layer_indices_of_modules(pruned)):
        assert row and set(row) == {i}, f"layer {i} holds modules with layer_idx {row}"
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == list(range(33))
    # block-diffusion metadata survives
    assert (config.block_size, config.mask_token_id, config.draft_vocab_size) == (4, 97, 97)


def test_pruned_keeps_the_right_weights(original_snapshot, pruned):
    state = pruned.state_dict()
    for new, old in enumerate(KEPT):
        for name, tensor in layer_state(pruned, new).items():
            assert torch.equal(tensor, original_snapshot["state"][f"model.layers.{old}.{name}"]), (new, old, name)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(state[name], original_snapshot["state"][name])


def fresh_reference(make_tiny_drafter, state: dict, kept: list[int], **config):
    """A drafter built from scratch with len(kept) layers, loaded with the kept layers of `state`.

    It never goes through remove_layers, so it is an independent reference for the pruned function.
    """
    reference = make_tiny_drafter(num_hidden_layers=len(kept), **config)
    new_state = {}
    for key, tensor in state.items():
        match = LAYER_KEY.match(key)
        if match is None:
            new_state[key] = tensor
        elif int(match.group(1)) in kept:
            new_state[f"model.layers.{kept.index(int(match.group(1)))}." + key[match.end() :]] = tensor
    reference.load_state_dict(new_state, strict=True)
    return reference


def test_pruned_computes_the_same_function_as_a_fresh_33_layer_model(
    make_tiny_drafter, original_snapshot, pruned, ids
):
    reference = fresh_reference(make_tiny_drafter, original_snapshot["state"], KEPT)
    assert torch.equal(pruned(ids).logits, reference(ids).logits)


def test_input_model_is_unchanged(original, original_snapshot, pruned, ids):
    assert pruned is not original
    assert original.config.to_dict() == original_snapshot["config"]
    assert original.config.num_hidden_layers == N_LAYERS
    assert len(original.config.layer_types) == N_LAYERS
    assert original.config.original_layer_indices == list(range(N_LAYERS))
    assert len(original.model.layers) == N_LAYERS
    assert [layer.self_attn.layer_idx for layer in original.model.layers] == original_snapshot["layer_idx"]
    state = original.state_dict()
    assert state.keys() == original_snapshot["state"].keys()
    assert all(torch.equal(state[k], v) for k, v in original_snapshot["state"].items())
    # The copy shares no storage with the input: editing it leaves the input alone.
    pruned_ptrs = {t.data_ptr() for t in pruned.state_dict().values()}
    assert not pruned_ptrs & {t.data_ptr() for t in state.values()}
    assert pruned.config is not original.config


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy-cache", "config-cache"])
def test_pruned_kv_cached_forward_equals_uncached(pruned, ids, lazy):
    cache = DynamicCache() if lazy else DynamicCache(config=pruned.config)
    assert_cached_equals_uncached(pruned, ids, cache)
    assert len([layer for layer in cache.layers if layer.is_initialized]) == 33


def test_cache_check_catches_a_stale_layer_idx(original, ids):
    # The check above has teeth: layers deleted without renumbering fail it (or fail outright).
    import copy

    stale = copy.deepcopy(original)
    stale.model.layers = torch.nn.ModuleList(l for i, l in enumerate(stale.model.layers) if i not in REMOVED)
    stale.config.num_hidden_layers = 33
    stale.config.layer_types = stale.config.layer_types[:33]
    with pytest.raises((AssertionError, IndexError)):
        assert_cached_equals_uncached(stale, ids, DynamicCache())


def test_prune_twice_reports_original_indices(pruned, ids):
    twice = remove_layers(pruned, [0, 5])  # current 0 and 5 are original 1 and 6
    expected = [i for i in KEPT if i not in (1, 6)]
    assert twice.config.original_layer_indices == expected
    assert twice.config.num_hidden_layers == 31 == len(twice.config.layer_types) == len(twice.model.layers)
    assert [layer.self_attn.layer_idx for layer in twice.model.layers] == list(range(31))
    # the first pruned model is untouched by the second removal
    assert pruned.config.original_layer_indices == KEPT
    assert len(pruned.model.layers) == 33
    for new, cur in enumerate(i for i in range(33) if i not in (0, 5)):
        a, b = layer_state(twice, new), layer_state(pruned, cur)
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert_cached_equals_uncached(twice, ids, DynamicCache())


def test_per_layer_config_lists_are_sliced_in_order(make_tiny_drafter, ids):
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention", "sliding_attention", "full_attention"]
    sliding = dict(use_sliding_window=True, sliding_window=3)  # 3 < 9 tokens: the window matters
    model = make_tiny_drafter(num_hidden_layers=6, layer_types=types, **sliding)
    kept = [0, 2, 4, 5]
    pruned = remove_layers(model, [1, 3])
    assert pruned.config.layer_types == [types[i] for i in kept]
    assert pruned.config.original_layer_indices == kept
    assert model.config.layer_types == types
    reference = fresh_reference(
        make_tiny_drafter, model.state_dict(), kept, layer_types=[types[i] for i in kept], **sliding
    )
    assert torch.equal(pruned(ids).logits, reference(ids).logits)
    assert_cached_equals_uncached(pruned, ids, DynamicCache(config=pruned.config))


def test_non_per_layer_lists_are_left_alone(make_tiny_drafter):
    # eos_token_id may be a list (several end tokens); it is not a per-layer entry even when its length
    # happens to equal num_hidden_layers.
    model = make_tiny_drafter(num_hidden_layers=2, eos_token_id=[5, 6])
    pruned = remove_layers(model, [0])
    assert pruned.config.num_hidden_layers == 1
    assert pruned.config.eos_token_id == [5, 6]


# ----------------------------------------------------------------------------------------------------
# A view without layers (scoring's ablations)
# ----------------------------------------------------------------------------------------------------


def test_a_view_without_layers_shares_every_tensor_and_is_the_copy_bit_for_bit(original, original_snapshot,
                                                                                pruned, ids):
    from prune.cache import fingerprint

    digest = fingerprint(original)
    weights = {t.untyped_storage().data_ptr() for t in original.state_dict().values()}
    with without_layers(original, REMOVED) as view:
        assert view is not original and view.config is not original.config
        assert {t.untyped_storage().data_ptr() for t in view.state_dict().values()} <= weights
        assert view.state_dict().keys() == pruned.state_dict().keys()
        assert view.config.to_dict() == pruned.config.to_dict()
        assert layer_indices_of_modules(view) == layer_indices_of_modules(pruned)
        assert fingerprint(view) == fingerprint(pruned) != digest  # a cache key names the layers it holds
        assert torch.equal(view(ids).logits, pruned(ids).logits)
        assert_cached_equals_uncached(view, ids, DynamicCache(config=view.config))
        assert len(original.model.layers) == original.config.num_hidden_layers == N_LAYERS
    assert [layer.self_attn.layer_idx for layer in original.model.layers] == original_snapshot["layer_idx"]
    assert original.config.to_dict() == original_snapshot["config"]
    assert fingerprint(original) == digest
    assert_cached_equals_uncached(original, ids, DynamicCache())


def test_a_view_slices_per_layer_lists_and_restores_the_drafter_after_an_error(make_tiny_drafter, ids):
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention", "sliding_attention", "full_attention"]
    model = make_tiny_drafter(num_hidden_layers=6, layer_types=types, use_sliding_window=True, sliding_window=3)
    copy = remove_layers(model, [1, 3])
    with without_layers(model, [1, 3]) as view:
        assert view.config.layer_types == copy.config.layer_types and view.config.original_layer_indices == [0, 2, 4, 5]
        assert torch.equal(view(ids).logits, copy(ids).logits)
        assert_cached_equals_uncached(view, ids, DynamicCache(config=view.config))
    with pytest.raises(KeyboardInterrupt), without_layers(model, [0]):
        raise KeyboardInterrupt
    assert layer_indices_of_modules(model) == [[i] * len(layer_indices_of_modules(model)[0]) for i in range(6)]
    assert model.config.layer_types == types and len(model.model.layers) == 6
    with pytest.raises(ConfigError, match="out of range"), without_layers(model, [6]):
        pass


# ----------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[36], [-1], [3, 40]])
def test_out_of_range_index_is_a_config_error(original, original_snapshot, bad):
    with pytest.raises(ConfigError) as info:
        remove_layers(original, bad)
    message = str(info.value)
    assert "out of range" in message and "0..35" in message
    assert str([b for b in bad if not 0 <= b < 36][0]) in message
    assert "\n" not in message
    assert original.config.num_hidden_layers == N_LAYERS


def test_removing_every_layer_is_a_config_error(make_tiny_drafter):
    model = make_tiny_drafter(num_hidden_layers=3)
    for indices in ([0, 1, 2], [2, 1, 0, 1]):
        with pytest.raises(ConfigError) as info:
            remove_layers(model, indices)
        message = str(info.value)
        assert "all 3 layers" in message and "at least one layer" in message
        assert "\n" not in message
    assert len(model.model.layers) == 3


# ----------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(pruned, tmp_path_factory):
    return save_drafter(pruned, tmp_path_factory.mktemp("export") / "pruned")


def test_export_reloads_with_plain_transformers(pruned, exported, ids):
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    assert reloaded.config.num_hidden_layers == 33 == len(reloaded.model.layers)
    assert reloaded.config.original_layer_indices == KEPT
    assert reloaded.dtype == torch.float32
    diff = (reloaded(ids).logits - pruned(ids).logits).abs().max().item()
    assert diff < 1e-6
    assert_cached_equals_uncached(reloaded, ids, DynamicCache())
    assert_cached_equals_uncached(reloaded, ids, DynamicCache(config=reloaded.config))
    # and through the project's own loader
    loaded = load_drafter(exported)
    assert (loaded(ids).logits - pruned(ids).logits).abs().max().item() < 1e-6


def test_export_file_holds_no_removed_layer(original_snapshot, pruned, exported):
    with safe_open(str(exported / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        stored = {k: handle.get_tensor(k) for k in keys}
    layer_keys = [k for k in keys if LAYER_KEY.match(k)]
    indices = {int(LAYER_KEY.match(k).group(1)) for k in layer_keys}
    assert indices == set(range(33))
    assert not [k for k in keys if LAYER_KEY.match(k) and int(LAYER_KEY.match(k).group(1)) >= 33]
    per_layer = sum(1 for k in original_snapshot["state"] if k.startswith("model.layers.0."))
    assert per_layer > 0 and len(layer_keys) == 33 * per_layer
    assert len(keys) - len(layer_keys) == len(original_snapshot["state"]) - N_LAYERS * per_layer
    # No stored tensor holds the weights of a removed layer.
    for removed in REMOVED:
        q = original_snapshot["state"][f"model.layers.{removed}.self_attn.q_proj.weight"]
        assert not any(t.shape == q.shape and torch.equal(t, q) for t in stored.values()), removed
    for new, old in enumerate(KEPT):
        assert torch.equal(
            stored[f"model.layers.{new}.mlp.down_proj.weight"],
            original_snapshot["state"][f"model.layers.{old}.mlp.down_proj.weight"],
        )


def test_export_config(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["num_hidden_layers"] == 33
    assert len(config["layer_types"]) == 33
    assert config["original_layer_indices"] == KEPT
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (4, 97, 97)
    validate_checkpoint(exported)


def test_reloaded_pruned_model_prunes_again_with_original_indices(exported, ids):
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    twice = remove_layers(reloaded, [0, 5])
    assert twice.config.original_layer_indices == [i for i in KEPT if i not in (1, 6)]
    assert_cached_equals_uncached(twice, ids, DynamicCache())


def test_drafter_from_a_pretrained_qwen3_checkpoint(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models.drafter import drafter_from_checkpoint, load_drafter, save_drafter

    torch.manual_seed(0)
    source = Qwen3ForCausalLM(Qwen3Config(vocab_size=90, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    source.save_pretrained(tmp_path / "source")
    drafter = drafter_from_checkpoint(tmp_path / "source", block_size=4, num_hidden_layers=3)
    config = drafter.config
    assert (config.block_size, config.mask_token_id, config.draft_vocab_size) == (4, 90, 90)
    assert config.vocab_size == 128 and config.num_hidden_layers == 3 and len(config.layer_types) == 3
    assert config.original_layer_indices == [0, 1, 2]
    assert torch.equal(drafter.model.layers[2].mlp.up_proj.weight, source.model.layers[2].mlp.up_proj.weight)
    assert torch.equal(drafter.get_input_embeddings().weight[:90], source.get_input_embeddings().weight)
    save_drafter(drafter, tmp_path / "drafter")
    assert load_drafter(tmp_path / "drafter").config.mask_token_id == 90


def test_split_layers_replaces_idle_layers_by_halves_and_keeps_the_function_close(make_tiny_drafter, ids):
    from models.surgery import split_layers
    from prune.training.transplant import idle_layer_split

    model = make_tiny_drafter(num_hidden_layers=6)
    with torch.no_grad():
        for i in (1, 4):  # two layers that never learned: identities
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
        for layer in model.model.layers:  # small updates, where halving is near-exact
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    idle, sources = idle_layer_split(model, 2)
    assert idle == [1, 4] and sources == [2, 5]  # spread over the remaining 0, 2, 3, 5
    split = split_layers(model, idle, sources)
    assert split.config.num_hidden_layers == 6 and list(split.config.original_layer_indices) == list(range(6))
    source_of = [0, 2, 2, 3, 5, 5]
    for new, old in enumerate(source_of):
        halve = 0.5 if old in sources else 1.0
        assert torch.equal(split.model.layers[new].mlp.down_proj.weight,
                           halve * model.model.layers[old].mlp.down_proj.weight)
        assert torch.equal(split.model.layers[new].mlp.up_proj.weight, model.model.layers[old].mlp.up_proj.weight)
        assert split.model.layers[new].self_attn.layer_idx == new
    assert split.model.layers[1] is not split.model.layers[2]  # a copy, not a shared module
    with torch.no_grad():
        want, got = model(ids).logits, split(ids).logits
        removed = remove_layers(model, sources)(ids).logits  # what losing those layers' updates would do
    assert (got - want).abs().max() < 0.1 * (removed - want).abs().max()
    for bad in ([1], [7]):
        with pytest.raises(ConfigError):
            split_layers(model, bad, [1])
    with pytest.raises(ConfigError, match="--split-idle 3"):
        idle_layer_split(model, 3)
