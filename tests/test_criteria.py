"""Ranking criteria (prune.ranking): hand-computed similarities, one pass per batch, the pre-screen and its
resume, the seeded random order and the top-down order."""

import json
import math

import pytest
import torch

from _pairs import prompt_ids, tiny_campaign
from conftest import build_tiny_drafter
from decode.decoders import DecodeConfig
from models.errors import ConfigError
from models.surgery import remove_layers
from prune import ranking, scoring
from prune.config import RunConfig, ScoreConfig
from prune.criteria import CRITERIA, Ranking
from prune.heal import HealConfig
from prune.journal import ScoringJournal
from prune.progressive import Campaign, RunHooks, run_pruning
from prune.ranking import RankInputs, layer_similarity, loss_without_each_layer
from prune.training.loss import Example


class Map(torch.nn.Module):
    """A decoder layer replaced by a known map of the hidden states."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, hidden_states, **_):
        return self.function(hidden_states)


def trajectories(prompt_lengths, output_length):
    """(prompts, trajectories) of random real tokens; outputs short enough for one layout each."""
    prompts = [prompt_ids(n, seed=n) for n in prompt_lengths]
    return prompts, [p + prompt_ids(output_length, seed=100 + i) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteria")
    target, drafter, prompts, decode, trajectories, examples = tiny_campaign(root)
    return target, drafter, root, prompts, decode, trajectories, examples


def test_block_influence_and_angular_distance_match_a_hand_computation():
    """Layers replaced by identity, negation and a projection onto the first half of the hidden units: over
    the tokens, block influence is 1 - mean cos, and over the mask slots (whose inputs are all the mask
    token's embedding) the angular distance is arccos(cos) / pi of that embedding and its image."""
    drafter = build_tiny_drafter(num_hidden_layers=3, block_size=4)
    half = torch.zeros(32)
    half[:16] = 1.0
    for index, function in enumerate((lambda h: h, lambda h: -h, lambda h: h * half)):
        drafter.model.layers[index] = Map(function)
    prompts, trajs = trajectories((5, 9), output_length=7)
    result = layer_similarity(drafter, RankInputs(prompts, trajs, None, 0, batch_size=4))

    embed = drafter.model.embed_tokens.weight.detach().double()

    def projected_cosine(ids):  # cos(x, P x) = |P x| / |x| for the projection P
        rows = embed[ids]
        return rows[:, :16].norm(dim=-1) / rows.norm(dim=-1)

    # One layout per trajectory: its tokens, then (output - 1) anchors x 4 slots of the mask token.
    slots = sum((len(t) - len(p) - 1) * 4 for p, t in zip(prompts, trajs))
    tokens = torch.tensor([i for t in trajs for i in t])
    mask_cosine = float(projected_cosine(torch.tensor([97]))[0])
    mean_cosine = (float(projected_cosine(tokens).sum()) + slots * mask_cosine) / (len(tokens) + slots)

    influence = CRITERIA["block-influence"].rank(drafter, RankInputs(prompts, trajs, None, 0, 4))
    angular = CRITERIA["angular"].rank(drafter, RankInputs(prompts, trajs, None, 0, 4))
    assert influence == pytest.approx([0.0, 2.0, 1.0 - mean_cosine], abs=1e-9)
    assert angular == pytest.approx([0.0, 1.0, math.acos(mask_cosine) / math.pi], abs=1e-6)
    assert result.passes == 1
    assert 0 < mask_cosine < 1 and abs(mean_cosine - mask_cosine) > 1e-3  # the two row sets differ here


def test_a_one_pass_criterion_scores_every_layer_from_one_forward_pass_per_batch():
    drafter = build_tiny_drafter(num_hidden_layers=4, block_size=4)
    prompts, trajs = trajectories((3, 6, 8), output_length=10)
    passes, layer_calls = [], [0] * 4
    drafter.model.register_forward_pre_hook(lambda *_: passes.append(1))
    for index, layer in enumerate(drafter.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=index: layer_calls.__setitem__(i, layer_calls[i] + 1))
    for name in ("block-influence", "angular"):
        passes.clear()
        layer_calls[:] = [0] * 4
        report = scoring.score_layers(drafter, prompts, ScoreConfig(criterion=name, batch_size=2),
                                      trajectories=trajs)
        assert len(passes) == 2 and layer_calls == [2, 2, 2, 2]  # 3 layouts, 2 per batch: 2 passes for 4 layers
        assert CRITERIA[name].one_pass and report.base is None
        assert all(s.tau_without is None and s.delta_tau is None for s in report.layers)
        assert sorted(s.score for s in report.layers) == [s.score for s in report.ranking()]


def test_the_loss_criterion_costs_nothing_for_a_layer_that_does_nothing():
    """A layer whose attention and MLP outputs are zero passes its input on unchanged: without it the training
    loss is exactly the same; without any other layer it changes."""
    drafter = build_tiny_drafter(num_hidden_layers=3, block_size=4)
    with torch.no_grad():
        drafter.model.layers[1].self_attn.o_proj.weight.zero_()
        drafter.model.layers[1].mlp.down_proj.weight.zero_()
    _, trajs = trajectories((4, 6, 9), output_length=20)
    examples = [Example.from_prompt_response(t[:5], t[5:]) for t in trajs]
    rises = loss_without_each_layer(drafter, RankInputs([], None, examples, 0, 2))
    assert rises[1] == 0.0 and rises[0] != 0.0 and rises[2] != 0.0
    assert loss_without_each_layer(drafter, RankInputs([], None, examples, 0, 2)) == rises  # seeded batches


def test_random_is_reproducible_with_its_seed_and_keeps_its_order_in_a_pruned_drafter():
    drafter = build_tiny_drafter(num_hidden_layers=6, block_size=4)

    def order(model, seed):
        report = scoring.score_layers(model, [], ScoreConfig(criterion="random", seed=seed))
        return [s.original_layer for s in report.ranking()]

    first = order(drafter, 3)
    assert order(drafter, 3) == first and sorted(first) == list(range(6))
    assert order(drafter, 4) != first  # another seed, another order (fixed draws: this holds for seeds 3, 4)
    assert order(remove_layers(drafter, [first[0]]), 3) == first[1:]  # a pruned drafter continues the same order


def test_last_removes_from_the_top_in_order(campaign, tmp_path):
    target, drafter, root, prompts, decode, trajs, _ = campaign
    config = RunConfig(layers_to_remove=2, min_retention=0.01, stop_on_speedup=False, check_prompts=0,
                       score=ScoreConfig(criterion="last", decode=decode, timing_repeats=1),
                       heal=HealConfig(steps=0))
    state = run_pruning(Campaign(drafter, root / "source", prompts, target, trajs), tmp_path / "out", config,
                        hooks=RunHooks(log=lambda *_: None)).to_dict()
    assert [h["removed_original"] for h in state["history"]] == [[2], [1]]
    first = state["history"][0]
    assert [s["score"] for s in first["scores"]] == [2.0, 1.0, 0.0] and first["scores"][0]["tau_without"] is None
    assert first["tau"] > 0  # judged by the decoder, not read off the (unmeasured) score


def removals(monkeypatch) -> list:
    """Record the layers every reduced drafter of a scoring round is built without."""
    removed, real = [], scoring.without_layers
    monkeypatch.setattr(scoring, "without_layers", lambda model, layers: removed.append(list(layers)) or
                        real(model, layers))
    return removed


def test_a_prescreen_measures_only_the_layers_it_keeps_and_records_the_others_as_skipped(campaign, monkeypatch):
    _, drafter, _, prompts, decode, trajs, _ = campaign
    removed = removals(monkeypatch)
    config = ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20, prescreen="last", prescreen_keep=2)
    report = scoring.score_layers(drafter, prompts, config, trajectories=trajs)
    assert sorted(removed) == [[1], [2]]  # "last" keeps the top two; layer 0 is never evaluated
    skipped = [s for s in report.layers if s.skipped]
    assert [s.layer for s in skipped] == [0] and skipped[0].tau_without is None and skipped[0].score == 2.0
    assert [s.layer for s in report.ranking()][-1] == 0  # measured layers rank first
    assert all(s.tau_without is not None for s in report.layers if not s.skipped)
    assert report.settings["prescreen"] == "last" and report.settings["prescreen_keep"] == 2
    assert "skipped original layers 0" in ranking.skipped_note(report.to_dict())
    assert scoring.round_evaluations(config, 3, len(prompts)) == 2


def test_a_resumed_prescreened_round_measures_the_same_set(campaign, tmp_path, monkeypatch):
    _, drafter, _, prompts, decode, trajs, _ = campaign
    config = ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20, prescreen="last", prescreen_keep=2)

    def killed(name):
        if name == "score-layer":
            raise KeyboardInterrupt

    monkeypatch.setattr(scoring, "fault_point", killed)
    with pytest.raises(KeyboardInterrupt):  # after the pre-screen, the base and one layer are in the journal
        scoring.score_layers(drafter, prompts, config, trajectories=trajs,
                             journal=ScoringJournal(tmp_path / "scoring-01.json", "key"))
    saved = json.loads((tmp_path / "scoring-01.json").read_text())["layers"]
    assert saved["0"]["skipped"] is True and len(saved) == 2
    monkeypatch.setattr(scoring, "fault_point", lambda name: None)
    # A pre-screen that now ranks the other way round: the resumed round still measures the journal's set.
    monkeypatch.setitem(CRITERIA, "last", Ranking("last", "bottom up", lambda model, _: [0.0, 1.0, 2.0]))
    removed = removals(monkeypatch)
    report = scoring.score_layers(drafter, prompts, config, trajectories=trajs,
                                  journal=ScoringJournal(tmp_path / "scoring-01.json", "key"))
    assert removed == [[2]]  # only the layer the kill left unmeasured
    assert [s.layer for s in report.layers if s.skipped] == [0]
    fresh = scoring.score_layers(drafter, prompts, config, trajectories=trajs)
    assert [s.layer for s in fresh.layers if s.skipped] == [2]  # a new round follows the new ranking


def test_a_prescreened_run_records_the_skipped_layers_in_its_state(campaign, tmp_path):
    target, drafter, root, prompts, decode, trajs, _ = campaign
    config = RunConfig(layers_to_remove=1, min_retention=0.01, stop_on_speedup=False, check_prompts=0,
                       score=ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20, prescreen="block-influence",
                                         prescreen_keep=1), heal=HealConfig(steps=0))
    logged = []
    state = run_pruning(Campaign(drafter, root / "source", prompts, target, trajs), tmp_path / "out", config,
                        hooks=RunHooks(log=logged.append)).to_dict()
    scores = state["history"][0]["scores"]
    assert sum(s.get("skipped", False) for s in scores) == 2 and sum("skipped" not in s for s in scores) == 1
    (measured,) = [s for s in scores if "skipped" not in s]
    assert state["history"][0]["removed_original"] == [measured["original_layer"]]
    assert any("pre-screen by block-influence" in line for line in logged)


def test_bad_ranking_settings_fail_with_the_flag_to_fix():
    with pytest.raises(ConfigError, match="--loss-data"):
        ScoreConfig(criterion="loss").validate()
    with pytest.raises(ConfigError, match="--loss-data"):
        ScoreConfig(prescreen="loss").validate()
    with pytest.raises(ConfigError, match="nothing to pre-screen"):
        ScoreConfig(criterion="angular", prescreen="last").validate()
    with pytest.raises(ConfigError, match="--prescreen"):
        ScoreConfig(prescreen="tau").validate()
    with pytest.raises(ConfigError, match="--prescreen-keep"):
        RunConfig(per_step=3, score=ScoreConfig(prescreen="last", prescreen_keep=2)).validate(8)


def test_settings_a_round_does_not_read_stay_out_of_its_cache_key():
    plain = ScoreConfig(decode=DecodeConfig(max_new_tokens=8))
    assert "prescreen" not in plain.key_record() and "loss_data" not in plain.key_record()
    unread = ScoreConfig(decode=DecodeConfig(max_new_tokens=8), loss_data=("data",), prescreen_keep=3)
    assert unread.key_record() == plain.key_record()
    assert ScoreConfig(criterion="loss", loss_data=("data",)).key_record()["loss_data"] == ["data"]


def test_the_comparison_table_reads_retention_and_its_paired_error_off_the_benches(tmp_path):
    """scripts/criteria_compare.py: a drafter's held-out retention is the ratio of its mean per-prompt tau to the
    unpruned drafter's on the same prompts, with decode.metrics.paired_ratio_error as its standard error."""
    import importlib.util
    from pathlib import Path

    from decode.metrics import paired_ratio_error

    path = Path(__file__).resolve().parents[1] / "scripts" / "criteria_compare.py"
    spec = importlib.util.spec_from_file_location("criteria_compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    rows = {"base": {"tau_per_prompt": [3.0, 4.0, 5.0]}, "pruned": {"tau_per_prompt": [3.0, 3.0, 4.5]},
            "short": {"tau_per_prompt": [3.0, 3.0]}}
    kept = compare.retention(rows, "pruned", "base")
    assert kept["value"] == pytest.approx(10.5 / 12) and kept["prompts"] == 3
    assert kept["se"] == paired_ratio_error([3.0, 3.0, 4.5], [3.0, 4.0, 5.0]) > 0
    assert compare.retention(rows, "short", "base") is None  # unpaired lists give no retention
    document = {"base": {"drafter": "base", "humaneval:eval": 4.0},
                "rows": [{"name": "last", "removed": 1, "layers": [35], "scoring_wall_s": 0.5,
                          "retention": {"humaneval:eval": kept}}]}
    assert "| last | 1 | 35 | 87.5% ± " in compare.markdown(document)


def test_prune_score_prints_a_ranking_and_names_the_skipped_layers(tmp_path, capsys):
    from _pairs import save_tiny_pair
    from prune.cli import main

    root = save_tiny_pair(tmp_path, drafter_layers=3)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 9 + i))})
                                                  for i in range(3)))
    pair = ["--drafter", str(root / "drafter"), "--target", str(root / "target"), "--prompts",
            str(root / "prompts.jsonl"), "--max-new-tokens", "8", "--bootstrap", "20", "--cache-dir", str(tmp_path)]
    assert main(["score", *pair, "--criterion", "block-influence", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["base"] is None and [s["layer"] for s in report["layers"]] == [0, 1, 2]
    assert all(s["tau_without"] is None and s["score"] >= 0 for s in report["layers"])
    assert main(["score", *pair, "--criterion", "angular"]) == 0  # the table, without decoder columns
    assert "(angular), least harmful first" in capsys.readouterr().out
    assert main(["score", *pair, "--prescreen", "last", "--prescreen-keep", "2"]) == 0
    captured = capsys.readouterr()
    assert "pre-screen by last: tau measured for 2 layers; skipped original layers 0" in captured.err
    assert "skipped" in captured.out and "pre-screened by last" in captured.out
