"""Settings from flags and from `--config FILE.toml` (prune/commands/_settings.py: one table from the settings
dataclasses' fields to flags), and the layout of every command's --help (prune/commands/_help.py)."""

import json
import re
import shlex
from dataclasses import fields
from pathlib import Path

import pytest

from _pairs import save_tiny_pair
from prune.cli import build_parser, main
from prune.commands._settings import BINDINGS, INTERNAL, SECTIONS, build, settings_of

REPO = Path(__file__).resolve().parents[1]


def command_parser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("pair"), drafter_layers=2)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 9 + i))})
                                                  for i in range(3)))
    (root / "data").mkdir()
    (root / "data" / "manifest.json").write_text(json.dumps({"shards": 0}))
    return root


def toml(tmp_path, text: str, name: str = "settings.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_every_settings_field_is_a_flag_a_config_key_or_internal():
    reachable = set()
    for command in BINDINGS:
        actions = {action.dest: action for action in command_parser(command)._actions}
        for setting in settings_of(command):
            reachable.add((setting.section, setting.name))
            action = actions.get(setting.dest)
            if action is not None:  # a flag carries its setting's name: --[prefix-]field, or --no-field
                names = {"--" + setting.dest.replace("_", "-"), "--no-" + setting.name.replace("_", "-")}
                assert names & set(action.option_strings), (command, setting.path, action.option_strings)
    for cls, section in SECTIONS.items():
        for f in fields(cls):
            if f.type in SECTIONS:  # a nested section, walked on its own
                continue
            where = (section, f.name)
            assert (where in reachable) != (where in INTERNAL), f"{section}.{f.name}: map it to a flag or list it"
    assert all(reason and (section, name) for (section, name), reason in INTERNAL.items())
    assert {name for (_, name) in INTERNAL} <= {f.name for cls in SECTIONS for f in fields(cls)}
    # A campaign's own settings are all flags (not file-only by a misspelt dest).
    run_flags = {action.dest for action in command_parser("run")._actions}
    assert {s.dest for s in settings_of("run") if s.section == "run"} <= run_flags
    assert {s.dest for s in settings_of("train-drafter")} - {a.dest for a in command_parser("train-drafter")._actions} \
        == {"min_lr_ratio", "schedule", "weight_decay", "beta1", "beta2", "grad_clip", "pad_multiple"}


# The same settings as a config file and as flags; --min-retention given after the file overrides its 0.5.
CONFIG = """
[run]
layers_to_remove = 1
min_retention = 0.5
stop_on_speedup = false
check_try_discount = 0.5
check_tokens = 0

[score]
screen_keep = 3
seed = 3

[decode]
packed_budget = 20

[heal]
rank = 2
distill_weight = 0.5
"""
FLAGS = ["--layers-to-remove", "1", "--min-retention", "0.5", "--no-stop-on-speedup", "--check-try-discount", "0.5",
         "--check-tokens", "0", "--screen-keep", "3", "--seed", "3", "--packed-budget", "20", "--heal-rank", "2",
         "--heal-distill-weight", "0.5"]


def run_args(root, out, *extra):
    return ["run", "--drafter", str(root / "drafter"), "--target", str(root / "target"), "--prompts",
            str(root / "prompts.jsonl"), "--max-new-tokens", "12", "--out", str(out), "--speed-prompts", "0", *extra]


def test_a_config_file_and_the_same_flags_give_the_same_run_state(pair_dirs, tmp_path, capsys):
    config = toml(tmp_path, CONFIG)
    assert main(run_args(pair_dirs, tmp_path / "flags", *FLAGS, "--min-retention", "0.01")) == 0
    assert main(run_args(pair_dirs, tmp_path / "file", "--config", config, "--min-retention", "0.01")) == 0
    capsys.readouterr()
    by_flags, by_file = (json.loads((tmp_path / name / "state.json").read_text())["config"] for name in ("flags", "file"))
    assert by_file == by_flags
    assert by_file["min_retention"] == 0.01 and by_file["stop_on_speedup"] is False  # the flag over the file's 0.5
    assert by_file["check_try_discount"] == 0.5 and by_file["check_tokens"] is None  # 0: as many as max_new_tokens
    assert by_file["score"]["seed"] == by_file["heal"]["seed"] == 3 and by_file["heal"]["rank"] == 2
    assert by_file["score"]["decode"]["packed_budget"] == 20 and by_file["score"]["screen_keep"] == 3


BAD = [
    ("[run]\nmin_retenton = 0.5", "unknown key [run] min_retenton; did you mean min_retention?"),
    ('[run]\nmin_retention = "high"', '[run] min_retention = "high" is not a number'),
    ("[run]\nmin_retention = 1.5", "[run] min_retention = 1.5: got 1.5; give a fraction in (0, 1]"),
    ("[run]\nstop_on_speedup = 1", "[run] stop_on_speedup = 1 is not true or false"),
    ("[heal]\nrank = 2.5", "[heal] rank = 2.5 is not an integer"),
    ('[heal]\ntarget_modules = ["q_proj", 3]', "[heal] target_modules = [\"q_proj\", 3] is not a list of strings"),
    ('[score]\ncriterion = "losss"', "[score] criterion = \"losss\": choose tau, speedup, expected-tau, block-influence"),
    ("min_retention = 0.5", "min_retention is outside a section; put it under [run]"),
    ("[tuning]\nsteps = 1", "unknown section [tuning]; prune run reads [run], [score], [decode], [heal]"),
    ("[decode]\ntemperature = 0.5", "[decode] temperature is no setting of prune run"),
    ("[score]\nseed = 1\n[heal]\nseed = 2", "[score] seed and [heal] seed are one setting here (--seed)"),
    ("[run\n", "is not valid TOML"),
]


@pytest.mark.parametrize("text, expected", BAD, ids=[expected.split(";")[0] for _, expected in BAD])
def test_a_bad_config_file_is_one_line_naming_the_file_and_the_key(pair_dirs, tmp_path, capsys, monkeypatch, text,
                                                                   expected):
    def refuse(*_, **__):
        raise AssertionError("a model was loaded before the config file was read")

    monkeypatch.setattr("models.pair.load_pair", refuse)
    config = toml(tmp_path, text)
    assert main(run_args(pair_dirs, tmp_path / "out", "--config", config)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {config}") and expected in lines[0], lines


def test_each_command_reads_its_sections_and_the_expert_settings_no_flag_sets(pair_dirs, tmp_path):
    run = parse(*run_args(pair_dirs, tmp_path / "o", "--heal-rank", "5", "--config", toml(tmp_path, """
        [run]
        min_retention = 1
        [score]
        timing_repeats = 2
        [decode]
        fan_out = 2
        [heal]
        rank = 2
        dropout = 0
        target_modules = ["q_proj", "v_proj"]""")))
    config = build(run, "run")
    assert config.min_retention == 1.0 and type(config.min_retention) is float  # the JSON of a float, as a flag's
    assert config.score.timing_repeats == 2 and config.heal.target_modules == ("q_proj", "v_proj")
    assert type(config.heal.dropout) is float and config.heal.rank == 5  # the flag over the file
    assert run.fan_out == 2 and config.score.decode.fan_out == 2

    heal = parse("heal", str(pair_dirs / "drafter"), str(tmp_path / "h"), "--alpha", "3", "--config",
                 toml(tmp_path, "[heal]\nrank = 4\nalpha = 8\ndropout = 0.1\nlr = 1e-4\n"))
    healed = build(heal, "heal")
    assert (healed.rank, healed.alpha, healed.dropout, healed.lr, healed.steps) == (4, 3, 0.1, 1e-4, 160)

    train = build(parse("train-drafter", "--data", str(pair_dirs / "data"), "--lr", "0.01", "--config",
                        toml(tmp_path, "[train]\nsteps = 7\nprogress = false\nbeta2 = 0.9\nlr = 0.5\n")), "train-drafter")
    assert (train.steps, train.progress, train.beta2, train.lr, train.batch_size) == (7, False, 0.9, 0.01, 16)

    sweep = build(parse("sweep", "--config", toml(tmp_path, '[sweep]\nstudy = "s1"\ndirections = ["maximize", '
                                                   '"minimize"]\n[heal]\nrank = 4\n[score]\ncriterion = "speedup"\n')),
                  "sweep", {"out": "o"})
    assert (sweep.study, sweep.directions, sweep.heal.rank, sweep.score.criterion) == \
        ("s1", ("maximize", "minimize"), 4, "speedup")
    assert sweep.score.bootstrap == 200  # a trial's own default, kept where the file says nothing

    score = parse("score", "--bootstrap", "60", "--config",
                  toml(tmp_path, "[score]\nbootstrap = 50\nconfidence = 0.9\n[decode]\nmax_new_tokens = 9\n"))
    scored = build(score, "score")
    assert (scored.bootstrap, scored.confidence, score.max_new_tokens) == (60, 0.9, 9)


def test_old_flag_spellings_still_parse_and_are_hidden(pair_dirs, tmp_path):
    run = parse("run", "--out", str(tmp_path / "o"), "--lora-rank", "3", "--lora-alpha", "6", "--heal-distill", "0.5",
                "--no-speedup-stop")
    assert (run.heal_rank, run.heal_alpha, run.heal_distill_weight, run.stop_on_speedup) == (3, 6, 0.5, False)
    heal = parse("heal", str(pair_dirs / "drafter"), str(tmp_path / "h"), "--lora-rank", "3", "--distill", "0.5")
    assert (heal.rank, heal.distill_weight) == (3, 0.5)
    for command, old in (("run", "--lora-rank"), ("run", "--no-speedup-stop"), ("heal", "--distill ")):
        assert old not in command_parser(command).format_help()
    # the Makefile's `make demo` flags
    demo = re.search(r"^DEMO_ARGS \?= (.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    args = parse("run", "--out", str(tmp_path / "demo"), *shlex.split(demo))
    assert args.stop_on_speedup is False and args.layers_to_remove == 2


TOUR = ("--out", "--layers-to-remove", "--limit", "--max-new-tokens", "--heal-steps", "--min-retention", "--resume",
        "--json")


def test_the_first_screen_of_run_help_holds_the_tour_and_expert_flags_come_under_their_heading(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    lines = command_parser("run").format_help().splitlines()
    assert all(len(line) <= 100 for line in lines)  # a line is a terminal row
    first = "\n".join(lines[:40])
    for flag in TOUR:
        assert re.search(rf"^  {flag}\b", first, re.M), f"{flag} is not on the first screen"
    expert = lines.index("expert options:")
    assert any(line.startswith("  --check-try-discount") for line in lines[expert:])
    assert "[expert options]" in first and "--check-try-discount" not in first
    for name in BINDINGS:  # every command with settings: its --config among the first flags, --debug an expert one
        text = command_parser(name).format_help()
        assert text.index("  --config") < text.index("expert options:") < text.index("  --debug")
