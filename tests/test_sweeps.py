"""Sweeps: a study-wide budget across workers, dead workers' trials retried, pruning, the Pareto front,
storages (SQLite, journal file, PostgreSQL), search-space files and the `prune sweep` CLI."""

import json
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from _pairs import prompt_ids, save_prompt_sets, save_tiny_pair, tiny_campaign
from decode.timing import PINNED_TIMES_ENV
from models.drafter import save_drafter
from models.errors import CheckpointError, ConfigError
from models.shards import weight_files
from prune.cli import main
from prune.heal import HealConfig
from prune.scoring import ScoreConfig, record_trajectories
from sweeps.objective import PruningObjective, SweepConfig, SweepData
from sweeps.space import DEFAULT_SPACE, SearchSpace
from sweeps.storages import make_storage
from sweeps.study import OVER_BUDGET, open_study, run_worker, summarize

SPACE = """
[params.layers_to_remove]
type = "int"
low = 1
high = 2

[params.heal_lr]
type = "float"
low = 1e-4
high = 1e-2
log = true

[params.calibration_prompts]
type = "int"
low = 2
high = 3

[fixed]
min_retention = 0.05
stop_on_speedup = false
heal_steps = 1
lora_rank = 2
lora_alpha = 4
"""
FORK = multiprocessing.get_context("fork")  # children inherit the trained pair: no re-import, no re-training
_DATA = {}  # filled by the `sweep_data` fixture before any worker is forked


@pytest.fixture(scope="module")
def sweep_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    target, drafter, calibration, decode, calibration_trajectories, examples = tiny_campaign(root)
    evaluation = [prompt_ids(n, seed=100 + n) for n in (4, 9)]
    data = SweepData(drafter, str(root / "source"), target, calibration, calibration_trajectories, evaluation,
                     record_trajectories(target, evaluation, decode), examples, "0" * 64)
    _DATA.update(data=data, decode=decode)
    return data


def sweep_config(out, **overrides) -> SweepConfig:
    settings = dict(study="s", out=str(out), retention_floor=0.05,
                    score=ScoreConfig(decode=_DATA["decode"], timing_repeats=1, bootstrap=20),
                    heal=HealConfig(batch_size=2))
    settings.update(overrides)
    return SweepConfig(**settings)


def objective_for(out, space=SPACE, **overrides) -> PruningObjective:
    return PruningObjective(sweep_config(out, **overrides), SearchSpace.from_text(space), _DATA["data"],
                            log=lambda *_: None)


def study_for(url, objective, study="s", heartbeat=None, grace=None, pruner="median"):
    storage = make_storage(url, heartbeat, grace)
    config = objective.config
    meta = {**config.record(), "space": objective.space.record()}
    return open_study(study, storage, config.directions, meta, seed=0, pruner=pruner), storage


def _worker(url, n_trials, out, barrier=None, heartbeat=None, grace=None, study="s", slow=False):
    """One sweep worker process (forked). A `slow` one draws its parameters, then hangs (to be killed)."""
    real = objective_for(out, study=study)
    study_obj, storage = study_for(url, real, study, heartbeat, grace)
    def hang(trial):
        real.space.suggest(trial)
        time.sleep(600)

    objective = hang if slow else real
    if barrier is not None:
        barrier.wait(timeout=60)
    run_worker(study_obj, storage, objective, n_trials, poll=0.2, log=lambda *_: None)


def run_two_workers(url, n_trials, tmp_path, study="s", heartbeat=None, grace=None):
    barrier = FORK.Barrier(2)
    workers = [FORK.Process(target=_worker, args=(url, n_trials, str(tmp_path / f"w{i}"), barrier, heartbeat, grace,
                                                  study)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
        assert w.exitcode == 0, f"worker exit code {w.exitcode}"
    return optuna.load_study(study_name=study, storage=make_storage(url, heartbeat, grace))


def check_exact_budget(study, n_trials):
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == n_trials
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or t.user_attrs.get(OVER_BUDGET) for t in trials)
    assert len({t.number for t in trials}) == len(trials)
    assert len({json.dumps(t.params, sort_keys=True) for t in finished}) == n_trials  # no trial ran twice
    for t in finished:  # every trial's checkpoint is findable from the study
        assert os.path.isdir(t.user_attrs["checkpoint"]) and t.user_attrs["eval_retention"] > 0
    assert len({t.user_attrs["worker"] for t in finished}) == 2  # both workers took part
    # Every trial predicted its speedup from the one timing stored with the study.
    stored = [v for k, v in study.user_attrs.items() if k.startswith("timing/")]
    timings = [json.loads((Path(t.user_attrs["trial_dir"]) / "state.json").read_text())["timing"] for t in finished]
    assert len(stored) == 1 and all(timing == stored[0] for timing in timings)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_complete_exactly_the_budget(sweep_data, tmp_path, kind):
    url = f"sqlite:///{tmp_path}/study.db" if kind == "sqlite" else f"journal:{tmp_path}/study.log"
    study = run_two_workers(url, 4, tmp_path, heartbeat=1 if kind == "sqlite" else None)
    check_exact_budget(study, 4)
    # A worker started after the budget is used runs nothing.
    late, storage = study_for(url, objective_for(tmp_path / "late"))
    assert "budget 4" in run_worker(late, storage, objective_for(tmp_path / "late"), 4, log=lambda *_: None)
    assert len(late.get_trials()) == len(study.get_trials()) and not (tmp_path / "late").exists()


def test_postgresql_two_workers(sweep_data, tmp_path):
    url = os.environ.get("D3D_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("D3D_TEST_POSTGRES_URL is not set (.ci/run starts a PostgreSQL server and sets it)")
    try:
        import sqlalchemy

        with sqlalchemy.create_engine(url, connect_args={"connect_timeout": 5}).connect() as connection:
            connection.execute(sqlalchemy.text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the PostgreSQL server at D3D_TEST_POSTGRES_URL is unreachable: {str(exc).splitlines()[0]}")
    study = run_two_workers(url, 3, tmp_path, study=f"pg-{uuid.uuid4().hex[:8]}", heartbeat=1)
    check_exact_budget(study, 3)


def test_a_killed_workers_trial_is_failed_and_retried(sweep_data, tmp_path):
    url = f"sqlite:///{tmp_path}/study.db"
    doomed = FORK.Process(target=_worker, args=(url, 2, str(tmp_path / "doomed"), None, 1, 2, "s", True))
    doomed.start()
    storage = make_storage(url, 1, 2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            running = optuna.load_study(study_name="s", storage=storage).get_trials(states=(TrialState.RUNNING,))
        except KeyError:  # the study is not created yet
            running = []
        # Parameters are stored one at a time: wait until the hanging trial has drawn all of them.
        if running and set(running[0].params) == set(SearchSpace.from_text(SPACE).params):
            break
        time.sleep(0.1)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join()
    victim = running[0]

    objective = objective_for(tmp_path / "later")
    study, storage = study_for(url, objective, heartbeat=1, grace=2)
    run_worker(study, storage, objective, 2, poll=0.2, log=lambda *_: None)
    trials = {t.number: t for t in study.get_trials()}
    assert trials[victim.number].state == TrialState.FAIL and not trials[victim.number].user_attrs.get(OVER_BUDGET)
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1 and retries[0].params == victim.params
    assert retries[0].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials.values()) == 2


def _killed_while_exporting(url, out):
    """A sweep worker (forked) killed by SIGKILL in the middle of its trial's first step export: the weights
    are in the export's temporary folder, its report is not."""
    import prune.export

    def die(*_, **__):
        os.kill(os.getpid(), signal.SIGKILL)

    prune.export.folder_hashes = die  # patched in this child process only
    _worker(url, 1, out, heartbeat=1, grace=2)


def test_a_worker_killed_while_exporting_records_no_checkpoint(sweep_data, tmp_path):
    from prune.export import verify_export
    from sweeps.objective import exported_checkpoint

    url = f"sqlite:///{tmp_path}/study.db"
    doomed = FORK.Process(target=_killed_while_exporting, args=(url, str(tmp_path / "doomed")))
    doomed.start()
    doomed.join(timeout=300)
    assert doomed.exitcode == -signal.SIGKILL
    trial_dir = tmp_path / "doomed" / "trial-0000"
    # Killed mid-export: the step's temporary folder is left behind, the step itself never appeared.
    assert not (trial_dir / "step-01").exists() and any(".partial" in p.name for p in trial_dir.iterdir())
    storage = make_storage(url, 1, 2)
    (victim,) = optuna.load_study(study_name="s", storage=storage).get_trials()
    assert victim.state == TrialState.RUNNING and "checkpoint" not in victim.user_attrs

    objective = objective_for(tmp_path / "later")
    study, storage = study_for(url, objective, heartbeat=1, grace=2)
    run_worker(study, storage, objective, 1, poll=0.2, log=lambda *_: None)
    trials = study.get_trials()
    assert trials[0].state == TrialState.FAIL and "checkpoint" not in trials[0].user_attrs
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert retry.state in (TrialState.COMPLETE, TrialState.PRUNED) and retry.params == victim.params
    for trial in trials:  # every checkpoint the study records is a whole export
        if "checkpoint" in trial.user_attrs:
            assert verify_export(trial.user_attrs["checkpoint"]) == []
    assert summarize(study)["best"]["checkpoint"] == retry.user_attrs["checkpoint"]
    # A step whose files no longer hash as its report lists is not recorded either.
    out = Path(retry.user_attrs["trial_dir"])
    folder = os.readlink(out / "final")
    with open(out / folder / "model.safetensors", "r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\0\0\0\1")
    with pytest.raises(CheckpointError, match="not the complete export"):
        exported_checkpoint(out, folder)


def test_a_pruned_trial_stops_after_its_first_step(sweep_data, tmp_path):
    space = "[params.heal_lr]\ntype = 'float'\nlow = 1e-4\nhigh = 1e-2\n[fixed]\nlayers_to_remove = 2\nper_step = 1\n" \
            "min_retention = 0.05\nstop_on_speedup = false\nheal_steps = 0\ncalibration_prompts = 3\n"
    objective = objective_for(tmp_path / "out", space=space)
    storage = make_storage(f"sqlite:///{tmp_path}/study.db", None)
    # Every reported retention (<= 1 here) is below 2: the pruner stops the trial at its first report.
    study = optuna.create_study(study_name="s", storage=storage, pruner=optuna.pruners.ThresholdPruner(lower=2.0),
                                direction="maximize")
    run_worker(study, storage, objective, 1, log=lambda *_: None)
    trial = study.trials[0]
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [1]
    folder = tmp_path / "out" / "trial-0000"
    state = json.loads((folder / "state.json").read_text())
    assert len(state["history"]) == 1 and state["stopped_by"].startswith("pruned by the Optuna pruner")
    assert (folder / "step-01").is_dir() and not (folder / "step-02").exists()
    assert (folder / "final").resolve() == (folder / "step-01").resolve()
    assert trial.user_attrs["checkpoint"] == str(folder.resolve() / "final") and trial.user_attrs["layers"] == 2


def dominates(a, b) -> bool:
    """a dominates b under (maximize retention, minimize cost)."""
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


def test_pareto_front_holds_only_non_dominated_trials(sweep_data, tmp_path):
    objective = objective_for(tmp_path / "out", directions=("maximize", "minimize"))
    study, storage = study_for(f"sqlite:///{tmp_path}/study.db", objective)
    run_worker(study, storage, objective, 2, log=lambda *_: None)
    import random

    rng = random.Random(0)
    for _ in range(25):  # more points, with ties, for a thorough dominance check
        study.add_trial(optuna.trial.create_trial(values=[rng.choice([0.5, 0.7, 0.9, 1.0]), rng.randint(1, 3)],
                                                  user_attrs={"checkpoint": "synthetic"}))
    complete = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    expected = {t.number for t in complete if not any(dominates(o.values, t.values) for o in complete)}
    front = summarize(study)["pareto_front"]
    assert {row["number"] for row in front} == expected and expected
    real = [t for t in complete if t.user_attrs["checkpoint"] != "synthetic"]
    assert all(t.values == [t.user_attrs["eval_retention"], t.user_attrs["layers"]] for t in real)


def test_single_objective_summary_lists_the_tradeoff_front():
    from sweeps.study import tradeoff_front

    study = optuna.create_study(direction="maximize")
    points = [(0.98, 35), (0.99, 35), (0.95, 33), (0.95, 34), (1.01, 36), (0.90, 33), (0.97, 33)]
    for n, (retention, cost) in enumerate(points):
        study.add_trial(optuna.trial.create_trial(value=float(n), user_attrs={"eval_retention": retention, "cost": cost}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"eval_retention": 2.0, "cost": 1}))
    expected = [n for n, p in enumerate(points) if not any(dominates(o, p) for o in points)]
    assert [t.number for t in tradeoff_front(study.trials)] == sorted(expected, key=lambda n: (points[n][1], n))
    assert [row["number"] for row in summarize(study)["tradeoff_front"]] == [6, 1, 4]


def test_search_space_files():
    default = SearchSpace.from_file()
    assert DEFAULT_SPACE.is_file() and {"layers_to_remove", "criterion", "lora_rank", "heal_lr", "per_step",
                                        "calibration_prompts"} <= set(default.params)
    assert default.params["per_step"].choices == [1, 2] and default.largest("layers_to_remove", 0) <= 6
    for text, message in [
        ("[params.depth]\ntype = 'int'\nlow = 1\nhigh = 2", "unknown setting 'depth'"),
        ("[params.per_step]\ntype = 'int'\nlow = 3\nhigh = 2", "low 3 > high 2"),
        ("[params.heal_lr]\ntype = 'float'\nlow = 0\nhigh = 1\nlog = true", "log scale needs low > 0"),
        ("[fixed]\ncriterion = 3", "must be a str"),
        ("[params.criterion]\ntype = 'categorical'\nchoices = []", "non-empty choices"),
        ("[params", "not valid TOML"),
        ("[fixed]\nper_step = 1\n[params.per_step]\ntype = 'categorical'\nchoices = [1]", "both searched and fixed"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            SearchSpace.from_text(text)


def test_storage_and_study_errors(sweep_data, tmp_path):
    with pytest.raises(ConfigError, match="neither a URL"):
        make_storage(str(tmp_path / "study.txt"))
    with pytest.raises(ConfigError, match="cannot open the storage postgresql://u:\\*\\*\\*@127.0.0.1:1/x"):
        make_storage("postgresql://u:secret@127.0.0.1:1/x")
    url = f"sqlite:///{tmp_path}/study.db"
    study_for(url, objective_for(tmp_path / "a"))
    with pytest.raises(ConfigError, match="--directions maximize"):
        study_for(url, objective_for(tmp_path / "a", directions=("maximize", "minimize")))
    with pytest.raises(ConfigError, match="other sweep settings"):
        study_for(url, objective_for(tmp_path / "a", space=SPACE.replace("high = 3", "high = 2")))
    with pytest.raises(ConfigError, match="drafter has 3 layers"):
        objective_for(tmp_path / "a", space=SPACE.replace("high = 2", "high = 3", 1))


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=2)
    save_prompt_sets(root)
    (root / "space.toml").write_text("[params.calibration_prompts]\ntype = 'int'\nlow = 2\nhigh = 3\n"
                                     "[params.criterion]\ntype = 'categorical'\nchoices = ['tau', 'speedup']\n"
                                     "[fixed]\nlayers_to_remove = 1\nstop_on_speedup = false\n")
    return root


def sweep_args(root, out, *extra):
    return ["sweep", "--study", "cli", "--out", str(out), "--drafter", str(root / "drafter"), "--target",
            str(root / "target"), "--prompts", str(root / "calib.jsonl"), "--eval-prompts", str(root / "eval.jsonl"),
            "--space", str(root / "space.toml"), "--max-new-tokens", "12", "--retention-floor", "0.05",
            "--cache-dir", str(out / "cache"), "--no-wandb", *extra]


def test_sweep_cli_runs_and_summarizes(pair_dirs, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(sweep_args(pair_dirs, out, "--n-trials", "2", "--max-shard-size", "10000", "--json", "-")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["COMPLETE"] + summary["counts"].get("PRUNED", 0) == 2
    assert (out / "optuna.db").is_file() and summary["best"]["checkpoint"]
    assert len(weight_files(summary["best"]["checkpoint"])) > 1  # written in shards of at most 10 kB
    assert main(["sweep", "--study", "cli", "--out", str(out), "--summary", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["best"] == summary["best"]
    assert main(["sweep", "--study", "cli", "--out", str(out), "--summary"]) == 0
    table = capsys.readouterr().out
    assert "best trial" in table and str(summary["best"]["number"]) in table


def test_sweep_cli_scores_from_recorded_outputs_without_the_targets_weights(pair_dirs, tmp_path, capsys, monkeypatch):
    import shutil

    recorded = tmp_path / "ar.jsonl"
    for name in ("calib", "eval"):  # the target's outputs of the calibration, then the evaluation prompts
        assert main(["bench", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
                     "--prompts", str(pair_dirs / f"{name}.jsonl"), "--max-new-tokens", "12", "--decoder", "ar",
                     "--save-outputs", str(tmp_path / f"{name}.jsonl"), "--json", str(tmp_path / "bench.json"),
                     "--cache-dir", str(tmp_path / "cache")]) == 0
        with open(recorded, "a") as handle:
            handle.write((tmp_path / f"{name}.jsonl").read_text())
    shutil.copytree(pair_dirs, tmp_path / "pair")
    (tmp_path / "pair" / "target" / "model.safetensors").unlink()
    monkeypatch.setattr("models.target.load_target", lambda *a, **k: pytest.fail("the target's weights loaded"))
    monkeypatch.delenv(PINNED_TIMES_ENV)  # no pass times pinned either
    args = sweep_args(tmp_path / "pair", tmp_path / "sweep", "--n-trials", "1", "--ar-outputs", str(recorded))
    assert "--pass-times" in error_of(capsys, args)  # it ranks trials by predicted speedup
    assert main(args + ["--pass-times", str(tmp_path / "bench.json"), "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["COMPLETE"] == 1 and summary["best"]["predicted_speedup"] > 0


def error_of(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("Error: ") and "Traceback" not in err
    return err


def test_sweep_cli_errors(pair_dirs, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert "not a mode" in error_of(capsys, sweep_args(pair_dirs, out, "--n-trials", "1", "--directions", "minimize"))
    assert "--n-trials" in error_of(capsys, sweep_args(pair_dirs, out))
    assert "no study 'nope'" in error_of(capsys, ["sweep", "--study", "nope", "--out", str(out), "--summary"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[params.depth]\ntype = 'int'\nlow = 1\nhigh = 2\n")
    args = sweep_args(pair_dirs, out, "--n-trials", "1")
    args[args.index("--space") + 1] = str(bad)
    assert "unknown setting 'depth'" in error_of(capsys, args)
    assert "neither a URL" in error_of(capsys, sweep_args(pair_dirs, out, "--n-trials", "1", "--storage", "x.txt"))


def test_trials_share_one_timing_and_wait_while_an_earlier_trial_measures_it(sweep_data, tmp_path):
    objective = objective_for(tmp_path / "out")
    study = optuna.create_study(storage=make_storage(f"sqlite:///{tmp_path}/study.db", None))
    first, second = study.ask(), study.ask()
    score = objective.config.score
    start = time.monotonic()
    timing = objective.study_timing(second, score, wait_s=1.0)  # trial 0 runs without timing: wait, then measure
    assert time.monotonic() - start >= 1.0
    key = f"timing/packed_budget={score.decode.packed_budget}/cpu/float32"  # device and dtype in the key
    assert timing["layers"] == 3 and study.user_attrs == {key: timing}
    assert objective.study_timing(first, score) == timing  # read back, not measured again


def test_a_trials_measurement_loads_its_final_drafter_in_the_runs_dtype(sweep_data, tmp_path, monkeypatch):
    """The sweep measures a trial's final step on the device and in the dtype its campaign computed in
    (bfloat16 on the CPU here), not in load_drafter's default float32 on the CPU."""
    import copy
    from dataclasses import replace

    import sweeps.objective
    import torch

    from prune.state import BaseRecord, RunState, StepRecord, Timing

    half = copy.deepcopy(sweep_data.drafter).to(torch.bfloat16)
    objective = PruningObjective(sweep_config(tmp_path), SearchSpace.from_text(SPACE),
                                 replace(sweep_data, drafter=half), log=lambda *_: None)
    save_drafter(half, tmp_path / "step-01")
    evaluated, real_evaluate = [], sweeps.objective.evaluate

    def evaluate(model, *args, **kwargs):
        evaluated.append(next(model.parameters()).dtype)
        return real_evaluate(model, *args, **kwargs)

    monkeypatch.setattr(sweeps.objective, "evaluate", evaluate)
    monkeypatch.setattr(sweeps.objective, "exported_checkpoint", lambda out, folder: str(out / folder))
    step = StepRecord(step=1, folder="step-01", removed=[0], removed_original=[0], layers=3, tau_before_heal=2.0,
                      tau=2.0, retention=1.0, heal_rolled_back=False, predicted_speedup=None, heal_loss=[], scores=[])
    state = RunState({}, "source", Timing.from_dict({"layers": 3, "draft": [1.0, 0.5], "packed": [2.0, 0.75],
                                                     "target": None}),
                     BaseRecord(2.0, None, None), [step], "layer budget")
    metrics = objective.measure(state, tmp_path)
    assert evaluated == [torch.bfloat16, torch.bfloat16] and metrics["eval_tau"] > 1  # base, then step-01
