"""A scoring round holds one drafter: its ablations share the drafter's tensors and their derived fast-path forms
(models.surgery.without_layers, models.lean's per-layer cache) and score exactly what deep copies scored."""

import contextlib
import gc

import pytest
import torch

import models.lean
import prune.scoring as scoring
from _pairs import prompt_ids, trained_drafter
from decode.cost import LayerCost
from decode.decoders import DecodeConfig
from models.surgery import remove_layers
from prune.scoring import ScoreConfig, evaluate, record_trajectories, score_layers

COSTS = (LayerCost(1.0, 2.0), LayerCost(1.0, 3.0))  # modelled pass times: nothing timed, nothing noisy


@pytest.fixture(scope="module")
def setup():
    target, drafter = trained_drafter(num_layers=3)
    prompts = [prompt_ids(n, seed=n) for n in (2, 5, 9, 14)]
    decode = DecodeConfig(max_new_tokens=30, packed_budget=27)
    return drafter, prompts, decode, record_trajectories(target, prompts, decode)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage the Python heap holds (each storage counted once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): isinstance reads __class__, which warns on some proxies
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque (oneDNN-prepacked) tensor
                storages[id(obj)] = obj.numel() * obj.element_size()
    return sum(storages.values())


def test_scoring_allocates_no_second_copy_of_the_drafters_weights(setup, monkeypatch):
    """Every ablation's drafter holds the drafter's own parameter storages, no fused layer is derived again
    after the drafter's first evaluation, and the tensors alive after each evaluation are those alive after the
    drafter's own (a deep copy per ablation held a second drafter and a second fast-path form: 1.5x the
    drafter's bytes more here, and derived 10 fused layers again)."""
    drafter, prompts, decode, trajectories = setup
    config = ScoreConfig(decode=decode, timing_repeats=1, screen_prompts=2, screen_keep=2)
    evaluate(drafter, prompts, config, trajectories)  # the drafter's fast-path form, as a round's base makes it
    weights = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    drafter_bytes = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p
                                                                 for p in drafter.parameters()}.values())
    baseline = live_tensor_bytes()
    real_evaluate, real_fused_layer = scoring.evaluate, models.lean._fused_layer
    storages, alive, derived = [], [], []

    def watched(model, *args, **kwargs):
        storages.append({p.untyped_storage().data_ptr() for p in model.parameters()})
        result = real_evaluate(model, *args, **kwargs)
        alive.append(live_tensor_bytes())  # the ablated model and whatever was derived for it are still alive
        return result

    monkeypatch.setattr(scoring, "evaluate", watched)
    monkeypatch.setattr(models.lean, "_fused_layer", lambda *a: derived.append(1) or real_fused_layer(*a))
    report = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=COSTS)
    assert len(storages) == 2 + 3 + 2  # the base's two passes, three layers on 2 prompts, two on the other 2
    assert all(used <= weights for used in storages)
    assert derived == []
    growth = max(alive) - baseline
    assert growth < 0.05 * drafter_bytes, f"{growth} bytes more than one drafter of {drafter_bytes} and its forms"
    assert {s.prompts for s in report.layers} == {2, 4}


@contextlib.contextmanager
def deep_copy_without(model, indices):
    """The ablation as scoring took it before views: a deep copy without the layers."""
    yield remove_layers(model, indices)


@pytest.mark.parametrize("criterion,screen", [("tau", 0), ("tau", 2), ("expected-tau", 2)])
def test_shared_ablations_score_exactly_what_deep_copies_scored(setup, monkeypatch, criterion, screen):
    drafter, prompts, decode, trajectories = setup
    config = ScoreConfig(decode=decode, criterion=criterion, timing_repeats=1, screen_prompts=screen, screen_keep=2)
    shared = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=COSTS).to_dict()
    monkeypatch.setattr(scoring, "without_layers", deep_copy_without)
    copied = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=COSTS).to_dict()
    assert shared == copied  # every tau, rate and interval bit for bit
    assert len({s["tau_without"] for s in shared["layers"]}) > 1  # the layers differ: a real comparison


def test_views_in_any_order_evaluate_as_their_copies_and_leave_the_drafter_as_it_was(setup):
    """No ablation reads a form derived for another layer set, and the drafter's own evaluation is unchanged
    after them (the layers' `layer_idx` restored, its derived forms its own)."""
    from models.surgery import without_layers

    drafter, prompts, decode, trajectories = setup
    config = ScoreConfig(decode=decode, criterion="expected-tau")
    base = evaluate(drafter, prompts, config, trajectories, expected=True)
    for removed in ([0], [2], [0], [1, 2], [1]):
        with without_layers(drafter, removed) as view:
            got = evaluate(view, prompts, config, trajectories, expected=True)
        assert got == evaluate(remove_layers(drafter, removed), prompts, config, trajectories, expected=True)
        assert got != base
    assert evaluate(drafter, prompts, config, trajectories, expected=True) == base
    assert [layer.self_attn.layer_idx for layer in drafter.model.layers] == [0, 1, 2]
