"""Trajectories from a recorded file of the target's outputs (prune.trajectories, --ar-outputs): `prune score`,
`prune run` and `prune sweep` score as with the live target without ever reading its weights, and a file that
does not match the prompts is refused with the record named."""

import json
import shutil

import pytest

from _pairs import save_tiny_pair
from decode.timing import PINNED_TIMES_ENV
from prune.cli import main

LAYER_FIELDS = ("layer", "tau_without", "delta_tau", "ci_low", "ci_high", "score", "fallback_rate", "verify_width")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, pinned_times_file):
    """A tiny pair, 3 prompts, the target's outputs of them recorded by `prune bench --save-outputs` (16 tokens)
    with the pass times of that run (the tests' pinned ones), and two copies of the target folder that hold
    everything but readable weights: one whose model.safetensors is garbage, one without it."""
    root = save_tiny_pair(tmp_path_factory.mktemp("recorded"), drafter_layers=2)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 9 + i))})
                                                  for i in range(3)))
    with pytest.MonkeyPatch.context() as patched:
        patched.setenv(PINNED_TIMES_ENV, str(pinned_times_file))
        assert main(["bench", *models(root), "--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "16",
                     "--decoder", "ar", "--save-outputs", str(root / "ar.jsonl"), "--cache-dir", str(root / "cache"),
                     "--json", str(root / "bench.json")]) == 0
    for name in ("broken", "absent"):
        shutil.copytree(root / "target", root / name)
    (root / "broken" / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    (root / "absent" / "model.safetensors").unlink()
    return root


def models(root, target: str = "target") -> list[str]:
    return ["--drafter", str(root / "drafter"), "--target", str(root / target)]


def score_args(root, target: str, cache, *extra) -> list[str]:
    return ["score", *models(root, target), "--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "12",
            "--bootstrap", "50", "--cache-dir", str(cache), "--no-wandb", "--json", "-", *extra]


@pytest.fixture
def no_target_weights(monkeypatch):
    """Fail the test wherever the target's weights would load."""
    def refuse(*_, **__):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr("models.target.load_target", refuse)
    monkeypatch.setattr("models.pair.load_target", refuse)


def error_of(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("Error: ") and "Traceback" not in err
    return err


def test_score_from_recorded_outputs_never_reads_the_targets_weights(pair, tmp_path, capsys, monkeypatch):
    # The live target scores (its pass times are those bench measured: the same cache).
    assert main(score_args(pair, "target", pair / "cache")) == 0
    live = json.loads(capsys.readouterr().out)
    fixed = ("--width", "fixed", "--candidates", "all")
    assert main(score_args(pair, "target", pair / "cache", *fixed)) == 0
    live_fixed = json.loads(capsys.readouterr().out)

    with monkeypatch.context() as patched:
        def refuse(*_, **__):
            raise AssertionError("the target's weights were loaded")

        patched.setattr("models.target.load_target", refuse)
        patched.setattr("models.pair.load_target", refuse)
        for target in ("broken", "absent"):
            # From the recorded outputs with the recorded pass times: the live target's scores, layer by layer.
            recorded = score_args(pair, target, tmp_path / target, "--ar-outputs", str(pair / "ar.jsonl"),
                                  "--pass-times", str(pair / "bench.json"))
            assert main(recorded) == 0
            captured = capsys.readouterr()
            report = json.loads(captured.out)
            assert "its weights are not loaded" in captured.err
            assert report["base"]["tau_per_prompt"] == live["base"]["tau_per_prompt"]
            assert [[s[k] for k in LAYER_FIELDS] for s in report["layers"]] == \
                [[s[k] for k in LAYER_FIELDS] for s in live["layers"]]
            assert report["settings"]["trajectories"]["kind"] == "recorded file"
            assert report["settings"]["decode"]["width_policy"] == live["settings"]["decode"]["width_policy"]
            # Without pass times (none given, none pinned): fixed widths and every candidate (said so), as the live
            # target scores them.
            patched.delenv(PINNED_TIMES_ENV, raising=False)
            assert main(score_args(pair, target, tmp_path / target, "--ar-outputs", str(pair / "ar.jsonl"))) == 0
            captured = capsys.readouterr()
            bare = json.loads(captured.out)
            assert "note: no pass times" in captured.err and bare["base_predicted_speedup"] is None
            assert [[s[k] for k in LAYER_FIELDS] for s in bare["layers"]] == \
                [[s[k] for k in LAYER_FIELDS] for s in live_fixed["layers"]]
        # The score cache is keyed by the recorded file and the target's config (not where its folder lies): a
        # run with the other copy of the target reads the last one's scores.
        import prune.scoring

        patched.setattr(prune.scoring, "score_layers", lambda *a, **k: pytest.fail("a cached score recomputed"))
        assert main(score_args(pair, "broken", tmp_path / "absent", "--ar-outputs", str(pair / "ar.jsonl"),
                               "--pass-times", str(pair / "bench.json"))) == 0
        assert json.loads(capsys.readouterr().out)["layers"] == report["layers"]
        # The speedup criterion needs pass times: refused before anything is scored, the fix named.
        assert "--pass-times" in error_of(capsys, score_args(pair, "broken", tmp_path / "c", "--ar-outputs",
                                                             str(pair / "ar.jsonl"), "--criterion", "speedup"))


def test_a_recorded_file_that_does_not_match_the_prompts_is_refused(pair, tmp_path, capsys, no_target_weights):
    lines = [json.loads(line) for line in (pair / "ar.jsonl").read_text().splitlines()]
    assert [line["decoder"] for line in lines] == ["ar"] * 3 and lines[2]["prompt_ids"] == list(range(5, 11))

    def refusal(records, *extra) -> str:
        file = tmp_path / "recorded.jsonl"
        file.write_text("".join(json.dumps(record) + "\n" for record in records))
        return error_of(capsys, score_args(pair, "broken", tmp_path / "c", "--ar-outputs", str(file), *extra))

    def without(record, *keys):
        return {k: v for k, v in record.items() if k not in keys}

    # Matched by position (no ids): too few records, or record 3's prompt is not prompt 3.
    assert "holds 2 records for 3 prompts (none for prompt 3, id 'p2')" in refusal(
        [without(line, "id") for line in lines[:2]])
    other = [without(line, "id") for line in lines]
    other[2]["prompt_ids"] = other[2]["prompt_ids"][:-1] + [42]
    assert "record 3 (" in refusal(other) and "its prompt ids differ from prompt 3's (id 'p2'" in refusal(other)
    # Matched by id: a prompt without its record, a record of another prompt.
    assert "no record for prompt 'p1'" in refusal([lines[0], lines[2]])
    swapped = [dict(lines[0], id="p1"), dict(lines[1], id="p0"), lines[2]]
    assert "record 2 (" in refusal(swapped) and "prompt 1's (id 'p0'" in refusal(swapped)
    # An output recorded with a smaller cap than the one scoring asks for; a record without output ids.
    assert "--max-new-tokens" in refusal(lines, "--max-new-tokens", "40")
    assert ":2: a record needs output_ids" in refusal([lines[0], without(lines[1], "output_ids"), lines[2]])
    # Another engine's file: ids and outputs only, in order, is read as the target's.
    engine = [{"prompt_ids": line["prompt_ids"], "output_ids": line["output_ids"]} for line in lines]
    (tmp_path / "engine.jsonl").write_text("".join(json.dumps(record) + "\n" for record in engine))
    assert main(score_args(pair, "broken", tmp_path / "c", "--ar-outputs", str(tmp_path / "engine.jsonl"))) == 0
    capsys.readouterr()


def run_args(root, target: str, out, *extra) -> list[str]:
    # --limit 1: one calibration prompt, the other two judge the step, decoding 16 tokens each (the recorded cap).
    return ["run", *models(root, target), "--prompts", str(root / "prompts.jsonl"), "--limit", "1",
            "--max-new-tokens", "12", "--check-tokens", "16", "--out", str(out), "--layers-to-remove", "1",
            "--min-retention", "0.01", "--no-stop-on-speedup", "--heal-steps", "0", "--cache-dir", str(root / "cache"),
            "--no-wandb", "--json", "-", *extra]


def test_run_from_recorded_outputs_takes_the_live_targets_steps_and_loads_it_only_for_the_speed_check(
        pair, tmp_path, capsys, monkeypatch):
    assert main(run_args(pair, "target", tmp_path / "live", "--speed-prompts", "0")) == 0
    live = json.loads(capsys.readouterr().out)
    recorded = ("--ar-outputs", str(pair / "ar.jsonl"), "--pass-times", str(pair / "bench.json"))
    import models.pair
    import models.target

    loads = []
    load_target = models.target.load_target
    monkeypatch.setattr(models.pair, "load_target", lambda *a: pytest.fail("the pair loaded the target's weights"))
    monkeypatch.setattr(models.target, "load_target", lambda *a: loads.append(a) or load_target(*a))
    assert main(run_args(pair, "absent", tmp_path / "recorded", *recorded, "--speed-prompts", "0")) == 0
    state = json.loads(capsys.readouterr().out)
    assert loads == []
    for key in ("removed", "removed_original", "tau_before_heal", "tau", "retention"):
        assert state["history"][0][key] == live["history"][0][key]
    assert state["base"]["tau"] == live["base"]["tau"]
    # The speed check needs the live target: loaded then, after the steps, and said so.
    assert main(run_args(pair, "target", tmp_path / "checked", *recorded, "--speed-prompts", "1",
                         "--speed-suite", str(pair / "prompts.jsonl"))) == 0
    captured = capsys.readouterr()
    assert len(loads) == 1 and json.loads(captured.out)["speed"]["base"]["exact"] is True
    err = captured.err
    assert err.index("step 1: removed") < err.index("loading the target's weights for the speed check")
