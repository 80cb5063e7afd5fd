"""Head steps of a pruning campaign (prune.head_steps): the head cut to a draft vocabulary beside layer steps,
judged by the same rules, exported, resumed after an interruption, and shown in the report."""

import json
from dataclasses import replace

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
    # proposing from the cut alone: context ids (decode.engine.ContextIds) would give back what the target says
    alone = config_of(decode, min_retention=0.5)
    alone = replace(alone, score=replace(alone.score, decode=replace(decode, context_vocab=False)))
    state = run(campaign, tmp_path / "out", alone, ranking=backwards, log=messages.append)
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


# The command line: prune run with head steps killed mid-step, and the ids through prune export and prune heal

from test_faults import forked, heal_args, pair, run_args  # noqa: E402,F401 - `pair`: the tiny pair fixture

HEAD_ARGS = ("--vocab-sizes", "64,40", "--layers-to-remove", "1")
# Where a kill lands, in the order the run reaches these points; each kill is followed by the next `--resume`
# (counts are per process): head step 1's export, the state write that records it, head step 2's export,
# the scoring round of the layer step.
HEAD_KILLS = ("write:step-01", "write:state.json", "write:step-02", "score-layer")


def test_a_run_with_head_steps_killed_anywhere_resumes_to_the_same_bytes(pair, tmp_path):
    from prune.cli import main

    reference = tmp_path / "reference"
    code, err = forked(main, run_args(pair, reference, *HEAD_ARGS))
    assert code == 0, err
    state = json.loads((reference / "state.json").read_text())
    assert [h.get("head_rows") for h in state["history"]] == [64, 40, None]
    assert state["config"]["vocab_sizes"] == [64, 40] and state["vocab"]["source"] == [str(pair / "heal")]
    out = tmp_path / "out"
    for point in HEAD_KILLS:
        code, err = forked(main, run_args(pair, out, *HEAD_ARGS, "--resume"), kill_at=point)
        assert code == -9, f"not killed at {point}: {err}"
        recorded = len(json.loads((out / "state.json").read_text())["history"]) if (out / "state.json").exists() else 0
        if point == "write:step-01":
            assert not (out / "step-01").exists() and recorded == 0
        elif point == "write:state.json":  # the head step exported, its ids with it, the state not yet written
            assert len(draft_vocab(load_drafter(out / "step-01"))) == 64 and recorded == 0
        elif point == "write:step-02":
            assert recorded == 1 and not (out / "step-02").exists()
    code, err = forked(main, run_args(pair, out, *HEAD_ARGS, "--resume"))
    assert code == 0, err
    ours = json.loads((out / "state.json").read_text())
    timed = ("predicted_speedup", "draft_pass_ms", "packed_pass_ms")

    def strip(h):
        return {k: v for k, v in h.items() if k not in (*timed, "scores")}

    assert [strip(h) for h in ours["history"]] == [strip(h) for h in state["history"]]
    for record in state["history"]:
        for name in ("model.safetensors", FILE, "config.json"):
            assert (out / record["folder"] / name).read_bytes() == (reference / record["folder"] / name).read_bytes()

    # The ids survive a re-export and a heal of the final drafter, and a resume with other data is refused.
    ids = draft_vocab(load_drafter(reference / "final"))
    assert main(["export", str(reference / "final"), str(tmp_path / "exported"), "--dtype", "float32"]) == 0
    assert torch.equal(draft_vocab(load_drafter(tmp_path / "exported")), ids)
    code, err = forked(main, heal_args(pair, reference / "final", tmp_path / "healed"))
    assert code == 0, err
    healed = load_drafter(tmp_path / "healed")
    assert torch.equal(draft_vocab(healed), ids) and healed.config.draft_vocab["tokens"] == 40
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "decoder": "ar", "output_ids": [5, 5, 6]}) + "\n")
    code, err = forked(main, run_args(pair, out, *HEAD_ARGS, "--resume", "--vocab-data", str(other)))
    assert code == 1 and "rank the ids of" in err, err


def test_a_sweep_searches_the_smallest_draft_vocabulary():
    from types import SimpleNamespace

    from sweeps.config import SweepConfig
    from sweeps.objective import campaign_config, check_space
    from sweeps.space import SearchSpace

    space = SearchSpace.from_file()  # the default space searches it
    assert space.params["vocab_size"].choices == [0, 8192, 4096, 2048]
    config = SweepConfig(study="s", out="o")
    sizes = {floor: campaign_config({"vocab_size": floor}, config)[0].vocab_sizes for floor in (0, 8192, 2048)}
    assert sizes == {0: (), 8192: (32768, 16384, 8192), 2048: (32768, 16384, 8192, 4096, 2048)}
    assert campaign_config({}, config)[0].vocab_sizes == config.vocab_sizes  # not in the space: every size
    data = SimpleNamespace(drafter=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=36)), calibration=[0] * 16,
                           heal_examples=[1], vocab_ranking=None)
    assert "vocab_size" not in check_space(space, data).params  # no ranking: nothing to search
