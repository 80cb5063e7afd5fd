"""The progressive pruner: resume equals an uninterrupted run, harmful heals roll back, bad input fails clean."""

import json

import pytest
import torch

from _pairs import tiny_campaign
from conftest import export_interrupted_at
from models.errors import CheckpointError, ConfigError
from prune.heal import HealConfig
from prune.progressive import Campaign, RunConfig, RunHooks, run_pruning
from prune.scoring import ScoreConfig


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("campaign")
    target, drafter, prompts, decode, trajectories, examples = tiny_campaign(root)
    return target, drafter, root, prompts, decode, trajectories, examples


def config_of(decode, **overrides) -> RunConfig:
    settings = dict(layers_to_remove=2, min_retention=0.05, stop_on_speedup=False, check_prompts=0,
                    score=ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20),
                    heal=HealConfig(steps=3, rank=2, alpha=4, batch_size=2, lr=1e-3, min_drop=0.0))
    settings.update(overrides)
    return RunConfig(**settings)


def run(campaign, out, config, **kwargs):
    target, drafter, root, prompts, _, trajectories, examples = campaign
    return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples), out, config,
                       hooks=RunHooks(log=lambda *_: None), **kwargs).to_dict()


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_run_exports_steps_and_a_resumed_run_ends_identically(campaign, tmp_path, monkeypatch):
    decode = campaign[4]
    full = run(campaign, tmp_path / "full", config_of(decode))
    assert [h["layers"] for h in full["history"]] == [2, 1] and full["stopped_by"] == "layer budget"
    assert (tmp_path / "full" / "final").resolve() == (tmp_path / "full" / "step-02").resolve()
    report = (tmp_path / "full" / "report.md").read_text()
    assert "Stopped by: layer budget" in report and report.count("\n| ") >= 3
    for plot in ("layer_scores.png", "tau_vs_layers_removed.png", "heal_loss.png"):
        assert (tmp_path / "full" / plot).read_bytes()[:4] == b"\x89PNG"
    kept = json.loads((tmp_path / "full" / "step-02" / "config.json").read_text())["original_layer_indices"]
    removed = [i for h in full["history"] for i in h["removed_original"]]
    assert sorted(kept + removed) == [0, 1, 2]

    with export_interrupted_at(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        run(campaign, tmp_path / "resumed", config_of(decode))
    state = json.loads((tmp_path / "resumed" / "state.json").read_text())
    assert len(state["history"]) == 1 and not (tmp_path / "resumed" / "step-02").exists()
    resumed = run(campaign, tmp_path / "resumed", config_of(decode), resume=True)
    # Pass times are measured once per campaign (stored in its state, reused on resume); two campaigns
    # measure their own, so only the timing-derived numbers may differ between them.
    def strip(h):
        kept = {k: v for k, v in h.items() if k not in ("scores", "predicted_speedup")}
        return kept | {"scores": [(s["delta_tau"], s["ci_low"], s["ci_high"]) for s in h["scores"]]}

    assert [strip(h) for h in resumed["history"]] == [strip(h) for h in full["history"]]
    a, b = weights(tmp_path / "full" / "step-02"), weights(tmp_path / "resumed" / "step-02")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_campaign_continues_from_an_exported_step(campaign, tmp_path):
    """A pruned step is itself a drafter: pruning it again reports original indices and still plots."""
    from models.drafter import load_drafter

    target, _, _, prompts, decode, trajectories, examples = campaign
    first = run(campaign, tmp_path / "first", config_of(decode, layers_to_remove=1))
    step = tmp_path / "first" / "step-01"
    kept = json.loads((step / "config.json").read_text())["original_layer_indices"]
    second = run_pruning(Campaign(load_drafter(step), step, prompts, target, trajectories, examples),
                         tmp_path / "second", config_of(decode, layers_to_remove=1),
                         hooks=RunHooks(log=lambda *_: None)).to_dict()
    assert second["history"][0]["removed_original"][0] in kept
    assert first["history"][0]["removed_original"][0] not in kept
    assert (tmp_path / "second" / "layer_scores.png").read_bytes()[:4] == b"\x89PNG"


def test_a_heal_that_hurts_is_rolled_back(campaign, tmp_path):
    decode = campaign[4]
    ruinous = HealConfig(steps=4, rank=8, alpha=512, batch_size=2, lr=0.5, min_drop=0.0)
    state = run(campaign, tmp_path / "out", config_of(decode, layers_to_remove=1, heal=ruinous))
    step = state["history"][0]
    assert step["heal_rolled_back"] is True and step["tau"] == step["tau_before_heal"]


def test_a_step_is_healed_only_when_its_drafter_lost_enough_of_the_unpruned_tau(campaign, tmp_path):
    decode = campaign[4]
    logged = []
    target, drafter, root, prompts, _, trajectories, examples = campaign
    config = config_of(decode, heal=HealConfig(steps=3, rank=2, alpha=4, batch_size=2, lr=1e-3, min_drop=0.0))
    every = run(campaign, tmp_path / "every", config)
    assert all(h["heal_loss"] for h in every["history"])  # min_drop 0: every step healed
    config.heal.min_drop = 1.0  # nothing loses all of its tau: no step healed
    never = run(campaign, tmp_path / "never", config)
    assert not any(h["heal_loss"] for h in never["history"])
    # Each step's loss is measured against the unpruned tau, not against the step before: the first step
    # that lost any, `k`, is healed by a threshold just below its loss and not by one just above it, while
    # the steps before it (which gained tau) are healed by neither.
    lost = [1 - h["tau_before_heal"] / never["base"]["tau"] for h in never["history"]]
    k = next(i for i, value in enumerate(lost) if value > 1e-3)
    for margin, healed in ((1e-6, False), (-1e-6, True)):
        config.heal.min_drop = lost[k] + margin
        logged.clear()
        out = tmp_path / f"some{margin}"
        some = run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples), out,
                           config, hooks=RunHooks(log=logged.append)).to_dict()
        assert [h["removed_original"] for h in some["history"][:k + 1]] == \
            [h["removed_original"] for h in never["history"][:k + 1]]
        assert [bool(h["heal_loss"]) for h in some["history"][:k + 1]] == [False] * k + [healed]
        step = some["history"][k]
        assert healed or step["tau"] == step["tau_before_heal"]
        said = [line for line in logged if line.startswith(f"step {k + 1}: the drafter keeps")]
        assert len(said) == 1 and ("healing (3 LoRA updates" in said[0]) == healed != ("not healed" in said[0])
        if not healed:
            assert "| not needed |" in (out / "report.md").read_text()


def test_steps_are_judged_on_the_check_prompts(campaign, tmp_path, monkeypatch):
    from _pairs import prompt_ids
    from models.drafter import load_drafter
    from models.surgery import remove_layers
    from prune.scoring import evaluate, rank_key, record_trajectories

    target, drafter, root, prompts, decode, trajectories, examples = campaign
    checks = [prompt_ids(n, seed=100 + n) for n in (4, 9)]
    config = config_of(decode, layers_to_remove=1, check_prompts=2, check_tokens=decode.max_new_tokens + 8)
    check_trajectories = record_trajectories(target, checks, config.check_score.decode)
    logged = []
    state = run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                 check_prompts=checks, check_trajectories=check_trajectories),
                        tmp_path / "out", config, hooks=RunHooks(log=logged.append))
    # The unpruned and the step's tau (before and after its heal) are those of the check prompts, decoded to
    # --check-tokens, not of the calibration prompts that scored the layers; the report and the log say so.
    step, judged = state.history[0], config.check_score
    assert judged.decode.max_new_tokens == decode.max_new_tokens + 8 and config.score.decode == decode
    assert state.base.tau == evaluate(drafter, checks, judged, check_trajectories).tau
    assert state.base.tau != evaluate(drafter, prompts, config.score, trajectories).tau
    assert state.base.tau != evaluate(drafter, checks, config.score, record_trajectories(target, checks, decode)).tau
    assert step.tau == evaluate(load_drafter(tmp_path / "out" / "step-01"), checks, judged, check_trajectories).tau
    assert step.tau_before_heal == evaluate(remove_layers(drafter, step.removed), checks, judged,
                                            check_trajectories).tau
    assert state.judged_on == "check" and "judged (tau, retention, heals, stop rules) on the check prompts" in \
        (tmp_path / "out" / "report.md").read_text()
    assert any(line.startswith("step 1: the drafter keeps") and "of the unpruned check tau" in line
               for line in logged)
    # A campaign whose check prompts are not the settings' count, or lack trajectories to replay, is refused.
    for wrong, trajectories_of_checks in ((checks[:1], check_trajectories[:1]), (checks, None)):
        with pytest.raises(ConfigError, match="check"):
            run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                 check_prompts=wrong, check_trajectories=trajectories_of_checks),
                        tmp_path / "refused", config)
    assert not (tmp_path / "refused").exists()

    # The lowest-scoring layer loses more of the check tau than the floor allows and the next one does not: with
    # one candidate the run stops there, with three the step removes the next one, unhealed.
    def judged_run(out, candidates, discount=0.0):
        config = config_of(decode, layers_to_remove=1, check_prompts=2, check_tokens=decode.max_new_tokens + 8,
                           check_candidates=candidates,
                           check_try_discount=discount, min_retention=0.9, heal=HealConfig(steps=0))
        return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                    check_prompts=checks, check_trajectories=check_trajectories),
                           tmp_path / out, config, hooks=RunHooks(log=logged.append))

    logged.clear()
    taken, only = judged_run("three", 3), judged_run("one", 1)
    scores = taken.history[0].scores
    ranking = [s.layer for s in sorted(scores, key=rank_key(scores))]

    def kept(layer):
        return evaluate(remove_layers(drafter, [layer]), checks, judged, check_trajectories).tau / state.base.tau

    assert kept(ranking[0]) < 0.9 <= kept(ranking[1])
    assert taken.history[0].removed == [ranking[1]] and taken.history[0].retention == kept(ranking[1])
    assert any("trying original layers" in line for line in logged)
    assert only.history == [] and only.stopped_by.startswith("retention floor")

    # Without heals and under a floor that every try clears, a step still does not keep a try that lost the
    # heal threshold (--heal-min-drop, 1 %) while another may not: it takes the first that lost less, else the
    # best of its tries (the lowest-scoring layer alone, as a run that took the first passing try would).
    def run_without_floor(out):
        config = config_of(decode, layers_to_remove=1, check_prompts=2, check_tokens=decode.max_new_tokens + 8,
                           check_candidates=3, check_try_discount=0.0, min_retention=0.5,
                           heal=HealConfig(steps=0))
        return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                    check_prompts=checks, check_trajectories=check_trajectories),
                           tmp_path / out, config, hooks=RunHooks(log=logged.append))

    tries = ranking[:3]
    cheap = [layer for layer in tries if 1 - kept(layer) < HealConfig().min_drop]
    best = cheap[0] if cheap else max(tries, key=kept)
    assert best != ranking[0]
    assert run_without_floor("unhealed").history[0].removed == [best]

    # The second try is the better of two reads on the check prompts: judged at its tau lowered by the optimism
    # of the best of two (0.564 standard errors of its paired retention, times --check-try-discount), it is
    # taken when that still clears the floor and not when it does not; the state keeps what it read. (The tiny
    # pair's two check prompts measure no error, so the run is given one.)
    from prune import progressive
    from prune.scoring import expected_best_of

    monkeypatch.setattr(progressive, "retention_error", lambda candidate, base: 0.05)
    fits = (kept(ranking[1]) - 0.9) / (expected_best_of(2) * 0.05)  # the discount that lands on the floor
    logged.clear()
    lenient, strict = judged_run("lenient", 2, discount=fits / 2), judged_run("strict", 2, discount=fits * 2)
    assert lenient.history[0].removed == [ranking[1]] and lenient.history[0].retention == kept(ranking[1])
    assert any("judged at" in line and "--check-try-discount" in line for line in logged)
    assert strict.history == [] and strict.stopped_by.startswith("retention floor")


def test_retention_floor_stops_before_the_step(campaign, tmp_path):
    decode = campaign[4]
    state = run(campaign, tmp_path / "out", config_of(decode, min_retention=1.0, heal=HealConfig(steps=0)))
    assert state["history"] == [] or all(h["retention"] >= 1.0 for h in state["history"])
    assert state["stopped_by"] == "layer budget" or state["stopped_by"].startswith("retention floor")


def test_bad_inputs_fail_cleanly(campaign, tmp_path):
    decode = campaign[4]
    with pytest.raises(ConfigError, match="--layers-to-remove 3"):
        run(campaign, tmp_path / "a", config_of(decode, layers_to_remove=3))
    with pytest.raises(ConfigError, match="--min-retention"):
        run(campaign, tmp_path / "b", config_of(decode, min_retention=1.5))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="not empty"):
        run(campaign, tmp_path / "c", config_of(decode))
    assert (tmp_path / "c" / "keep.txt").read_text() == "user data"


def test_a_resumed_run_computes_in_the_runs_dtype(campaign, tmp_path, monkeypatch):
    """A campaign in bfloat16 (on the CPU here; the device travels the same way) resumes from its last
    exported step loaded in bfloat16, not in the float32 on the CPU that load_drafter defaults to."""
    import copy

    from prune import progressive

    target, drafter, root, prompts, decode, trajectories, _ = campaign
    half = copy.deepcopy(drafter).to(torch.bfloat16)
    config = config_of(decode, heal=HealConfig(steps=0))

    def campaign_run(**kwargs):
        return run_pruning(Campaign(half, root / "source", prompts, target, trajectories), tmp_path / "out", config,
                           hooks=RunHooks(log=lambda *_: None), **kwargs).to_dict()

    with export_interrupted_at(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        campaign_run()
    scored, real_cached_scores = [], progressive.cached_scores

    def cached_scores(cache, model, *args, **kwargs):
        scored.append(next(model.parameters()).dtype)
        return real_cached_scores(cache, model, *args, **kwargs)

    monkeypatch.setattr(progressive, "cached_scores", cached_scores)
    state = campaign_run(resume=True)
    assert len(state["history"]) == 2 and scored == [torch.bfloat16]  # step 2 scored step-01 as the run computes


def test_a_scoring_round_is_continued_only_on_the_device_and_dtype_it_began_on(campaign, tmp_path, monkeypatch):
    import prune.scoring as scoring
    from prune import progressive

    config = config_of(campaign[4], layers_to_remove=1, heal=HealConfig(steps=0))

    def killed(name):
        if name == "score-layer":
            raise KeyboardInterrupt

    monkeypatch.setattr(scoring, "fault_point", killed)
    with pytest.raises(KeyboardInterrupt):  # after the round's base and first layer are in its journal
        run(campaign, tmp_path / "out", config)
    assert list((tmp_path / "out").glob("scoring-*.json"))
    monkeypatch.setattr(scoring, "fault_point", lambda name: None)
    evaluated, real_evaluate, real_identity = [], scoring.evaluate, progressive.model_identity
    monkeypatch.setattr(scoring, "evaluate", lambda *a, **k: evaluated.append(1) or real_evaluate(*a, **k))
    monkeypatch.setattr(progressive, "model_identity", lambda model: [*real_identity(model)[:2], "cuda:0"])
    run(campaign, tmp_path / "out", config, resume=True)
    assert len(evaluated) == 4  # the base and all three layers again: the journal was another device's


def test_later_rounds_screen_by_the_previous_rounds_scores(campaign, tmp_path):
    """Step 2's round scores the previous round's lowest layer afresh and carries the other's score (renumbered,
    one round older) while the fresh one stays below it; with carry_screen off it screens every layer."""
    decode = campaign[4]
    screening = ScoreConfig(decode=decode, timing_repeats=1, bootstrap=20, screen_prompts=2, screen_keep=1)
    carried = run(campaign, tmp_path / "carried", config_of(decode, score=screening, heal=HealConfig(steps=0)))
    afresh = run(campaign, tmp_path / "afresh", config_of(decode, score=screening, heal=HealConfig(steps=0),
                                                           carry_screen=False))
    first, second = carried["history"]
    assert first["removed_original"] == afresh["history"][0]["removed_original"]
    assert all("age" not in s for s in first["scores"] + afresh["history"][1]["scores"])
    left = [s for s in first["scores"] if s["layer"] not in first["removed"]]
    candidate = min(left, key=lambda s: ((s["prompts"] or 3) < 3, s["score"], s["layer"]))
    by_original = {s["original_layer"]: s for s in second["scores"]}
    assert "age" not in by_original[candidate["original_layer"]]  # scored afresh, on every prompt
    assert by_original[candidate["original_layer"]]["prompts"] == 3
    (other,) = [s for s in left if s is not candidate]
    carried_score = by_original[other["original_layer"]]
    # The candidate still scores below the carried score here, so that score is kept as it was.
    assert carried_score["age"] == 1 and carried_score["score"] == other["score"]
    assert carried_score["layer"] == other["layer"] - sum(r < other["layer"] for r in first["removed"])
    assert by_original[candidate["original_layer"]]["score"] <= other["score"]
    assert second["removed_original"] == [candidate["original_layer"]]


def test_a_step_is_taken_while_its_predicted_speedup_stays_within_the_tolerance_of_the_best():
    from prune.progressive import _stop_rule
    from prune.state import BaseRecord, RunState, StepRecord

    def step(number, speedup, retention=1.0):
        return StepRecord(number, f"step-{number:02d}", [0], [number], 4 - number, 2.0, 2.0 * retention, retention,
                          False, speedup, [], [])

    state = RunState({}, "source", None, BaseRecord(2.0, 0.1, 1.30), [step(1, 1.35), step(2, 1.34)])
    tolerant, strict = RunConfig(speedup_tolerance=0.01), RunConfig(speedup_tolerance=0.0)
    assert _stop_rule(tolerant, state, step(3, 1.34)) is None  # 0.7 % below step 1's 1.35
    assert _stop_rule(tolerant, state, step(3, 1.33)) == (
        "predicted speedup more than 1.0% below the best (1.330 <= 1.350, step 1)")
    assert _stop_rule(strict, state, step(3, 1.35)) == "predicted speedup below the best (1.350 <= 1.350, step 1)"
    assert _stop_rule(strict, state, step(3, 1.36)) is None
    assert _stop_rule(RunConfig(stop_on_speedup=False), state, step(3, 0.5)) is None
    assert _stop_rule(tolerant, state, step(3, 1.5, retention=0.98)).startswith("retention floor")
    first = RunState({}, "source", None, BaseRecord(2.0, 0.1, 1.30), [])
    assert "the unpruned drafter" in _stop_rule(tolerant, first, step(1, 1.28))
    with pytest.raises(ConfigError, match="--speedup-tolerance"):
        RunConfig(speedup_tolerance=1.0).validate(4)


def test_a_run_records_its_heal_data_and_resumes_only_on_the_same(campaign, tmp_path):
    target, drafter, root, prompts, decode, trajectories, examples = campaign
    config = config_of(decode, layers_to_remove=1)

    def healed_on(heal_data, out="out", config=config, **kwargs):
        return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories, examples,
                                    heal_data=heal_data), tmp_path / out, config,
                           hooks=RunHooks(log=lambda *_: None), **kwargs)

    mix = ["data/a x1", "data/b x2"]
    state = healed_on(mix)
    assert state.heal_data == mix and json.loads((tmp_path / "out" / "state.json").read_text())["heal_data"] == mix
    assert "Heals on: data/a x1, data/b x2." in (tmp_path / "out" / "report.md").read_text()
    with pytest.raises(ConfigError, match=r"heals on data/a x1, data/b x2, not on data/a x1; resume it with"):
        healed_on(["data/a x1"], resume=True)
    assert healed_on(mix, resume=True).to_dict() == state.to_dict()
    # A run that does not heal records no heal data, whatever its campaign names.
    unhealed = healed_on(mix, "unhealed", config_of(decode, layers_to_remove=1, heal=HealConfig(steps=0)))
    assert unhealed.heal_data is None and "heal_data" not in unhealed.to_dict()


def test_a_run_records_the_machine_it_measured_on_and_a_resume_elsewhere_says_so(campaign, tmp_path, monkeypatch):
    from prune import state as state_module
    from prune.state import Host, RunState

    target, drafter, root, prompts, decode, trajectories, examples = campaign
    config = config_of(decode, layers_to_remove=1, heal=HealConfig(steps=0))
    logs = []

    def pruned(**kwargs):
        return run_pruning(Campaign(drafter, root / "source", prompts, target, trajectories), tmp_path / "out",
                           config, hooks=RunHooks(log=logs.append), **kwargs)

    host = pruned().host
    assert host == Host.of(drafter, target) and host.target_dtype == "float32" and host.threads >= 1
    record = json.loads((tmp_path / "out" / "state.json").read_text())
    assert record["host"]["cpu"] == host.cpu and RunState.from_dict(record).host == host
    assert f"Measured on: {host.text()}." in (tmp_path / "out" / "report.md").read_text()
    del record["host"]  # a record written before hosts were recorded still reads
    assert RunState.from_dict(record).host is None and "host" not in RunState.from_dict(record).to_dict()

    monkeypatch.setattr(state_module, "cpu_name", lambda: "Another CPU")
    pruned(resume=True)
    notes = [line for line in logs if line.startswith("note:") and "was started on" in line]
    assert len(notes) == 1 and host.text() in notes[0] and "this is Another CPU" in notes[0]
    assert json.loads((tmp_path / "out" / "state.json").read_text())["host"]["cpu"] == host.cpu
