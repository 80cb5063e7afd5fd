"""W&B tracking: offline runs hold the documented metrics and the model artifact; a broken W&B never stops
a run; the mode follows WANDB_MODE and credentials; the saved dashboard's panels build offline."""

import json
import os
import sys
import time
import uuid

import pytest

import prune.tracking as tracking
from _pairs import save_tiny_pair
from _wandb_log import summarize_run
from prune.cli import main
from prune.state import RunState


@pytest.fixture(autouse=True)
def wandb_env(monkeypatch, tmp_path):
    """Offline W&B with its config, cache and data folders in tmp; tracking's process-wide state reset."""
    monkeypatch.setattr(tracking, "_broken", None)
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_BASE_URL", "WANDB_DISABLED", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=3)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"input_ids": list(range(5, 9 + i))}) for i in range(3)))
    heal = root / "heal"  # a distillation folder as `prune distill` writes it
    heal.mkdir()
    (heal / "manifest.json").write_text(json.dumps({"shards": 1}))
    (heal / "shard-00000.jsonl").write_text("\n".join(
        json.dumps({"id": str(i), "prompt_ids": list(range(5, 9 + i)), "response_ids": list(range(20, 40))})
        for i in range(4)))
    return root


def run_args(root, out, *extra):
    return ["run", "--drafter", str(root / "drafter"), "--target", str(root / "target"), "--prompts",
            str(root / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(out), "--layers-to-remove", "2",
            "--min-retention", "0.01", "--no-stop-on-speedup", "--heal-data", str(root / "heal"), "--heal-steps", "2",
            "--heal-min-drop", "0", "--heal-rank", "2", "--heal-alpha", "4", *extra]


def offline_run(folder, wait_s: float = 60.0):
    """The one offline run log under `folder` and its contents, once its writer has recorded the run."""
    logs = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    # W&B's writer is a separate process; on a loaded machine its last records can land after finish()
    # returns (a CI run once read a log without its run record): read again until the run is complete.
    deadline = time.monotonic() + wait_s
    while True:
        run = summarize_run(logs[0])
        if (run["run"] is not None and run["exit"] is not None) or time.monotonic() > deadline:
            return logs[0], run
        time.sleep(0.2)


def test_prune_run_writes_an_offline_run_with_the_documented_metrics(pair_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(run_args(pair_dirs, out)) == 0
    assert "Warning" not in capsys.readouterr().err
    log, run = offline_run(out)  # WANDB_DIR defaults to the run's output folder
    state = json.loads((out / "state.json").read_text())
    assert len(state["history"]) == 2
    assert state["heal_data"] == [f"{pair_dirs / 'heal'} x1"] == run["config"]["heal_data"]

    assert run["run"].job_type == "run"
    assert list(run["run"].tags) == [tracking.drafter_tag(run["config"]["drafter_hash"])]
    assert run["config"]["settings"]["layers_to_remove"] == 2 and run["config"]["settings"]["heal"]["steps"] == 2
    keys = {key.split("/_")[0] for row in run["history"] for key in row}  # tables log as NAME/_type, ...
    history_metrics = {name for name in tracking.METRICS if not name.startswith(("base/", "final/", "sweep/"))}
    history_metrics -= {"layer_scores_bar"}  # a chart: its data is logged as layer_scores_bar_table
    assert history_metrics <= keys, history_metrics - keys
    assert "layer_scores_bar_table" in keys and "_wandb/visualize/layer_scores_bar" in run["config"]

    steps = [row for row in run["history"] if "pruning/tau" in row]
    assert [row[tracking.STEP_AXIS] for row in steps] == [0, 1, 2]
    assert [row["pruning/tau"] for row in steps[1:]] == [h["tau"] for h in state["history"]]
    losses = [row["heal/loss"] for row in run["history"] if "heal/loss" in row]
    assert losses == [loss for h in state["history"] for loss in h["heal_loss"]] and len(losses) == 4
    summary = run["summary"]
    assert summary["final/tau"] == state["history"][-1]["tau"] and summary["final/layers"] == 1
    assert summary["final/layers_removed"] == 2 and summary["final/stopped_by"] == "layer budget"
    assert summary["final/equal_tau_speedup"] is not None
    assert summary["final/equal_tau_speedup"] == pytest.approx(RunState.from_dict(state).equal_tau_speedup(1))

    tables = sorted((log.parent / "files" / "media" / "table").glob("layer_scores_[0-9]*.table.json"))
    first = json.loads(tables[0].read_text())
    assert "original_layer" in first["columns"] and len(first["data"]) in (3, 2)
    heatmap = json.loads(next((log.parent / "files" / "media" / "table").glob("layer_scores_heatmap*")).read_text())
    assert len(heatmap["data"]) == 3 + 2  # 3 layers scored at step 1, 2 at step 2
    assert len(list((log.parent / "files" / "media" / "images").glob("plots/*.png"))) == 3

    models = [a for a in run["artifacts"] if a.type == "model"]
    assert len(models) == 1 and "latest" in models[0].aliases
    files = {entry.path for entry in models[0].manifest.contents}
    assert {"config.json", "model.safetensors", "prune_report.json"} <= files
    assert json.loads(models[0].metadata)["layers"] == 1


def test_head_steps_are_logged_beside_layer_steps(pair_dirs, tmp_path):
    out = tmp_path / "out"
    assert main(run_args(pair_dirs, out, "--vocab-sizes", "64,40", "--layers-to-remove", "1")) == 0
    _, run = offline_run(out)
    steps = [row for row in run["history"] if "pruning/tau" in row]
    # the unpruned head's 97 proposable rows, two head steps at no layer removed, then a layer step keeping 40
    assert [(row[tracking.STEP_AXIS], row["pruning/head_rows"]) for row in steps] == [(0, 97), (0, 64), (0, 40),
                                                                                     (1, 40)]
    assert [any(key.startswith("layer_scores") for key in row) for row in steps] == [False, False, False, True]
    assert run["summary"]["final/head_rows"] == 40 and json.loads(run["artifacts"][-1].metadata)["head_rows"] == 40


def test_prune_score_is_a_wandb_run(pair_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert main(["score", "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
                 "--prompts", str(pair_dirs / "prompts.jsonl"), "--max-new-tokens", "12", "--bootstrap", "20",
                 "--no-cache", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    _, run = offline_run(tmp_path)
    assert run["run"].job_type == "score" and run["summary"]["base/tau"] == report["base"]["tau"]
    assert any("layer_scores/_type" in row for row in run["history"])


def test_no_wandb_flag_and_disabled_mode_log_nothing(pair_dirs, tmp_path, monkeypatch):
    assert main(run_args(pair_dirs, tmp_path / "a", "--no-wandb")) == 0
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main(run_args(pair_dirs, tmp_path / "b")) == 0
    assert not list(tmp_path.glob("*/wandb"))


def test_wandb_missing_warns_once_and_the_run_goes_on(pair_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert main(run_args(pair_dirs, tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert err.count("Warning: W&B tracking is off") == 1 and "ModuleNotFoundError" in err
    assert (tmp_path / "out" / "final").is_dir() and (tmp_path / "out" / "report.md").is_file()


def test_unreachable_wandb_with_a_bad_key_warns_once(pair_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    assert main(run_args(pair_dirs, tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert err.count("Warning: W&B tracking is off") == 1
    assert json.loads((tmp_path / "out" / "state.json").read_text())["stopped_by"] == "layer budget"


def test_mode_follows_wandb_mode_and_credentials(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    env = {"HOME": str(home)}
    assert tracking.resolve_mode(env) == "offline"
    assert tracking.resolve_mode({**env, "WANDB_API_KEY": "k"}) == "online"
    assert tracking.resolve_mode({**env, "WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert tracking.resolve_mode({**env, "WANDB_MODE": "dryrun"}) == "offline"
    assert tracking.resolve_mode({**env, "WANDB_API_KEY": "k"}, enabled=False) == "disabled"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert tracking.resolve_mode(env) == "online"
    assert tracking.resolve_mode({**env, "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"


def panel_metrics(panel) -> set[str]:
    names = set()
    for attribute in ("x", "y", "metrics", "media_keys", "table_name", "with_respect_to"):
        value = getattr(panel, attribute, None)
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                names.add(getattr(item, "name", item))
    names |= {getattr(c.metric, "name", c.metric) for c in getattr(panel, "columns", [])}
    return names


def test_dashboard_builds_offline_with_the_key_panels(capsys, monkeypatch):
    from prune.dashboard import SWEEP_PARAMS, build_workspace

    workspace = build_workspace("team", "proj")
    assert (workspace.entity, workspace.project) == ("team", "proj")
    sections = {s.name: s.panels for s in workspace.sections}
    assert list(sections) == ["Pruning", "Layer scores", "Sweep"]
    kinds = {name: [type(p).__name__ for p in panels] for name, panels in sections.items()}
    assert kinds["Pruning"].count("LinePlot") == 4 and "ParallelCoordinatesPlot" in kinds["Sweep"]
    lines = {tuple(p.y): p.x for p in sections["Pruning"]}
    assert lines[("pruning/tau",)] == lines[("pruning/retention",)] == tracking.STEP_AXIS
    scatter = next(p for p in sections["Sweep"] if type(p).__name__ == "ScatterPlot")
    assert (scatter.x.name, scatter.y.name) == ("final/layers", "sweep/eval_retention")
    assert "plots/layer_scores" in panel_metrics(sections["Layer scores"][0])  # the heatmap
    used = set().union(*(panel_metrics(p) for panels in sections.values() for p in panels))
    params = {f"trial.params.{p}" for p in SWEEP_PARAMS}
    assert params <= used and used - params - {tracking.STEP_AXIS, tracking.HEAL_AXIS} <= set(tracking.METRICS)
    workspace._to_model()  # serializes without a network

    assert main(["dashboard", "--entity", "team", "--project", "proj", "--print"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listing["sections"]] == list(sections)
    assert main(["dashboard", "--entity", "team", "--project", "proj"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and "wandb login" in err and "\n" not in err


def test_a_sweep_trial_is_a_wandb_run_grouped_by_study(pair_dirs, tmp_path, capsys):
    space = tmp_path / "space.toml"
    space.write_text("[params.criterion]\ntype = 'categorical'\nchoices = ['tau', 'speedup']\n"
                     "[fixed]\nlayers_to_remove = 1\nstop_on_speedup = false\nheal_steps = 1\nlora_rank = 2\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--study", "st", "--out", str(out), "--n-trials", "1", "--drafter",
                 str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"), "--prompts",
                 str(pair_dirs / "prompts.jsonl"), "--eval-prompts", str(pair_dirs / "prompts.jsonl"),
                 "--space", str(space), "--max-new-tokens", "12", "--retention-floor", "0.05",
                 "--heal-data", str(pair_dirs / "heal"), "--cache-dir", str(tmp_path / "cache"), "--json", "-"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    _, run = offline_run(out / "trial-0000")
    assert run["run"].run_group == "st" and run["run"].job_type == "trial" and "study-st" in run["run"].tags
    assert run["config"]["trial"]["params"] == best["params"] and run["config"]["trial"]["number"] == 0
    assert run["summary"]["sweep/eval_retention"] == pytest.approx(best["eval_retention"])
    assert run["summary"]["sweep/state"] == "COMPLETE"
    assert json.loads((out / "trial-0000" / "state.json").read_text())["heal_data"] == [f"{pair_dirs / 'heal'} x1"]
    assert [a.type for a in run["artifacts"] if a.type == "model"] == ["model"]


def test_importing_the_cli_stays_cheap():
    import subprocess

    code = ("import sys; from prune.cli import build_parser; build_parser().format_help(); "
            "print([m for m in ('torch', 'optuna', 'wandb', 'wandb_workspaces') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



WANDB_KEY_MARKER = "key-marker-" + "7d2b" * 8
PASSWORD_MARKER = "pw-marker-5f3c9a1e"


def sweep_leaks(pair_dirs, tmp_path, monkeypatch, capfd, storage: str) -> dict[str, list[str]]:
    """Run a one-trial sweep on `storage` with W&B offline and WANDB_KEY_MARKER as the API key; return, per
    marker, the files under tmp_path (the sweep's output, its trial's run, W&B's files, the cache) and the
    printed streams that hold it."""
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY_MARKER)  # the mode stays offline (WANDB_MODE), the key at hand
    space = tmp_path / "space.toml"
    space.write_text("[fixed]\nlayers_to_remove = 1\nstop_on_speedup = false\nheal_steps = 1\nlora_rank = 2\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--study", f"secret-{uuid.uuid4().hex[:8]}", "--out", str(out), "--n-trials", "1",
                 "--storage", storage, "--drafter", str(pair_dirs / "drafter"), "--target", str(pair_dirs / "target"),
                 "--prompts", str(pair_dirs / "prompts.jsonl"), "--eval-prompts", str(pair_dirs / "prompts.jsonl"),
                 "--space", str(space), "--max-new-tokens", "12", "--retention-floor", "0.05",
                 "--heal-data", str(pair_dirs / "heal"), "--cache-dir", str(tmp_path / "cache"), "--json", "-"]) == 0
    offline_run(out / "trial-0000")  # W&B's writer has finished the run's files
    printed = capfd.readouterr()
    written = [path for path in tmp_path.rglob("*") if path.is_file() and not path.is_symlink()]
    assert (out / "trial-0000" / "state.json").is_file() and any(path.suffix == ".wandb" for path in written)
    return {marker: [str(path) for path in written if marker.encode() in path.read_bytes()] +
            [name for name, text in (("stdout", printed.out), ("stderr", printed.err)) if marker in text]
            for marker in (WANDB_KEY_MARKER, PASSWORD_MARKER)}


def test_no_wandb_key_reaches_any_file_a_sweep_writes(pair_dirs, tmp_path, monkeypatch, capfd):
    leaks = sweep_leaks(pair_dirs, tmp_path, monkeypatch, capfd, f"sqlite:///{tmp_path}/study.db")
    assert leaks == {WANDB_KEY_MARKER: [], PASSWORD_MARKER: []}


def test_no_storage_password_reaches_any_file_a_sweep_writes(pair_dirs, tmp_path, monkeypatch, capfd):
    """On the CI PostgreSQL (D3D_TEST_POSTGRES_URL, a superuser's URL): a role whose password is a marker."""
    url = os.environ.get("D3D_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("D3D_TEST_POSTGRES_URL is not set (.ci/run starts a PostgreSQL server and sets it)")
    import sqlalchemy

    role = "d3d_secret_test"
    try:
        engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": 5}, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            exists = connection.execute(sqlalchemy.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
            verb = "ALTER" if exists.first() else "CREATE"
            connection.execute(sqlalchemy.text(f"{verb} ROLE {role} LOGIN PASSWORD '{PASSWORD_MARKER}'"))
            connection.execute(sqlalchemy.text(f"GRANT ALL ON SCHEMA public TO {role}"))
            connection.execute(sqlalchemy.text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"))
            connection.execute(sqlalchemy.text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"))
    except sqlalchemy.exc.OperationalError as exc:
        pytest.skip(f"the PostgreSQL server at D3D_TEST_POSTGRES_URL is unreachable: {str(exc).splitlines()[0]}")
    marked = sqlalchemy.engine.make_url(url).set(username=role, password=PASSWORD_MARKER)
    leaks = sweep_leaks(pair_dirs, tmp_path, monkeypatch, capfd, marked.render_as_string(hide_password=False))
    assert leaks == {WANDB_KEY_MARKER: [], PASSWORD_MARKER: []}
