"""Head steps of a pruning campaign (prune.head_steps): the head cut to a draft vocabulary beside layer steps,
judged by the same rules, exported, resumed after an interruption, and shown in the report."""

import json

import pytest
import torch

from _pairs import tiny_campaign
from conftest import export_interrupted_at
from models.draft_vocab import FILE, draft_vocab
from models.drafter import load_drafter
from models.errors import ConfigError
from prune.heal import HealConfig
from prune.progressive import Campaign, RunConfig, RunHooks, run_pruning
from prune.scoring import ScoreConfig
from prune.vocab import ranking_of


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("campaign")
    target, drafter, prompts, decode, trajectories, examples = tiny_campaign(root)
    answers = [t[len(p):] for p, t in zip(prompts, trajectories)]
    return target, drafter, root, prompts, decode, trajectories, examples, ranking_of(answers, drafter.config, ["t"])


def config_of(decode, **overrides) -> RunConfig:
    settings = dict(layers_to_remove=1, min_retention=0.05, stop_on_speedup=False, check_prompts=0,
                    vocab_sizes=(64, 40),
                    score=ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20),
                    heal=HealConfig(steps=2, rank=2, alpha=4, batch_size=2, lr=1e-3, min_drop=0.0))
    settings.update(overrides)
    return RunConfig(**settings)


def run(campaign, out, config, ranking="given", log=None, **kwargs):
    target, drafter, root, prompts, _, trajectories, examples, given = campaign
    ranking = given if ranking == "given" else ranking
    return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                vocab_ranking=ranking), out, config,
                       hooks=RunHooks(log=log or (lambda *_: None)), **kwargs).to_dict()


def test_head_steps_come_first_and_layer_steps_keep_the_cut_head(campaign, tmp_path):
    decode, ranking = campaign[4], campaign[7]
    state = run(campaign, tmp_path / "out", config_of(decode))
    kinds = [(h.get("head_rows"), h["layers"], h["removed"]) for h in state["history"]]
    assert kinds == [(64, 3, []), (40, 3, []), (None, 2, kinds[2][2])] and len(kinds[2][2]) == 1
    assert state["stopped_by"] == "layer budget" and state["vocab"] == ranking.record()
    ranked = ranking.ids.tolist()
    for step, rows in (("step-01", 64), ("step-02", 40), ("step-03", 40)):
        ids = draft_vocab(load_drafter(tmp_path / "out" / step)).tolist()
        assert len(ids) == rows and ids[: len(ranked)] == ranked  # the target's ids first, most said first
    final = load_drafter(tmp_path / "out" / "final")
    assert final.config.num_hidden_layers == 2 and len(draft_vocab(final)) == 40
    report = json.loads((tmp_path / "out" / "step-03" / "prune_report.json").read_text())
    assert report["draft_vocab"]["tokens"] == 40 and [h.get("head_rows") for h in report["history"]] == [64, 40, None]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| 1 | head: 64 ids | 3 |" in text and "| 2 | head: 40 ids | 3 |" in text and "Head steps cut" in text
    for plot in ("layer_scores.png", "tau_vs_layers_removed.png"):
        assert (tmp_path / "out" / plot).read_bytes()[:4] == b"\x89PNG"
    # the target's answers here hold fewer than 40 distinct ids: every cut holds them all, so tau is unchanged
    assert len(ranking.ids) < 40 and state["history"][1]["retention"] == pytest.approx(1.0)


def test_a_run_interrupted_in_a_head_step_resumes_to_the_same_steps(campaign, tmp_path, monkeypatch):
    decode = campaign[4]
    full = run(campaign, tmp_path / "full", config_of(decode))
    with export_interrupted_at(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        run(campaign, tmp_path / "resumed", config_of(decode))
    assert not (tmp_path / "resumed" / "step-02").exists()
    resumed = run(campaign, tmp_path / "resumed", config_of(decode), resume=True)

    def strip(h):
        return {k: v for k, v in h.items() if k not in ("scores", "predicted_speedup")}

    assert [strip(h) for h in resumed["history"]] == [strip(h) for h in full["history"]]
    for step in ("step-02", "step-03"):
        for name in (FILE, "model.safetensors"):
            assert (tmp_path / "resumed" / step / name).read_bytes() == (tmp_path / "full" / step / name).read_bytes()
    # the ranking is the run's: another one does not continue it
    other = ranking_of([[5, 5, 6]], campaign[1].config, ["other"])
    with pytest.raises(ConfigError, match="rank the ids of t, not those of other"):
        run(campaign, tmp_path / "resumed", config_of(decode), ranking=other, resume=True)


def test_a_head_step_the_rules_refuse_is_not_taken_and_layer_steps_follow(campaign, tmp_path):
    decode, ranking = campaign[4], campaign[7]
    said = set(ranking.ids.tolist())  # ranked backwards: the cut keeps only ids the target never says here
    backwards = ranking_of([[i] for i in range(97) if i not in said], campaign[1].config, ["backwards"])
    messages = []
    state = run(campaign, tmp_path / "out", config_of(decode, min_retention=0.5), ranking=backwards,
                log=messages.append)
    assert [h.get("head_rows") for h in state["history"]] == [None]  # one layer step, no head step
    refused = [m for m in messages if "is not taken (retention floor: cutting the head to 64 ids" in m]
    assert len(refused) == 2  # tried before the layer step and again after it
    assert draft_vocab(load_drafter(tmp_path / "out" / "final")) is None


def test_head_steps_without_a_ranking_are_refused_and_off_without_one(campaign, tmp_path):
    decode = campaign[4]
    with pytest.raises(ConfigError, match="Campaign.vocab_ranking"):
        run(campaign, tmp_path / "a", config_of(decode), ranking=None)
    state = run(campaign, tmp_path / "b", config_of(decode, vocab_sizes=()), ranking=None)
    assert [h.get("head_rows") for h in state["history"]] == [None] and "vocab" not in state
    # sizes at or above the ids the drafter proposes (97) offer no head step and need no ranking
    state = run(campaign, tmp_path / "c", config_of(decode, vocab_sizes=(2048, 97)), ranking=None)
    assert [h.get("head_rows") for h in state["history"]] == [None]
