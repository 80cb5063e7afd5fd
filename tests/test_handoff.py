"""Handing a checkpoint over (issue 19): files readable as the umask allows, the source dtype kept, a
summary a person reads at the end of `prune run`, and `prune dashboard --print` offline."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from _pairs import prompt_ids, tiny_target
from conftest import build_tiny_drafter, export_interrupted_at
from decode.decoders import DecodeConfig
from models.checkpoint import atomic_write_text
from models.drafter import load_drafter, save_drafter
from prune.training.loss import Example
from prune.cli import main
from prune.commands.run import summary_lines
from prune.heal import HealConfig
from prune.progressive import Campaign, RunConfig, RunHooks, run_pruning
from prune.scoring import ScoreConfig, evaluate, record_trajectories
from prune.state import RunState


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A tiny target and a tiny drafter stored in bfloat16 (as the demo drafter is), and three prompts."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target()
    target.config.eos_token_id = 3
    target.save_pretrained(root / "target")
    save_drafter(build_tiny_drafter(), root / "drafter", dtype=torch.bfloat16)
    (root / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 9 + i))}) for i in range(3)))
    return root


def run_args(pair, out, *extra):
    return ["run", "--drafter", str(pair / "drafter"), "--target", str(pair / "target"), "--prompts",
            str(pair / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(out), "--layers-to-remove", "1",
            "--min-retention", "0.01", "--no-stop-on-speedup", *extra]


def weight_dtypes(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return {handle.get_slice(name).get_dtype() for name in handle.keys()}


@pytest.fixture
def umask():
    """Set the process umask for one test: `umask(0o077)`; the previous one is restored afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, file_mode, folder_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_every_written_file_gets_the_mode_of_the_umask(bf16_pair, tmp_path, capsys, umask, mask, file_mode,
                                                       folder_mode):
    umask(mask)
    out = tmp_path / "out"
    assert main(run_args(bf16_pair, out)) == 0
    assert main(["export", str(out / "final"), str(tmp_path / "copy"), "--dtype", "float32"]) == 0
    atomic_write_text(tmp_path / "note.txt", "written through the one atomic file writer\n")
    written = [p for root in (out, tmp_path / "copy", tmp_path / "note.txt")
               for p in ([root, *root.rglob("*")] if root.is_dir() else [root]) if not p.is_symlink()]
    assert {p.name for p in written} >= {"model.safetensors", "state.json", "report.md", "README.md", "note.txt"}
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written}
    assert modes == {name: oct(folder_mode if (tmp_path / name).is_dir() else file_mode) for name in modes}
    assert not [p.name for p in tmp_path.rglob(".*")]  # no temporary file left behind


def test_a_bf16_source_gives_bf16_steps_unless_another_dtype_is_asked_for(bf16_pair, tmp_path, capsys):
    assert main(run_args(bf16_pair, tmp_path / "kept")) == 0
    step = tmp_path / "kept" / "step-01"
    assert weight_dtypes(step) == {"BF16"}
    assert "stored in **bfloat16**" in (step / "README.md").read_text()
    assert json.loads((step / "prune_report.json").read_text())["dtype"] == "bfloat16"

    assert main(run_args(bf16_pair, tmp_path / "wide", "--export-dtype", "float32")) == 0
    assert weight_dtypes(tmp_path / "wide" / "step-01") == {"F32"}
    assert "stored in **float32**" in (tmp_path / "wide" / "step-01" / "README.md").read_text()

    # `prune export` keeps the dtype of the folder it copies unless --dtype says otherwise.
    assert main(["export", str(step), str(tmp_path / "same")]) == 0
    assert weight_dtypes(tmp_path / "same") == {"BF16"}
    assert main(["export", str(step), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    assert weight_dtypes(tmp_path / "f32") == {"F32"}
    assert "stored in **float32**" in (tmp_path / "f32" / "README.md").read_text()


def test_a_run_exporting_bf16_resumes_exactly_and_records_the_tau_of_its_files(tmp_path, monkeypatch):
    """Healed weights are rounded to the export dtype before they are judged, so the step's recorded tau is
    that of its file and a resumed run (which reloads the file) continues exactly as an uninterrupted one."""
    target = tiny_target()
    save_drafter(build_tiny_drafter(num_hidden_layers=3), tmp_path / "source", dtype=torch.bfloat16)
    drafter = load_drafter(tmp_path / "source")  # computes in float32
    prompts = [prompt_ids(n, seed=n) for n in (3, 7)]
    score = ScoreConfig(decode=DecodeConfig(max_new_tokens=16, packed_budget=27), timing_repeats=1, bootstrap=20)
    trajectories = record_trajectories(target, prompts, score.decode)
    examples = [Example.from_prompt_response(t[: len(p)], t[len(p):]) for p, t in zip(prompts, trajectories)]
    config = RunConfig(layers_to_remove=2, min_retention=0.01, stop_on_speedup=False, check_prompts=0, score=score,
                       heal=HealConfig(steps=3, rank=2, alpha=4, batch_size=2, lr=1e-2))

    def run(out, **kwargs):
        return run_pruning(Campaign(drafter, tmp_path / "source", prompts, target, trajectories, examples), out, config,
                           hooks=RunHooks(log=lambda *_: None), **kwargs).to_dict()

    full = run(tmp_path / "full")
    for record in full["history"]:
        step = tmp_path / "full" / record["folder"]
        assert weight_dtypes(step) == {"BF16"}
        assert evaluate(load_drafter(step), prompts, score, trajectories).tau == record["tau"]

    with export_interrupted_at(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    resumed = run(tmp_path / "resumed", resume=True)
    same = ("removed_original", "tau_before_heal", "tau", "heal_rolled_back", "heal_loss")
    assert [{k: h[k] for k in same} for h in resumed["history"]] == [{k: h[k] for k in same} for h in full["history"]]
    with safe_open(str(tmp_path / "full" / "step-02" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "resumed" / "step-02" / "model.safetensors"), "pt") as b:
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_a_run_ends_with_a_summary_on_stderr_and_json_stays_on_stdout(bf16_pair, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(run_args(bf16_pair, out, "--json", "-")) == 0
    captured = capsys.readouterr()
    assert captured.out == (out / "state.json").read_text()  # `--json -`: the state, nothing else
    state = json.loads(captured.out)
    removed = state["history"][0]["removed_original"][0]
    lines = captured.err.strip().splitlines()[-7:]
    assert lines[0] == f"removed 1 of 2 layers (original indices {removed}) in 1 step; stopped by layer budget"
    assert lines[1].startswith(f"calibration tau: {state['base']['tau']:.3f} -> {state['history'][0]['tau']:.3f} "
                               "(retention ")
    assert lines[2].startswith("predicted speedup: ") and lines[2].endswith("x")
    # What the removed layer buys at equal tau: the unpruned drafter's round over the pruned one's, as modelled.
    gain = RunState.from_dict(state).equal_tau_speedup(1)
    assert gain >= 1 and lines[3] == f"fewer layers alone, at equal tau (predicted): {gain:.3f}x"
    assert lines[4] == f"pruned drafter: {out / 'final'} -> step-01 (1 layer, bfloat16)"
    assert lines[5] == f"heal it longer: prune heal {out / 'final'} {out}-healed"
    assert lines[6] == f"report: {out / 'report.md'}"
    assert f"would make it {gain:.3f}x faster" in (out / "report.md").read_text()
    assert "1 layer fewer makes the drafter at most" in captured.err  # announced before the first round

    assert main(run_args(bf16_pair, out, "--resume")) == 0  # without --json, stdout stays empty
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines()[-1] == f"report: {out / 'report.md'}"


def test_the_summary_shows_held_out_and_measured_numbers_when_the_state_has_them(tmp_path):
    state = {"base": {"tau": 5.0, "predicted_speedup": 1.5}, "timing": {"layers": 36}, "stopped_by": "layer budget",
             "history": [{"removed_original": [7, 21], "folder": "step-01", "layers": 34, "tau": 4.8,
                          "predicted_speedup": 1.7}],
             "speed": {"base": {"tau": 4.0, "measured_speedup": 1.25}, "final": {"tau": 3.9, "measured_speedup": 1.4},
                       "retention_error": 0.031}}
    save_drafter(build_tiny_drafter(), tmp_path / "step-01", dtype=torch.float16)
    assert summary_lines(state, str(tmp_path)) == [
        "removed 2 of 36 layers (original indices 7, 21) in 1 step; stopped by layer budget",
        "calibration tau: 5.000 -> 4.800 (retention 0.9600)",
        "held-out tau: 4.000 -> 3.900 (retention 0.9750 +- 0.0310)",
        "predicted speedup: 1.50x -> 1.70x",
        "measured speedup: 1.25x -> 1.40x",
        f"pruned drafter: {tmp_path / 'final'} -> step-01 (34 layers, float16)",
        f"heal it longer: prune heal {tmp_path / 'final'} {tmp_path}-healed",
        f"report: {tmp_path / 'report.md'}",
    ]
    state |= {"history": [], "speed": {"final": {"predicted_speedup": 2.0}}, "stopped_by": "retention floor: ..."}
    assert summary_lines(state, "out") == [
        "removed no layer; stopped by retention floor: ...",
        "calibration tau: 5.000",
        "pruned drafter: none (no step was taken; the source drafter stands)",
        "report: out/report.md",
    ]


def test_dashboard_print_needs_no_entity_or_project(capsys):
    assert main(["dashboard", "--print"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listing["sections"]] == ["Pruning", "Layer scores", "Sweep"]
    assert listing["entity"] is None and all(s["panels"] for s in listing["sections"])
    assert main(["dashboard"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and "--entity and --project" in err and "\n" not in err


def test_a_file_taken_out_of_a_wheel_is_readable_and_a_bad_one_leaves_nothing(tmp_path, umask):
    import hashlib
    import zipfile

    from models._wheels import WheelFile, extract_member
    from models.errors import DataError

    umask(0o022)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/data.bin", b"payload")
    spec = WheelFile("pkg", "1.0", wheel.name, "pkg/data.bin", hashlib.sha256(b"payload").hexdigest())
    out = extract_member(wheel, spec, tmp_path / "data" / "data.bin")
    assert out.read_bytes() == b"payload" and out.stat().st_mode & 0o777 == 0o644
    with pytest.raises(DataError, match="pinned sha256"):
        extract_member(wheel, WheelFile("pkg", "1.0", wheel.name, "pkg/data.bin", "0" * 64), tmp_path / "bad.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", wheel.name]
