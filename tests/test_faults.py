"""Faults a long job meets (issue 17): kill -9 at any moment then a rerun, two processes on one output, a full disk.

Killed runs are forked children of the test process (as in test_sweeps): real processes that die by SIGKILL
at a named point (models.faults, D3D_PRUNE_KILL_AT) with no handler, `finally` or atexit run, and that
inherit the test process's imports, so a run costs about a second instead of the five that importing torch,
transformers and peft takes. The process holding a lock is checked against a real `python -m prune run`.
Final weights are compared byte for byte with an uninterrupted run on the same pair, healing on.
"""

import errno
import fnmatch
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from _pairs import prompt_ids, trained_drafter
from conftest import build_tiny_drafter
from decode.decoders import DecodeConfig
from models import faults
from models.drafter import load_drafter, save_drafter
from models.errors import CheckpointError
from models.lock import lock_file, output_lock
from prune.cli import main
from prune.config import FINISHING_HEAL, HEAL_WEIGHTS
from prune.export import REPORT_NAME
from prune.heal import checkpoint_folder
from prune.scoring import record_trajectories

REPO = Path(__file__).resolve().parents[1]


def forked(function, *args, kill_at: str | None = None, **kwargs) -> tuple[int, str]:
    """Run `function(*args, **kwargs)` in a forked child with D3D_PRUNE_KILL_AT=`kill_at`; returns (its exit
    status, -9 when killed by SIGKILL; its stderr). The function's return value is the exit status."""
    handle, log = tempfile.mkstemp(suffix=".log")
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.dup2(handle, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            sys.stderr, sys.stdout = open(2, "w", buffering=1, closefd=False), open(1, "w", closefd=False)
            # torch rebuilds its thread pool lazily after a fork, racily when several threads (transformers
            # loads weights in a pool) touch it first: rebuild it here, in one thread.
            torch.set_num_threads(torch.get_num_threads())
            os.environ.pop(faults.ENV, None)
            if kill_at:
                os.environ[faults.ENV] = kill_at
            faults._reached.clear()
            code = function(*args, **kwargs) or 0
        except BaseException:  # noqa: BLE001 - reported to the parent through the log
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(handle)
    _, status = os.waitpid(pid, 0)
    text = Path(log).read_text()
    os.unlink(log)
    return os.waitstatus_to_exitcode(status), text


# ------------------------------------------------------------------------------------------------------
# prune run on a tiny pair: a trained 3-layer drafter stored in bfloat16 (as the demo drafter is)
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target, drafter = trained_drafter(num_layers=3)
    target.save_pretrained(root / "target")
    save_drafter(drafter, root / "drafter", dtype=torch.bfloat16)
    prompts = [prompt_ids(n, seed=n) for n in (3, 7, 12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                                for i, p in enumerate(prompts)))
    heal = root / "heal"  # distillation data: the target's greedy answers to other prompts
    heal.mkdir()
    answers = record_trajectories(target, [prompt_ids(n, seed=50 + n) for n in (4, 6, 9, 11)],
                                  DecodeConfig(max_new_tokens=24))
    (heal / "manifest.json").write_text(json.dumps({"num_prompts": 4, "shards": 1}))
    (heal / "shard-00000.jsonl").write_text("".join(
        json.dumps({"id": f"h{i}", "prompt_ids": t[:5], "response_ids": t[5:]}) + "\n" for i, t in enumerate(answers)))
    return root


def run_args(pair: Path, out: Path, *extra: str, cache: Path | None = None) -> list[str]:
    return ["run", "--drafter", str(pair / "drafter"), "--target", str(pair / "target"), "--prompts",
            str(pair / "prompts.jsonl"), "--max-new-tokens", "16", "--out", str(out), "--layers-to-remove", "2",
            "--min-retention", "0.01", "--no-stop-on-speedup", "--heal-data", str(pair / "heal"), "--heal-steps", "3",
            "--heal-min-drop", "0", "--heal-rank", "2", "--heal-alpha", "4", "--speed-prompts", "0", "--no-wandb",
            "--cache-dir", str(cache or pair / "cache"), *extra]


@pytest.fixture(scope="module")
def reference(pair):
    """An uninterrupted run (in this process; it also fills the pair's cache of pass times and trajectories)."""
    out = pair / "reference"
    assert main(run_args(pair, out)) == 0
    return out


def same_steps(out: Path, reference: Path) -> None:
    """Both runs took the same steps with the same scores and taus, and every step's weights are the same bytes.

    Pass times are measured once per campaign, so only the numbers derived from them may differ."""
    def strip(record):
        timed = ("predicted_speedup", "draft_pass_ms", "packed_pass_ms")
        return {k: ([{n: v for n, v in s.items() if n not in timed} for s in v] if k == "scores" else v)
                for k, v in record.items() if k not in timed}

    ours, theirs = (json.loads((folder / "state.json").read_text()) for folder in (out, reference))
    assert [strip(h) for h in ours["history"]] == [strip(h) for h in theirs["history"]]
    assert ours["stopped_by"] == theirs["stopped_by"] == "layer budget"
    for record in theirs["history"]:
        name = record["folder"]
        assert (out / name / "model.safetensors").read_bytes() == (reference / name / "model.safetensors").read_bytes()
    assert os.readlink(out / "final") == os.readlink(reference / "final")
    assert (out / "report.md").is_file()
    assert not [p.name for p in out.rglob(".*")] and not list(out.glob("scoring-*.json"))
    assert not lock_file(out).exists()


# Where a kill lands, in the order a run reaches these points; each kill is followed by the next `--resume`.
KILLS = [
    ("write:state.json", "before the first step: the new run's first state write"),
    ("score-layer:2", "scoring step 1, after two of its three layer evaluations"),
    ("heal", "healing step 1"),
    ("write:step-01", "exporting step 1: the folder written, not yet renamed into place"),
    ("write:state.json", "writing the state that records step 1 (exported already)"),
    ("score-layer", "scoring step 2, after one of its two layer evaluations"),
    ("write:report.md", "writing the report after the last step"),
]


def test_a_run_killed_anywhere_resumes_to_the_same_bytes(pair, reference, tmp_path):
    out = tmp_path / "out"
    for point, where in KILLS:
        code, err = forked(main, run_args(pair, out, "--resume"), kill_at=point)
        assert code == -signal.SIGKILL, f"not killed {where}: {err}"
        if point == "write:state.json" and where.startswith("before"):
            assert "holds no pruning run yet; starting one" in err and not (out / "state.json").exists()
        elif point == "score-layer:2":
            assert len(json.loads((out / "scoring-01.json").read_text())["layers"]) == 2
        elif point == "heal":
            assert "step 1: scoring continues with 2 of 3 layers evaluated" in err
            assert f"took over the stale lock of {out} left by pid" in err
        elif point == "write:step-01":
            assert not (out / "step-01").exists() and list(out.glob(".step-01.partial-*"))
    code, err = forked(main, run_args(pair, out, "--resume"))
    assert code == 0, err
    assert "step 2: scoring continues with 1 of 2 layers" not in err  # step 2 finished before the last kill
    same_steps(out, reference)


def test_python_m_prune_run_killed_while_scoring_resumes_to_the_same_bytes(pair, reference, tmp_path):
    """The hook through the real entry point, in a fresh interpreter (one thread, as in this process)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", faults.ENV: "score-layer:2"}
    killed = subprocess.run([sys.executable, "-m", "prune", *run_args(pair, out)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, err = forked(main, run_args(pair, out, "--resume"))
    assert code == 0 and "step 1: scoring continues with 2 of 3 layers evaluated" in err, err
    same_steps(out, reference)


def heal_args(pair: Path, source: Path, destination: Path, *extra: str) -> list[str]:
    return ["heal", str(source), str(destination), "--data", str(pair / "heal"), "--steps", "12", "--rank",
            "2", "--alpha", "4", "--no-progress", *extra]


def test_prune_heal_distills_a_finished_run_and_a_killed_heal_resumes_to_the_same_bytes(pair, reference, tmp_path):
    final = (reference / "final").resolve()
    healed = tmp_path / "healed"
    assert main(heal_args(pair, reference / "final", healed)) == 0
    report = json.loads((healed / REPORT_NAME).read_text())
    heal = report["heal"]
    # The teacher is the drafter the run pruned, as the run's export records it; the loss is KL to it.
    assert heal["teacher"] == str((pair / "drafter").resolve()) and heal["settings"]["distill_weight"] == 1.0
    assert heal["settings"]["gamma"] == FINISHING_HEAL.gamma
    assert len(heal["loss"]) == 12 and report["history"][-1] == {"step": "heal", "layers": 1}
    assert [h["step"] for h in report["history"][:-1]] == [1, 2]  # the run's steps come along
    assert not checkpoint_folder(healed).exists()
    before, after = (load_drafter(folder) for folder in (final, healed))
    assert after.config.original_layer_indices == before.config.original_layer_indices
    moved = [n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])]
    assert moved and all(".layers." in n for n in moved)  # LoRA touches the kept layers only

    # Killed after its first checkpoint (update 10 of 12): nothing at the destination, the state beside it.
    again = tmp_path / "again"
    code, err = forked(main, heal_args(pair, reference / "final", again), kill_at="train-checkpoint")
    assert code == -signal.SIGKILL, err
    assert not again.exists() and checkpoint_folder(again).is_dir()
    # Another heal's settings never continue that state; the same command finishes it, byte for byte.
    for other in (["--seed", "1"], ["--gamma", "2"], ["--train", "full"]):
        code, err = forked(main, heal_args(pair, reference / "final", again, *other))
        assert code == 1 and "holds a heal of another source, teacher, data or settings" in err, err
    # A heal killed by a version before --train recorded no `train`: it continues as the adapter heal it was.
    marker = checkpoint_folder(again) / "heal.json"
    recorded = json.loads(marker.read_text())
    assert recorded["settings"].pop("train") == "lora"
    marker.write_text(json.dumps(recorded))
    code, err = forked(main, heal_args(pair, reference / "final", again))
    assert code == 0, err
    assert (again / "model.safetensors").read_bytes() == (healed / "model.safetensors").read_bytes()
    assert not checkpoint_folder(again).exists()


def test_a_full_prune_heal_resumes_to_the_same_bytes_and_never_continues_an_adapters_state(pair, reference, tmp_path):
    healed = tmp_path / "healed"
    full = ("--train", "full", "--dtype", "float32")  # float32: a norm's few small updates survive the export
    assert main(heal_args(pair, reference / "final", healed, *full, "--json", str(tmp_path / "h.json"))) == 0
    settings = json.loads((tmp_path / "h.json").read_text())["settings"]
    assert settings["train"] == "full" and settings["lr"] == HEAL_WEIGHTS["full"].lr  # the full fine-tune's own lr
    before, after = (load_drafter(folder) for folder in (reference / "final", healed))
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])}
    assert any("layernorm" in n for n in moved)  # the norms move too, which no adapter touches
    assert not any("embed" in n for n in moved)

    again = tmp_path / "again"
    code, err = forked(main, heal_args(pair, reference / "final", again, *full), kill_at="train-checkpoint")
    assert code == -signal.SIGKILL, err
    code, err = forked(main, heal_args(pair, reference / "final", again))  # adapters: another heal
    assert code == 1 and "holds a heal of another source, teacher, data or settings" in err, err
    code, err = forked(main, heal_args(pair, reference / "final", again, *full))
    assert code == 0, err
    assert (again / "model.safetensors").read_bytes() == (healed / "model.safetensors").read_bytes()


def test_prune_heal_refuses_a_drafter_without_teacher_or_a_used_destination(pair, reference, tmp_path, capsys):
    assert main(heal_args(pair, pair / "drafter", tmp_path / "h")) == 1  # not a pruning export: no recorded source
    assert "does not record the drafter it was pruned from" in capsys.readouterr().err
    assert main(heal_args(pair, reference / "final", tmp_path / "h", "--data-weights", "1", "2")) == 1
    assert "--data-weights needs one integer >= 1 per --data folder" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main(heal_args(pair, reference / "final", taken)) == 1
    assert (taken / "keep.txt").read_text() == "mine" and not checkpoint_folder(taken).exists()
    other = tmp_path / "other"  # a drafter of another block size is not the one SOURCE was pruned from
    save_drafter(build_tiny_drafter(num_hidden_layers=2, block_size=4), other)
    assert main(heal_args(pair, reference / "final", tmp_path / "h", "--teacher", str(other))) == 1
    assert "differ in" in capsys.readouterr().err and not checkpoint_folder(tmp_path / "h").exists()


def test_two_runs_on_one_folder_the_second_refuses_at_once(pair, tmp_path):
    out = tmp_path / "out"
    holder, release = os.pipe()
    ready_r, ready_w = os.pipe()

    def hold() -> int:
        os.close(release)
        with output_lock(out):
            os.write(ready_w, b"x")
            os.read(holder, 1)  # until the test closes its end
        return 0

    pid = os.fork()
    if pid == 0:
        os._exit(hold())
    os.close(holder)
    try:
        os.read(ready_r, 1)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        second = subprocess.run([sys.executable, "-m", "prune", *run_args(pair, out)], capture_output=True, text=True,
                                env=env, timeout=60)
        assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(f"Error: {out} is in use by another process: pid {pid} on "
                                        f"{socket.gethostname()}, started ")
        assert second.stderr.endswith(f"; wait for it to end or stop it, then rerun (if it is gone, delete "
                                      f"{lock_file(out)})\n")
        # distill and train-drafter take the same lock on their output.
        for argv in (["distill", "--out", str(out), "--target", str(pair / "target")],
                     ["train-drafter", "--data", str(pair / "heal"), "--out", str(out)]):
            with pytest.raises(CheckpointError, match=f"in use by another process: pid {pid} on "):
                main([*argv, "--debug"])
    finally:
        os.close(release)
        os.waitpid(pid, 0)
    assert not lock_file(out).exists()


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path, monkeypatch, flock):
    if not flock:  # a file system without flock: the lock file's pid decides
        def unsupported(*_):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr("fcntl.flock", unsupported)
    out, notes = tmp_path / "out", []
    lock_file(out).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    (tmp_path / ".out.partial-x1").mkdir()  # a killed atomic write of the output's
    with output_lock(out, log=notes.append):
        assert json.loads(lock_file(out).read_text())["pid"] == os.getpid()
    assert "left by pid" in notes[0] and "no longer running" in notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    if not flock:
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            lock_file(out).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
            with pytest.raises(CheckpointError, match=f"pid {sleeper.pid} on {socket.gethostname()}"):
                with output_lock(out):
                    pass
        finally:
            sleeper.kill()
            sleeper.wait()


# ------------------------------------------------------------------------------------------------------
# A full disk at each write site
# ------------------------------------------------------------------------------------------------------


def disk_full_at(monkeypatch, pattern: str) -> None:
    """From now on, flushing a file whose path matches `pattern` fails as a full disk does (ENOSPC)."""
    real = os.fsync

    def fsync(fd):
        if fnmatch.fnmatch(os.readlink(f"/proc/self/fd/{fd}"), pattern):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def one_error_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert lines[-1].startswith("Error: disk full while writing ") and "Traceback" not in err, err
    assert "free disk space" in lines[-1] and "--resume" in lines[-1]
    for word in words:
        assert word in lines[-1]


def test_a_full_disk_fails_in_one_line_keeps_what_was_saved_and_a_resume_finishes(pair, reference, tmp_path,
                                                                                   monkeypatch, capsys):
    out = tmp_path / "out"
    sites = [("*/.step-02.partial-*/model.safetensors", str(out / "step-02")),  # exporting a step
             ("*/.state.json.partial-*", str(out / "state.json")),  # the state that records it
             ("*/.report.md.partial-*", str(out / "report.md"))]  # the report
    for n, (pattern, path) in enumerate(sites):
        with monkeypatch.context() as patch:
            disk_full_at(patch, pattern)
            assert main(run_args(pair, out, *(["--resume"] if n else []))) == 1
        one_error_line(capsys.readouterr().err, path)
        state = json.loads((out / "state.json").read_text())
        assert [h["folder"] for h in state["history"]] == (["step-01"] if n < 2 else ["step-01", "step-02"])
        assert not list(out.glob(".*"))  # no temporary entry left behind
    assert main(run_args(pair, out, "--resume")) == 0
    same_steps(out, reference)

    # The cache: recording the trajectories of a fresh cache folder (pass times kept, so tau is the same).
    cache = tmp_path / "cache"
    shutil.copytree(pair / "cache", cache, ignore=shutil.ignore_patterns("trajectories"))
    with monkeypatch.context() as patch:
        disk_full_at(patch, "*/trajectories/.*.partial-*")
        assert main(run_args(pair, tmp_path / "again", cache=cache)) == 1
    one_error_line(capsys.readouterr().err, str(cache / "trajectories"))
    assert main(run_args(pair, tmp_path / "again", "--resume", cache=cache)) == 0
    same_steps(tmp_path / "again", reference)


# ------------------------------------------------------------------------------------------------------
# The scoring journal
# ------------------------------------------------------------------------------------------------------


def test_a_journal_replays_a_round_exactly_and_only_for_its_own_key(pair, tmp_path, monkeypatch):
    import prune.scoring as scoring
    from decode.cost import LayerCost
    from prune.journal import ScoringJournal
    from prune.scoring import ScoreConfig, score_layers

    target, drafter = trained_drafter(num_layers=3)
    prompts = [prompt_ids(n, seed=n) for n in (3, 7)]
    config = ScoreConfig(decode=DecodeConfig(max_new_tokens=16), timing_repeats=1, bootstrap=20)
    trajectories = record_trajectories(target, prompts, config.decode)
    file, costs = tmp_path / "scoring-01.json", (LayerCost(1.0, 0.5), LayerCost(2.0, 0.75))  # modelled pass times
    full = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs,
                        journal=ScoringJournal(file, "a"))
    monkeypatch.setattr(scoring, "evaluate", lambda *a, **k: pytest.fail("evaluated again"))
    again = score_layers(drafter, prompts, config, trajectories=trajectories, layer_costs=costs,
                         journal=ScoringJournal(file, "a"))
    assert again.to_dict() == full.to_dict()
    assert ScoringJournal(file, "b").layers == {} and ScoringJournal(file, "b").base is None


# ------------------------------------------------------------------------------------------------------
# prune distill and prune train-drafter killed with -9
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distill_setup(tmp_path_factory):
    from test_distill import FAKE_MODULE, make_tiny_target

    root = tmp_path_factory.mktemp("distill")
    make_tiny_target(root / "target")
    (root / "stdlib").mkdir()
    (root / "stdlib" / "alpha.py").write_text(FAKE_MODULE)
    (root / "stdlib" / "beta.py").write_text(FAKE_MODULE.replace("add", "merge").replace("Counter", "Tally"))
    return root


def distill(root: Path, out: Path) -> int:
    from prune.training.data import generate_distillation_data

    generate_distillation_data(root / "target", out, num_prompts=6, max_new_tokens=6, batch_size=2, shard_size=2,
                               progress=False, stdlib_dir=root / "stdlib")
    return 0


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_distill_and_train_drafter_killed_resume_to_the_same_data_and_weights(distill_setup, tmp_path):
    root = distill_setup
    distill(root, tmp_path / "data")
    code, err = forked(distill, root, tmp_path / "killed", kill_at="write:shard-00001.jsonl")
    assert code == -signal.SIGKILL, err
    assert (tmp_path / "killed" / "shard-00000.jsonl").is_file() and not (tmp_path / "killed" / "shard-00001.jsonl").exists()
    code, err = forked(distill, root, tmp_path / "killed")
    assert code == 0 and f"took over the stale lock of {tmp_path / 'killed'}" in err, err
    assert files(tmp_path / "killed") == files(tmp_path / "data")

    def train(out: Path) -> list[str]:
        return ["train-drafter", "--data", str(tmp_path / "data"), "--target", str(root / "target"), "--out", str(out),
                "--init", "random", "--layers", "1", "--hidden-size", "16", "--intermediate-size", "24", "--heads", "2",
                "--kv-heads", "1", "--head-dim", "8", "--block-size", "4", "--steps", "6", "--batch-size", "2",
                "--warmup-steps", "1", "--eval-size", "1", "--eval-every", "0", "--checkpoint-every", "2",
                "--max-length", "64", "--blocks-per-sequence", "2", "--no-progress", "--threads", "1"]

    assert main(train(tmp_path / "reference")) == 0
    out = tmp_path / "drafter"
    for point in (f"write:{out.name}-checkpoints:2", f"write:{out.name}"):  # mid-training; saving the result
        code, err = forked(main, train(out), kill_at=point)
        assert code == -signal.SIGKILL, err
    assert not out.exists() and list(tmp_path.glob(f".{out.name}.partial-*"))
    code, err = forked(main, train(out))
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".*"))
