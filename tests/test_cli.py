"""The `prune` CLI: help, JSON output, exit codes and one-line errors for bad input."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from _pairs import save_tiny_pair
from conftest import build_tiny_drafter
from models.drafter import save_drafter
from models.provenance import FILE, overlap, prompt_set, read_training_prompts, training_prompts_text
from prune.cli import main


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=2)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 9 + i))}) for i in range(3)))
    return root


def bench_args(root, *extra):
    return ["bench", "--drafter", str(root / "drafter"), "--target", str(root / "target"),
            "--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "12", *extra]


def test_help_lists_working_commands_without_importing_torch():
    code = "import sys; from prune.cli import build_parser; h = build_parser().format_help(); " \
           "print(h); assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for command in ("bench", "score", "run", "export", "validate", "distill", "train-drafter"):
        assert command in out
    help_text = subprocess.run([sys.executable, "-m", "prune", "bench", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "--max-new-tokens" in help_text.stdout and "default: 128" in help_text.stdout


def test_bench_json_report(pair_dirs, capsys, tmp_path):
    outputs = tmp_path / "out.jsonl"
    assert main(bench_args(pair_dirs, "--json", "-", "--save-outputs", str(outputs))) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 3 and set(report["decoders"]) == {"ar", "sync", "async", "pld", "generate"}
    assert report["settings"]["drafter"] == str(pair_dirs / "drafter") and report["settings"]["drafter_layers"] == 2
    for name in ("sync", "async"):
        entry = report["decoders"][name]
        assert entry["exact_match_vs_ar"] is True
        for key in ("tau_macro", "tau_micro", "tokens_per_s", "time_per_token_ms", "speedup_vs_ar",
                    "acceptance_histogram", "per_position_acceptance"):
            assert key in entry
        assert entry["speedup_error"] >= 0  # over the 3 prompts, ar's decode times paired with this decoder's
        # the measured round and the modelled one, in the units the prediction is made of
        assert entry["round_ms"] == pytest.approx(1000 * entry["decode_s"] / entry["rounds"])
        ar_ms = next(iter(report["settings"]["pass_times"].values()))["ar_ms"]
        # live: the speculation gate is on, and the prediction mixes its target steps into the drafting rounds
        gated = entry["gated_share"]
        assert report["settings"]["decode"]["gate_policy"] is not None and 0 <= gated < 1
        tokens = (1 - gated) * entry["tau_micro"] + gated
        spent = (1 - gated) * entry["predicted_round_ms"] + gated * ar_ms
        assert entry["predicted_speedup"] == pytest.approx(ar_ms * tokens / spent)
    for name in ("pld", "generate"):  # transformers' greedy generate() agrees with our ar in float32
        entry = report["decoders"][name]
        assert entry["exact_match_vs_ar"] is True and entry["tau_macro"] is None
        assert entry["time_per_token_ms"] is not None and entry["speedup_vs_ar"] is not None
    assert report["decoders"]["ar"]["exact_match_vs_ar"] is None
    for key in ("hit_rate", "fallback_rate", "packed_tokens_mean", "time_split_ms"):
        assert key in report["decoders"]["async"]
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert len(lines) == 15 and {line["decoder"] for line in lines} == {"ar", "sync", "async", "pld", "generate"}
    assert {line["id"] for line in lines} == {"p0", "p1", "p2"}
    speculative = [line for line in lines if line["decoder"] in ("sync", "async")]
    assert {line.get("drafter") for line in speculative} == {str(pair_dirs / "drafter")}
    assert sum("drafter" in line for line in lines) == len(speculative) == 6


@pytest.mark.parametrize("gate", ["off", "adaptive"])
def test_bench_replay_matches_live_tau(pair_dirs, capsys, gate):
    """Under the same settings (the gate defaults differ: adaptive live, off under replay) a replay makes the
    live decoder's decisions: the same tau, hits and gated rounds."""
    keys = ("tau_per_prompt", "hit_rate", "hit_rate_by_outcome", "gated_share")
    main(bench_args(pair_dirs, "--decoder", "async", "--gate", gate, "--json", "-"))
    live = json.loads(capsys.readouterr().out)["decoders"]["async"]
    main(bench_args(pair_dirs, "--decoder", "async", "--gate", gate, "--verify", "replay", "--json", "-"))
    replay = json.loads(capsys.readouterr().out)["decoders"]["async"]
    assert {key: replay[key] for key in keys} == {key: live[key] for key in keys}
    assert replay["speedup_vs_ar"] is None


def test_bench_replay_batch_equals_one_prompt_at_a_time(pair_dirs, capsys, tmp_path):
    reports, outputs = [], []
    for batch in ("1", "2"):
        saved = tmp_path / f"out-{batch}.jsonl"
        main(bench_args(pair_dirs, "--verify", "replay", "--replay-batch", batch, "--json", "-",
                        "--save-outputs", str(saved)))
        reports.append(json.loads(capsys.readouterr().out))
        outputs.append(sorted(saved.read_text().splitlines()))
    one, lockstep = reports
    assert lockstep["settings"]["replay_batch"] == 2 and outputs[0] == outputs[1]
    for name in ("sync", "async"):
        for key in ("tau_per_prompt", "tau_macro", "acceptance_histogram", "exact_match_vs_ar"):
            assert lockstep["decoders"][name][key] == one["decoders"][name][key]
        assert one["decoders"][name]["time_per_token_ms"] is not None
        assert lockstep["decoders"][name]["time_per_token_ms"] is None
    assert lockstep["decoders"]["async"]["hit_rate"] == one["decoders"]["async"]["hit_rate"]
    assert lockstep["decoders"]["ar"]["time_per_token_ms"] is not None


def test_bench_reuses_recorded_ar_outputs(pair_dirs, capsys, tmp_path):
    saved = tmp_path / "ar.jsonl"
    main(bench_args(pair_dirs, "--verify", "replay", "--json", "-", "--save-outputs", str(saved)))
    fresh = json.loads(capsys.readouterr().out)
    main(bench_args(pair_dirs, "--verify", "replay", "--replay-batch", "3", "--ar-outputs", str(saved), "--json", "-"))
    reused = json.loads(capsys.readouterr().out)
    assert reused["settings"]["ar_outputs"] == str(saved)
    for name in ("sync", "async"):
        for key in ("tau_per_prompt", "acceptance_histogram", "exact_match_vs_ar", "exact_match_prompts"):
            assert reused["decoders"][name][key] == fresh["decoders"][name][key]
    assert reused["decoders"]["ar"]["output_tokens"] == fresh["decoders"]["ar"]["output_tokens"]
    assert reused["decoders"]["ar"]["time_per_token_ms"] is None

    # A smaller cap reads the recorded outputs cut to it, as a run with that cap decodes them.
    main(bench_args(pair_dirs, "--verify", "replay", "--decoder", "ar,async", "--json", "-")
         + ["--max-new-tokens", "5"])
    short = json.loads(capsys.readouterr().out)
    main(bench_args(pair_dirs, "--verify", "replay", "--decoder", "ar,async", "--ar-outputs", str(saved), "--json", "-")
         + ["--max-new-tokens", "5"])
    cut = json.loads(capsys.readouterr().out)
    assert cut["decoders"]["ar"]["output_tokens"] == short["decoders"]["ar"]["output_tokens"]
    assert cut["decoders"]["async"]["tau_per_prompt"] == short["decoders"]["async"]["tau_per_prompt"]
    # A larger cap than recorded, a live run, or a file without some prompt: refused with the fix named.
    assert "--max-new-tokens" in error_of(capsys, bench_args(pair_dirs, "--verify", "replay", "--ar-outputs",
                                                             str(saved)) + ["--max-new-tokens", "40"])
    assert "--verify replay" in error_of(capsys, bench_args(pair_dirs, "--ar-outputs", str(saved)))
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(line + "\n" for line in saved.read_text().splitlines() if '"p1"' not in line))
    assert "'p1'" in error_of(capsys, bench_args(pair_dirs, "--verify", "replay", "--ar-outputs", str(partial)))


@pytest.fixture(scope="module")
def second_drafter(pair_dirs):
    """Another drafter for the pair's target: one layer, blocks of 3."""
    return str(save_drafter(build_tiny_drafter(num_hidden_layers=1, block_size=3, seed=1), pair_dirs / "drafter-b"))


def test_bench_several_drafters_share_one_ar_run(pair_dirs, second_drafter, capsys, tmp_path, monkeypatch):
    import decode.decoders  # where decode.registry finds the ar decoder

    ar_runs, decode_ar = [], decode.decoders.decode_ar
    monkeypatch.setattr(decode.decoders, "decode_ar", lambda *args: ar_runs.append(1) or decode_ar(*args))
    first, saved = str(pair_dirs / "drafter"), tmp_path / "out.jsonl"
    assert main(bench_args(pair_dirs, "--drafter", second_drafter, "--json", "-", "--save-outputs", str(saved))) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(ar_runs) == 1 + 3  # the warm-up and once per prompt, not once per drafter
    assert set(report) == {"drafters", "baselines", "prompts", "settings"}
    assert set(report["baselines"]) == {"ar", "pld", "generate"}
    assert report["baselines"]["pld"]["exact_match_vs_ar"] is True
    pass_times = report["settings"]["pass_times"]  # both drafters from one measurement with one of the target
    assert set(pass_times) == {first, second_drafter} and len({t["ar_ms"] for t in pass_times.values()}) == 1
    assert [(e["drafter"], e["layers"], e["block_size"]) for e in report["drafters"]] == [(first, 2, 4),
                                                                                       (second_drafter, 1, 3)]
    for entry in report["drafters"]:
        assert set(entry["decoders"]) == {"sync", "async"}
        for summary in entry["decoders"].values():
            assert summary["exact_match_vs_ar"] is True and summary["speedup_vs_ar"] is not None
    # The second drafter against the first: ratios of their rows from this one run.
    rows = [entry["decoders"] for entry in report["drafters"]]
    assert "against_first" not in report["drafters"][0] and set(report["drafters"][1]["against_first"]) == {"sync", "async"}
    for name, ratios in report["drafters"][1]["against_first"].items():
        first_row, second_row = rows[0][name], rows[1][name]
        assert ratios == pytest.approx({"speedup_ratio": second_row["speedup_vs_ar"] / first_row["speedup_vs_ar"],
                                        "tau_ratio": second_row["tau_macro"] / first_row["tau_macro"],
                                        "equal_tau_speedup": (first_row["drafting_round_ms"]
                                                              / second_row["drafting_round_ms"])})
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(lines) == 3 * 7 and {(line["decoder"], line.get("drafter")) for line in lines} == {
        ("ar", None), ("pld", None), ("generate", None),
        *((decoder, drafter) for decoder in ("sync", "async") for drafter in (first, second_drafter))}

    # Each drafter measures as it does alone, also in lockstep replay from the recorded ar outputs (no ar decoding),
    # the speculation gate (on by default only when live) making the live decoder's decisions.
    alone = bench_args(pair_dirs, "--decoder", "async", "--verify", "replay", "--gate", "adaptive", "--json", "-")
    alone[alone.index("--drafter") + 1] = second_drafter
    assert main(alone) == 0
    second_alone = json.loads(capsys.readouterr().out)["decoders"]["async"]
    assert main(bench_args(pair_dirs, "--drafter", second_drafter, "--verify", "replay", "--replay-batch", "2",
                           "--gate", "adaptive", "--ar-outputs", str(saved), "--json", "-")) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert len(ar_runs) == 2 * 4 and set(replayed["baselines"]) == {"ar"}  # the alone run's, none more
    for live, lockstep in zip(report["drafters"], replayed["drafters"]):
        for name in ("sync", "async"):
            for key in ("tau_per_prompt", "acceptance_histogram", "exact_match_vs_ar"):
                assert lockstep["decoders"][name][key] == live["decoders"][name][key]
    assert second_alone["tau_per_prompt"] == report["drafters"][1]["decoders"]["async"]["tau_per_prompt"]

    # The table has a row per drafter and decoder.
    assert main(bench_args(pair_dirs, "--drafter", second_drafter, "--decoder", "ar,async", "--json",
                           str(tmp_path / "report.json"))) == 0
    table = capsys.readouterr().out
    assert "drafter" in table and table.count("async") == 3  # two rows and the line against the first drafter
    assert "drafter-b against drafter, async: " in table and "of its tau" in table


def test_bench_with_draft_trees_is_exact_and_replay_reproduces_live(pair_dirs, capsys, tmp_path):
    saved = tmp_path / "out.jsonl"
    assert main(bench_args(pair_dirs, "--decoder", "ar,sync,async", "--tree-branches", "2", "--gate", "off",
                           "--save-outputs", str(saved), "--json", "-")) == 0
    live = json.loads(capsys.readouterr().out)
    assert live["settings"]["decode"]["tree_branches"] == 2
    assert main(bench_args(pair_dirs, "--decoder", "sync,async", "--verify", "replay", "--tree-branches", "2",
                           "--ar-outputs", str(saved), "--json", "-")) == 0
    replayed = json.loads(capsys.readouterr().out)
    for name in ("sync", "async"):
        assert live["decoders"][name]["exact_match_vs_ar"] is True
        for key in ("tau_per_prompt", "acceptance_histogram", "verify_width_mean"):
            assert replayed["decoders"][name][key] == live["decoders"][name][key]
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(pair_dirs, "--tree-branches", "-1"))
    assert exit_info.value.code == 2 and "--tree-branches" in capsys.readouterr().err


def test_bench_baselines_and_decoder_lists(pair_dirs, second_drafter, capsys, tmp_path):
    assert main(bench_args(pair_dirs, "--decoder", "ar,pld", "--pld-tokens", "3", "--json", "-")) == 0
    report = json.loads(capsys.readouterr().out)  # one drafter: the single-table layout
    assert set(report) == {"decoders", "prompts", "settings"} and set(report["decoders"]) == {"ar", "pld"}
    assert report["decoders"]["pld"]["exact_match_vs_ar"] is True
    assert report["settings"]["baselines"] == {"pld_tokens": 3}
    # Named explicitly, a baseline runs on the live target under replay; `all` leaves it out there.
    assert main(bench_args(pair_dirs, "--decoder", "generate", "--verify", "replay", "--json", "-")) == 0
    generate = json.loads(capsys.readouterr().out)["decoders"]["generate"]
    assert generate["exact_match_vs_ar"] is True and generate["speedup_vs_ar"] is not None
    assert main(bench_args(pair_dirs, "--temperature", "0.5", "--json", "-")) == 0
    assert set(json.loads(capsys.readouterr().out)["decoders"]) == {"ar", "sync", "async"}

    assert "greedy" in error_of(capsys, bench_args(pair_dirs, "--decoder", "ar,pld", "--temperature", "0.5"))
    assert "--pld-tokens" in usage_error_of(capsys, bench_args(pair_dirs, "--decoder", "pld", "--pld-tokens", "0"))
    assert "given twice" in error_of(capsys, bench_args(pair_dirs, "--drafter", str(pair_dirs / "drafter")))
    other = build_tiny_drafter(vocab_size=60, mask_token_id=59, draft_vocab_size=59)
    save_drafter(other, tmp_path / "small")
    assert "vocabulary mismatch" in error_of(capsys, bench_args(pair_dirs, "--drafter", str(tmp_path / "small")))
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(pair_dirs, "--decoder", "ar,fast"))
    assert exit_info.value.code == 2


def error_of(capsys, argv) -> str:
    """The one-line error of a command that fails (exit 1): its last line of stderr, after any progress lines."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    *progress, last = err.splitlines()
    assert last.startswith("Error: ") and "Traceback" not in err and not any("Error" in line for line in progress)
    return last


def usage_error_of(capsys, argv) -> str:
    """The one-line usage error (exit 2) of a flag refused by its argument type (tests/test_flags.py has them all)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "Traceback" not in err
    return err


def test_bad_prompt_files(pair_dirs, capsys, tmp_path):
    missing = bench_args(pair_dirs)
    missing[missing.index("--prompts") + 1] = str(tmp_path / "nope.jsonl")
    assert "does not exist" in usage_error_of(capsys, missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3\n')
    args = bench_args(pair_dirs)
    args[args.index("--prompts") + 1] = str(bad)
    assert "bad.jsonl:2" in error_of(capsys, args)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"input_ids": [5] * 600}) + "\n")
    args[args.index("--prompts") + 1] = str(long)
    assert "--max-new-tokens" in error_of(capsys, args)


def test_unknown_decoder_is_a_usage_error(pair_dirs):
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(pair_dirs, "--decoder", "fast"))
    assert exit_info.value.code == 2


def test_incompatible_pair_and_bad_settings(pair_dirs, capsys, tmp_path):
    other = build_tiny_drafter(vocab_size=60, mask_token_id=59, draft_vocab_size=59)
    save_drafter(other, tmp_path / "small")
    args = bench_args(pair_dirs)
    args[args.index("--drafter") + 1] = str(tmp_path / "small")
    assert "vocabulary mismatch" in error_of(capsys, args)
    assert "replay" in error_of(capsys, bench_args(pair_dirs, "--verify", "replay", "--temperature", "0.5"))
    assert "block size" in error_of(capsys, bench_args(pair_dirs, "--block-size", "9"))
    assert "--verify replay" in error_of(capsys, bench_args(pair_dirs, "--replay-batch", "4"))


def test_validate_command(pair_dirs, capsys, tmp_path):
    assert main(["validate", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
                 "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == 2 and summary["compatible_with_target"] is True
    assert "does not exist" in usage_error_of(capsys, ["validate", "--drafter", str(tmp_path / "missing")])


def test_debug_shows_traceback(pair_dirs, tmp_path):
    import shutil

    from models.errors import D3DError

    shutil.copytree(pair_dirs / "drafter", tmp_path / "drafter")
    (tmp_path / "drafter" / "model.safetensors").unlink()
    with pytest.raises(D3DError):
        main(["validate", "--drafter", str(tmp_path / "drafter"), "--debug"])
    assert torch.__version__  # the in-process CLI ran with torch available


def test_missing_demo_drafter_is_a_clear_error(pair_dirs, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("models.demo.DEMO_DRAFTER_DIR", tmp_path / "no-demo-drafter")
    args = bench_args(pair_dirs)
    del args[1:3]  # no --drafter: the demo drafter is used
    assert "demo drafter is missing" in error_of(capsys, args)


def test_prompt_source_flags_are_exclusive(pair_dirs):
    with pytest.raises(SystemExit) as exit_info:
        main(bench_args(pair_dirs, "--suite", "humaneval"))
    assert exit_info.value.code == 2


def test_score_json_and_cache(pair_dirs, capsys, tmp_path, monkeypatch):
    args = ["score", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
            "--prompts", str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--bootstrap", "50",
            "--cache-dir", str(tmp_path), "--json", "-"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert [s["layer"] for s in first["layers"]] == [0, 1]
    assert first["settings"]["prompts"] == 3 and first["base"]["tau"] >= 1
    import prune.scoring

    def fail(*_, **__):
        raise AssertionError("a cached score must not be recomputed")

    monkeypatch.setattr(prune.scoring, "score_layers", fail)
    monkeypatch.setattr(prune.scoring, "record_trajectories", fail)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == first["layers"]


def test_score_measures_with_the_decoder_it_is_given(pair_dirs, capsys, tmp_path):
    """--decoder sync scores layers by the sync decoder's tau: its base is what bench measures for sync with the
    same pass times; the default, async, bench's async."""
    common = ["--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"), "--prompts",
              str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--cache-dir", str(tmp_path), "--json", "-"]
    assert main(["bench", *common, "--decoder", "sync,async", "--verify", "replay"]) == 0
    bench = json.loads(capsys.readouterr().out)["decoders"]
    for decoder in ("sync", "async"):
        assert main(["score", *common, "--bootstrap", "20", "--no-wandb", "--decoder", decoder]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["settings"]["decoder"] == report["base"]["decoder"] == decoder
        assert report["base"]["tau_per_prompt"] == bench[decoder]["tau_per_prompt"]
    assert "invalid choice" in usage_error_of(capsys, ["score", *common, "--decoder", "ar"])


@pytest.mark.parametrize("moved", ["device", "dtype"])
def test_every_cache_key_holds_the_device_and_the_dtype(pair_dirs, capsys, tmp_path, monkeypatch, moved):
    """Trajectories, pass times and layer scores cached for one device or dtype are not reused for another
    (near-tie argmaxes and pass times differ across them): the same command with the models placed
    elsewhere computes all three again."""
    import decode.timing
    import prune.cache
    import prune.scoring

    args = ["score", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
            "--prompts", str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--bootstrap", "20",
            "--cache-dir", str(tmp_path), "--json", "-"]
    assert main(args) == 0
    calls = []

    def counted(name, function):
        return lambda *a, **k: calls.append(name) or function(*a, **k)

    for module, name in ((prune.scoring, "record_trajectories"), (prune.scoring, "score_layers"),
                         (decode.timing, "measure_drafters")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    assert main(args) == 0 and calls == []  # all three cached
    identity = prune.cache.model_identity
    elsewhere = {"device": lambda model: [*identity(model)[:2], "cuda:0"],
                 "dtype": lambda model: [identity(model)[0], "torch.bfloat16", identity(model)[2]]}[moved]
    monkeypatch.setattr(prune.cache, "model_identity", elsewhere)
    assert main(args) == 0
    assert sorted(set(calls)) == ["measure_drafters", "record_trajectories", "score_layers"]
    capsys.readouterr()


def test_run_resume_and_bad_inputs(pair_dirs, capsys, tmp_path):
    base = ["run", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
            "--prompts", str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(tmp_path / "out"),
            "--min-retention", "0.01", "--no-stop-on-speedup"]
    assert main(base + ["--layers-to-remove", "1", "--json", "-", "--speed-suite", str(pair_dirs / "prompts.jsonl"),
                        "--speed-prompts", "2"]) == 0
    captured = capsys.readouterr()
    state, captured_err = json.loads(captured.out), captured.err
    assert len(state["history"]) == 1 and state["stopped_by"] == "layer budget"
    # The measured speed check: both drafters exact against ar on the held-out prompts, in the report too.
    speed = state["speed"]
    assert speed["prompts"] == 2 and speed["base"]["exact"] is True and speed["final"]["exact"] is True
    for name in ("base", "final"):
        assert speed[name]["measured_speedup"] > 0 and speed[name]["predicted_speedup"] > 0
        assert speed[name]["measured_speedup_error"] >= 0  # two prompts: a standard error of their paired times
    measured = next(line for line in captured_err.splitlines() if line.startswith("measured speedup: "))
    assert measured.count(" +- ") == 2, measured
    # ... with the held-out retention's standard error over those prompts
    tau_ratio = speed["final"]["tau"] / speed["base"]["tau"]
    assert speed["retention_error"] >= 0 and f"retention {tau_ratio:.4f} +- " in captured_err
    report = (tmp_path / "out" / "report.md").read_text()
    assert "measured speedup" in report and f"Held-out tau retention {tau_ratio:.4f} +- " in report
    assert (tmp_path / "out" / "step-01" / "prune_report.json").is_file()
    assert "not empty" in error_of(capsys, base + ["--layers-to-remove", "1"])
    assert main(base + ["--layers-to-remove", "1", "--resume"]) == 0
    capsys.readouterr()
    refused = error_of(capsys, base + ["--layers-to-remove", "1", "--seed", "1", "--resume"])
    assert "another --out" in refused
    assert "(heal.seed: 0 in the run, 1 given; score.seed: 0 in the run, 1 given)" in refused
    # --check-tokens 0 is the setting of runs saved before the flag: as many tokens as --max-new-tokens
    refused = error_of(capsys, base + ["--layers-to-remove", "1", "--check-tokens", "0", "--resume"])
    assert "check_tokens: 128 in the run, None given" in refused
    fresh = [a if a != str(tmp_path / "out") else str(tmp_path / "new") for a in base]
    assert "--layers-to-remove 2" in error_of(capsys, fresh + ["--layers-to-remove", "2"])
    assert "--min-retention" in usage_error_of(capsys, fresh[:-3] + ["--min-retention", "0"])
    # --resume on a folder that holds no run starts one, so a job script can always pass it (issue 17).
    assert main(fresh + ["--resume", "--speed-prompts", "0"]) == 0
    assert f"{tmp_path / 'new'} holds no pruning run yet; starting one" in capsys.readouterr().err

    capsys.readouterr()
    assert main(["export", str(tmp_path / "out" / "final"), str(tmp_path / "bf16"), "--dtype", "bfloat16",
                 "--json", "-"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["dtype"] == "bfloat16" and exported["destination"] == str(tmp_path / "bf16")
    assert exported["layers"] == json.loads((tmp_path / "bf16" / "config.json").read_text())["num_hidden_layers"]
    assert exported["weights_bytes"] == (tmp_path / "bf16" / "model.safetensors").stat().st_size
    from safetensors import safe_open

    from prune.export import verify_export

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}
    assert verify_export(tmp_path / "bf16") == []
    assert json.loads((tmp_path / "bf16" / "prune_report.json").read_text())["history"][0]["step"] == 1
    assert "not empty" in error_of(capsys, ["export", str(tmp_path / "out" / "final"), str(tmp_path / "bf16")])


def test_bench_on_an_exported_step_reproduces_its_tau(pair_dirs, capsys, tmp_path):
    # --limit 1: the first prompt calibrates, the other two are the check prompts that judge the step.
    common = ["--target", str(pair_dirs / "target"), "--max-new-tokens", "12"]
    run = ["run", "--drafter", str(pair_dirs / "drafter"), *common, "--prompts", str(pair_dirs / "prompts.jsonl"),
           "--layers-to-remove", "1", "--min-retention", "0.01", "--no-stop-on-speedup", "--json", "-",
           "--speed-prompts", "0", "--check-tokens", "20"]
    assert main(run + ["--out", str(tmp_path / "out"), "--limit", "1"]) == 0
    captured = capsys.readouterr()
    state = json.loads(captured.out)
    assert state["config"]["check_prompts"] == 2 and "fewer than --check-prompts 24" in captured.err
    checks = tmp_path / "checks.jsonl"
    checks.write_text("".join((pair_dirs / "prompts.jsonl").read_text().splitlines(keepends=True)[1:]))
    for folder, tau in (("step-01", state["history"][0]["tau"]), (None, state["base"]["tau"])):
        drafter = str(tmp_path / "out" / folder) if folder else str(pair_dirs / "drafter")
        # the check prompts decode --check-tokens 20, not the calibration's --max-new-tokens 12
        assert main(["bench", "--drafter", drafter, "--target", str(pair_dirs / "target"), "--max-new-tokens", "20",
                     "--prompts", str(checks), "--decoder", "async", "--verify", "replay", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["decoders"]["async"]["tau_macro"] == pytest.approx(tau)
    # With no prompt beyond the calibration prompts the steps are judged on those, and the run says so.
    assert main(run + ["--out", str(tmp_path / "all")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["check_prompts"] == 0
    assert "holds no prompt beyond the 3 calibration prompts" in captured.err


def test_disk_error_during_export_fails_cleanly_and_resumes(pair_dirs, capsys, tmp_path, monkeypatch):
    import errno

    import prune.export

    args = ["run", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
            "--prompts", str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(tmp_path / "out"),
            "--layers-to-remove", "1", "--min-retention", "0.01", "--no-stop-on-speedup"]

    def full_disk(*_, **__):  # the step's files are written: hashing them is the last thing in the atomic write
        raise OSError(errno.ENOSPC, "No space left on device")

    real = prune.export.folder_hashes
    monkeypatch.setattr(prune.export, "folder_hashes", full_disk)
    assert "No space left on device" in error_of(capsys, args)
    # The step is not there and no temporary folder is left; the finished scoring round's journal is kept.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["scoring-01.json", "state.json"]
    monkeypatch.setattr(prune.export, "folder_hashes", real)
    assert main(args + ["--resume"]) == 0
    assert (tmp_path / "out" / "step-01" / "model.safetensors").is_file()


def test_train_drafter_command_from_an_initial_drafter(tmp_path, capsys):
    from models.drafter import load_drafter

    data = tmp_path / "data"
    data.mkdir()
    gen = torch.Generator().manual_seed(0)
    records = [{"id": str(i), "prompt": f"question {i}", "prompt_ids": torch.randint(0, 97, (5,), generator=gen).tolist(),
                "response_ids": torch.randint(0, 97, (20,), generator=gen).tolist()} for i in range(10)]
    (data / "shard-00000.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (data / "manifest.json").write_text(json.dumps({"shards": 1, "max_new_tokens": 20}))
    save_drafter(build_tiny_drafter(num_hidden_layers=2, block_size=4), tmp_path / "init",
                 extra_files={FILE: training_prompts_text([prompt_set("earlier", ["an older prompt"])])})
    args = ["train-drafter", "--data", str(data), "--init-from", str(tmp_path / "init"), "--out",
            str(tmp_path / "trained"), "--steps", "3", "--batch-size", "2", "--eval-size", "2", "--eval-every", "0",
            "--checkpoint-every", "0", "--warmup-steps", "1", "--no-progress", "--device", "cpu"]
    capsys.readouterr()
    assert main(args + ["--json", "-"]) == 0
    provenance = json.loads((tmp_path / "trained" / "training.json").read_text())
    assert provenance["train_sequences"] == 8 and provenance["settings"]["steps"] == 3
    summary = json.loads(capsys.readouterr().out)  # --json -: the run in brief, from training.json
    assert summary["out"] == str(tmp_path / "trained") and summary["steps"] == 3
    assert summary["train_sequences"] == 8 and summary["heldout_sequences"] == 2
    assert summary["final_eval"] == provenance["final_eval"] and "json" not in provenance["settings"]
    assert load_drafter(tmp_path / "trained").config.num_hidden_layers == 2
    # What it was trained on: the initial drafter's record, then the data folder's 10 prompts.
    sets = read_training_prompts(tmp_path / "trained")
    assert [(s["name"], s["prompts"]) for s in sets] == [("earlier", 1), ("data", 10)]
    assert overlap(sets, ["question 3", "an older prompt", "new"])[0] == 2
    config = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert config["training_prompt_sets"] == [{k: s[k] for k in ("name", "prompts", "sha256")} for s in sets]
    capsys.readouterr()
    assert "not empty" in error_of(capsys, args)
    # --keep-best with --eval-data: the saved weights are those of the best evaluation, named in training.json.
    best_args = [*args[:args.index("--out")], "--out", str(tmp_path / "best"), *args[args.index("--out") + 2:],
                 "--keep-best", "--eval-data", str(data), "--eval-every", "1"]
    assert main(best_args) == 0
    provenance = json.loads((tmp_path / "best" / "training.json").read_text())
    proxies = {r["step"]: r["eval_accept_proxy"] for r in provenance["history"] if "eval_accept_proxy" in r}
    assert sorted(proxies) == [1, 2, 3] and provenance["train_sequences"] == 8
    assert provenance["kept_best"] == {"step": max(proxies, key=proxies.get),
                                       "eval_accept_proxy": max(proxies.values())}


def test_train_drafter_splits_idle_layers_of_an_initial_drafter(tmp_path, capsys):
    from models.drafter import load_drafter

    init = build_tiny_drafter(num_hidden_layers=5, block_size=4)
    with torch.no_grad():  # layer 3 never learned: an identity
        init.model.layers[3].self_attn.o_proj.weight.zero_()
        init.model.layers[3].mlp.down_proj.weight.zero_()
    save_drafter(init, tmp_path / "init")
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text(json.dumps({"id": "0", "prompt_ids": [5, 6], "response_ids": [7] * 9}) + "\n")
    (data / "manifest.json").write_text(json.dumps({"shards": 1, "max_new_tokens": 9}))
    args = ["train-drafter", "--data", str(data), "--init-from", str(tmp_path / "init"), "--split-idle", "1",
            "--save-initial", str(tmp_path / "split")]
    assert main(args) == 0
    assert "layers [3] replaced by halves of layers [2]" in capsys.readouterr().err
    split = load_drafter(tmp_path / "split")
    assert split.config.num_hidden_layers == 5 and list(split.config.original_layer_indices) == list(range(5))
    half = init.model.layers[2].mlp.down_proj.weight / 2
    assert all(torch.equal(split.model.layers[i].mlp.down_proj.weight, half.to(torch.bfloat16).float())
               for i in (2, 3))
    assert "with --init-from" in error_of(capsys, ["train-drafter", "--data", str(data), "--split-idle", "1",
                                                    "--out", str(tmp_path / "x")])


def test_train_drafter_keep_best_returns_the_weights_of_the_best_evaluation(tmp_path):
    from prune.training.driver import BestWeights
    from prune.training.loss import causal_lm

    model = build_tiny_drafter(num_hidden_layers=1, block_size=4)
    scores = {1: 0.5, 2: 2.0, 3: 1.0}  # the proxy peaks at step 2, then falls
    weights = {}

    def evaluate(step, m):
        with torch.no_grad():
            causal_lm(m).model.norm.weight.fill_(float(step))  # a visible mark of the step's weights
        weights[step] = causal_lm(m).model.norm.weight.clone()
        return {"eval_accept_proxy": scores[step]}

    best = BestWeights(tmp_path / "ckpt", resuming=False)
    recording = best.wrap(evaluate)
    for step in scores:
        assert recording(step, model) == {"eval_accept_proxy": scores[step]}
    assert best.restore(model) == {"step": 2, "eval_accept_proxy": 2.0}
    assert torch.equal(causal_lm(model).model.norm.weight, weights[2])
    # A resumed run remembers the best so far; a fresh run in the same folder forgets it.
    assert (BestWeights(tmp_path / "ckpt", resuming=True).step, BestWeights(tmp_path / "ckpt", True).score) == (2, 2.0)
    assert BestWeights(tmp_path / "ckpt", resuming=False).restore(model) == {}


def test_train_drafter_weights_several_data_folders_and_never_trains_on_held_out_ones(tmp_path, capsys):
    from models.errors import ConfigError, DataError
    from prune.training.data import split_examples
    from prune.training.driver import data_weights

    folders = []
    for name, count, target in (("a", 6, "t1"), ("b", 4, "t1"), ("c", 3, "t2")):
        folder = tmp_path / name
        folder.mkdir()
        records = [{"id": f"{name}{i}", "prompt_ids": [1, len(folders) * 100 + i],
                    "response_ids": [len(folders) * 10 + i, 5]} for i in range(count)]
        if name == "b":  # every prompt of "a" again, answered apart from a near-tie at the end: a held-out
            # draw of either must drop both, as answers made in another dtype or on another CPU differ so
            records += [{"id": f"b-a{i}", "prompt_ids": [1, i], "response_ids": [i, 6]} for i in range(6)]
        (folder / "shard-00000.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        (folder / "manifest.json").write_text(json.dumps({"shards": 1, "target_weights_sha256": target}))
        folders.append(folder)
    heldout, training = split_examples(folders[:2], [1, 3], eval_size=3, seed=0)
    key = lambda ex: tuple(ex.input_ids[~ex.loss_mask].tolist())  # noqa: E731  (the prompt)
    held = {key(ex) for ex in heldout}
    assert len(held) == 3 and not held & {key(ex) for ex in training}
    counts = {}
    for ex in training:
        counts[key(ex)] = counts.get(key(ex), 0) + 1
    # A prompt of "a" is trained on once from "a" and three times from its copy in "b".
    assert all(n == (4 if k[1] < 100 else 3) for k, n in counts.items()) and len(counts) == 7
    again = split_examples(folders[:2], [1, 3], eval_size=3, seed=0)[0]
    assert [key(ex) for ex in again] == [key(ex) for ex in heldout]  # seeded
    # --eval-data: held out from that folder alone, the same draw whatever --data holds; never trained on.
    heldout, training = split_examples(folders[:2], [1, 3], eval_size=2, seed=0, eval_folder=folders[1])
    held = {key(ex) for ex in heldout}
    assert len(held) == 2 and not held & {key(ex) for ex in training}
    assert len(training) == (6 + 3 * 10) - 4 * sum(k[1] < 100 for k in held) - 3 * sum(k[1] >= 100 for k in held)
    assert [key(ex) for ex in split_examples(folders[:1], [1], 2, 0, eval_folder=folders[1])[0]] == \
        [key(ex) for ex in heldout]
    with pytest.raises(DataError, match="different targets"):
        split_examples(folders[1:], [1, 1], eval_size=1, seed=0)
    with pytest.raises(ConfigError, match="one integer >= 1 per --data folder"):
        data_weights(argparse.Namespace(data=["a", "b"], data_weights=[2]))


def test_heal_data_defaults_to_the_demo_mix_for_the_demo_drafter_and_accepts_an_unfinished_folder(tmp_path, capsys):
    import argparse
    import shutil

    from models.demo import DEMO_DISTILL_DIR, DEMO_DRAFTER_DIR, DEMO_HEAL_DATA
    from models.errors import ConfigError
    from prune.commands._heal import heal_data, heal_examples
    from prune.training.data import load_examples

    def flags(heal_data=None, heal_data_weights=None, drafter=None):
        return argparse.Namespace(heal_data=heal_data, heal_data_weights=heal_data_weights, drafter=drafter)

    # The demo drafter (named or by default) heals on its shipped mix, each folder as often as its weight says;
    # prune heal resolves the same mix, so the two commands heal the demo drafter alike.
    examples, named = heal_examples(flags())
    assert named == [f"{folder} x{weight}" for folder, weight in DEMO_HEAL_DATA]
    assert len(examples) == sum(len(load_examples(folder, partial=True)) * w for folder, w in DEMO_HEAL_DATA)
    assert heal_examples(flags(drafter=str(DEMO_DRAFTER_DIR)))[1] == named
    assert heal_data(None, None, str(DEMO_DRAFTER_DIR), flags="--data") == heal_data(None, None, None)
    assert heal_examples(flags(drafter=str(tmp_path))) == (None, None)  # another drafter: nothing to heal on

    one = len(load_examples(str(DEMO_DISTILL_DIR), partial=True))
    examples, named = heal_examples(flags([str(DEMO_DISTILL_DIR)], [3], drafter=str(tmp_path)))
    assert len(examples) == 3 * one and named == [f"{DEMO_DISTILL_DIR} x3"]
    with pytest.raises(ConfigError, match="--heal-data-weights needs one integer >= 1 per --heal-data folder"):
        heal_examples(flags([str(DEMO_DISTILL_DIR)], [1, 2]))
    with pytest.raises(ConfigError, match="give the folders with --heal-data"):
        heal_examples(flags(None, [2]))

    unfinished = tmp_path / "unfinished"  # the manifest plans more shards than exist
    unfinished.mkdir()
    shutil.copy(DEMO_DISTILL_DIR / "manifest.json", unfinished)
    shutil.copy(DEMO_DISTILL_DIR / "shard-00000.jsonl", unfinished)
    capsys.readouterr()
    examples, _ = heal_examples(flags([str(unfinished)], drafter=str(tmp_path)))
    assert 0 < len(examples) <= 64
    assert f"healing on the {len(examples)} finished examples" in capsys.readouterr().err


def test_progress_off_a_terminal_is_a_plain_line_per_interval(capsys):
    from prune.progress import progress_bar

    with progress_bar("score", 3, log_every_s=3600) as advance:
        advance()
        advance()
    assert capsys.readouterr().err == ""  # not yet due
    with progress_bar("score", 3, log_every_s=0) as advance:
        for _ in range(3):
            advance()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["score: 1/3", "score: 2/3", "score: 3/3"]
    with progress_bar("score", 3, enabled=False, log_every_s=0) as advance:
        advance()
        advance(0, total=5)
    assert capsys.readouterr().err == ""
    with progress_bar("score", 2, log_every_s=0) as advance:  # work that grows past its plan says so
        advance()
        advance(0, total=3)
        advance()
        advance()
    assert [line.split(" (")[0] for line in capsys.readouterr().err.splitlines()] == [
        "score: 1/2", "score: 2/3", "score: 3/3"]


def test_pass_times_measured_on_a_busy_machine_come_with_a_warning(monkeypatch):
    import os

    from prune.commands._common import warn_if_busy

    lines = []
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert not warn_if_busy("/c", lines.append) and lines == []
    monkeypatch.setattr(os, "getloadavg", lambda: (4.2, 3.0, 2.0))
    assert warn_if_busy("/c", lines.append)
    assert lines == ["warning: the machine is busy (load average 4.2 on 2 cores): these pass times will be slow and "
                     "uneven, and they are kept in /c/pass-times; measure on a quiet machine, or delete that folder "
                     "afterwards"]


def test_the_bench_table_counts_the_prompts_whose_output_equals_ar():
    from prune.commands.bench import _exactness

    assert _exactness({"exact_match_vs_ar": False, "exact_match_prompts": 3}, 4) == "NO (3/4)"
    assert _exactness({"exact_match_vs_ar": True, "exact_match_prompts": 4}, 4) == "yes"
    assert _exactness({"exact_match_vs_ar": None}, 4) == "-"
