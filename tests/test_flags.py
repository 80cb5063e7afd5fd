"""Hostile flags on every command: each bad value is a usage error (exit 2) or an `Error:` (exit 1), one
line on stderr that names what to give instead, never a traceback, and no model is loaded to find out.

Two tables: CASES, written by hand (wrong types, a target passed as the drafter and the reverse, unreadable
and empty files, budgets against the drafter's layers, ...), which must name every command; and the rows
derived from the parsers, one per flag with a shared argument type (prune/commands/_types.py), so that a
flag added with a type is checked here without a new row.
"""

import argparse
import importlib
import json
import shutil

import pytest

from _pairs import save_tiny_pair
from prune.cli import main
from prune.commands import COMMANDS, _types

# The arguments each command needs before a derived row's flag can be judged (valid on the tiny pair below).
REQUIRED = {"run": ["--out", "{tmp}/run"], "sweep": ["--study", "s"], "export": ["{drafter}", "{tmp}/export"],
            "validate": ["--drafter", "{drafter}"], "distill": ["--out", "{tmp}/distill"],
            "train-drafter": ["--data", "{data}"], "heal": ["{drafter}", "{tmp}/heal"],
            "vocab": ["{drafter}", "{tmp}/vocab", "--size", "2"]}
PAIR = ["--drafter", "{drafter}", "--target", "{target}"]
RUN = ["--out", "{tmp}/run", *PAIR, "--prompts", "{prompts}"]

# (command, arguments, exit code, a substring of the one line on stderr); a value that fails its type fails
# while it is read, before argparse looks for the command's required arguments (a drafter folder lacking the
# drafter keys once every flag is read: the key flags may give them).
CASES = [
    ("bench", ["--limit", "abc"], 2, "got 'abc'; give an integer >= 1"),
    ("bench", ["--temperature", "nan"], 2, "give a number >= 0"),
    ("bench", ["--max-new-tokens", "-3"], 2, "give an integer >= 1"),
    ("bench", ["--drafter", "{target}"], 2, "is not a block-diffusion drafter"),
    ("bench", ["--drafter", "{drafter}", "--target", "{drafter}"], 2, "pass it as --drafter"),
    ("bench", ["--target", "{plain}"], 2, "give a model folder or a .gguf file"),
    ("bench", ["--prompts", "{binary}"], 2, "is not UTF-8 text"),
    ("bench", ["--prompts", "{tmp}"], 2, "is a folder; give a file"),
    ("bench", ["--prompts", "{tmp}/missing.jsonl"], 2, "does not exist"),
    ("bench", ["--suite", "humaneval:test"], 2, "unknown part 'test'"),
    ("bench", ["--suite", "humaneval", "--prompts", "{prompts}"], 2, "not allowed with argument"),
    ("bench", ["--decoder", "fast"], 2, "unknown decoder"),
    ("bench", ["--dtype", "float8"], 2, "invalid choice"),
    ("bench", ["--json", "{tmp}"], 2, "is a folder; give a file path"),
    ("bench", ["--save-outputs", "{plain}/out.jsonl"], 2, "cannot be created"),
    ("bench", [*PAIR, "--prompts", "{prompts}", "--block-size", "8"], 1, "lower --block-size"),
    ("generate", ["--prompts", "{empty}"], 2, "is empty"),
    ("generate", ["--temperature", "-0.5"], 2, "give a number >= 0"),
    ("generate", [*PAIR], 1, "no prompt; pass --prompt TEXT or --prompts"),
    ("score", ["--bootstrap", "0"], 2, "give an integer >= 1"),
    ("score", ["--batch-size", "1.5"], 2, "got '1.5'"),
    ("score", ["--criterion", "perplexity"], 2, "invalid choice"),
    ("score", ["--prescreen", "tau"], 2, "invalid choice"),
    ("score", ["--prescreen-keep", "0"], 2, "give an integer >= 1"),
    ("score", ["--loss-data", "{tmp}"], 2, "holds no distillation data"),
    ("score", ["--prompts", "{empty}"], 2, "is empty"),
    ("run", ["--min-retention", "1.5"], 2, "give a fraction in (0, 1]"),
    ("run", ["--min-retention", "0"], 2, "give a fraction in (0, 1]"),
    ("run", ["--out", "{plain}"], 2, "is a file; give a folder path"),
    ("run", ["--heal-data", "{tmp}"], 2, "holds no distillation data"),
    ("run", ["--heal-distill-weight", "1.5"], 2, "give a fraction in [0, 1]"),
    ("run", ["--speed-suite", "nosuch"], 2, "unknown prompt suite 'nosuch'"),
    ("run", [*RUN, "--layers-to-remove", "2"], 1, "--layers-to-remove 2 must be in 1..1"),
    ("run", [*RUN, "--per-step", "2"], 1, "--per-step 2 must be below the drafter's 2"),
    ("run", ["--vocab-sizes", "8192,x"], 2, "give sizes separated by commas"),
    ("run", ["--vocab-data", "{tmp}"], 2, "holds no distillation data"),
    ("sweep", ["--retention-floor", "-0.1"], 2, "give a fraction in (0, 1]"),
    ("sweep", ["--directions", "up"], 2, "invalid choice"),
    ("sweep", ["--study", "a/b", "--out", "{tmp}/sweep"], 1, "without slashes"),
    ("sweep", ["--study", "s", "--out", "{tmp}/sweep"], 1, "give --n-trials"),
    ("sweep", ["--study", "nope", "--out", "{tmp}/sweep", "--summary"], 1, "no study 'nope'"),
    ("sweep", ["--study", "s", "--out", "{tmp}/sweep", "--n-trials", "1", *PAIR, "--prompts", "{prompts}",
               "--space", "{big_space}"], 1, "layers_to_remove reaches 2 but the drafter has 2 layers"),
    ("sweep", ["--study", "s", "--out", "{tmp}/sweep", "--storage", "study.txt", "--summary"], 1, "neither a URL"),
    ("dashboard", ["--entity", " "], 2, "give a non-empty one"),
    ("dashboard", [], 1, "needs --entity and --project"),
    ("export", ["{target}", "{tmp}/copy"], 2, "is not a block-diffusion drafter"),
    ("export", ["{drafter}", "{taken}"], 1, "not empty; choose another output path or pass --overwrite"),
    ("export", ["{drafter}", "{tmp}/copy", "--dtype", "int8"], 2, "invalid choice"),
    ("export", ["{drafter}", "{tmp}/copy", "--remove-layers", "1,x"], 2, "give layer indices separated by commas"),
    ("export", ["{drafter}", "{tmp}/copy", "--remove-layers", "-1"], 2, "give distinct layer indices >= 0"),
    ("export", ["{drafter}", "{tmp}/copy", "--remove-layers", "9"], 1, "original layer 9 is not in this drafter"),
    ("heal", ["{target}", "{tmp}/h"], 2, "is not a block-diffusion drafter"),
    ("heal", ["{drafter}", "{tmp}/h"], 1, "does not record the drafter it was pruned from; name it with --teacher"),
    ("heal", ["{drafter}", "{tmp}/h", "--teacher", "{drafter}"], 1, "no healing data: give distillation folders"),
    ("heal", ["{drafter}", "{taken}", "--teacher", "{drafter}", "--data", "{data}"], 1, "not empty"),
    ("heal", ["{drafter}", "{tmp}/h", "--distill-weight", "2"], 2, "give a fraction in [0, 1]"),
    ("heal", ["{drafter}", "{tmp}/h", "--gamma", "0"], 2, "give a number > 0"),
    ("vocab", ["{target}", "{tmp}/v", "--size", "4"], 2, "is not a block-diffusion drafter"),
    ("vocab", ["{drafter}", "{tmp}/v", "--size", "0"], 2, "give an integer >= 1"),
    ("vocab", ["{drafter}", "{tmp}/v"], 2, "the following arguments are required: --size"),
    ("vocab", ["{drafter}", "{tmp}/v", "--size", "4", "--data", "{empty}"], 2, "is empty"),
    ("vocab", ["{drafter}", "{tmp}/v", "--size", "4"], 1, "pass --data"),
    ("vocab", ["{drafter}", "{taken}", "--size", "4"], 1, "not empty"),
    ("validate", ["--drafter", "{tmp}/missing"], 2, "does not exist"),
    ("validate", ["--drafter", "{target}"], 2, "is not a block-diffusion drafter"),
    ("validate", ["--drafter", "{broken}"], 1, "is not a valid safetensors file"),
    ("distill", ["--num-prompts", "-5"], 2, "give an integer >= 1"),
    ("distill", ["--out", "{tmp}/distill", "--target", "{drafter}"], 2, "pass it as --drafter"),
    ("distill", ["--style", "poems"], 2, "invalid choice"),
    ("train-drafter", ["--data", "{tmp}"], 2, "holds no distillation data"),
    ("train-drafter", ["--data"], 2, "expected at least one argument"),
    ("train-drafter", ["--block-size", "65"], 2, "give an integer in 2..64"),
    ("train-drafter", ["--lr", "inf"], 2, "give a number > 0"),
    ("train-drafter", ["--device", "gpu"], 2, "give cpu, cuda or cuda:N"),
    ("train-drafter", ["--data", "{data}", "--init-from", "{target}"], 2, "is not a block-diffusion drafter"),
    ("train-drafter", ["--data", "{data}"], 1, "--out is required"),
    ("train-drafter", ["--data", "{data}", "--out", "{tmp}/t", "--data-weights", "1", "2"], 1, "--data-weights needs"),
]

# Per shared type: a value it must refuse, and a substring of the refusal.
BAD = {
    _types.positive_int: ("0", "give an integer >= 1"),
    _types.non_negative_int: ("-1", "give an integer >= 0"),
    _types.positive_float: ("0", "give a number > 0"),
    _types.non_negative_float: ("-1", "give a number >= 0"),
    _types.positive_fraction: ("1.5", "give a fraction in (0, 1]"),
    _types.fraction: ("1.5", "give a fraction in [0, 1]"),
    _types.block_size: ("1", "give an integer in 2.."),
    _types.layer_indices: ("1,1", "give distinct layer indices >= 0"),
    _types.size: ("80XB", "give a size such as 80MB"),
    _types.name: ("", "give a non-empty one"),
    _types.device: ("gpu", "give cpu, cuda or cuda:N"),
    _types.device_or_auto: ("gpu", "give cpu, cuda or cuda:N"),
    _types.drafter_dir: ("{target}", "is not a block-diffusion drafter"),
    _types.target_path: ("{drafter}", "pass it as --drafter"),
    _types.model_path: ("{tmp}/missing", "does not exist"),
    _types.data_dir: ("{tmp}", "holds no distillation data"),
    _types.text_file: ("{empty}", "is empty"),
    _types.output_file: ("{plain}/out.json", "cannot be created"),
    _types.output_dir: ("{plain}", "is a file; give a folder path"),
    _types.suite: ("nosuch", "unknown prompt suite"),
    _types.suite_or_prompt_file: ("{empty}.jsonl", "does not exist"),
    _types.sizes: ("64,64", "give distinct sizes >= 1"),
    _types.vocab_source: ("{tmp}", "holds no distillation data"),
}


def command_parsers() -> dict:
    """{command name: its parser}, built the way prune.cli builds them."""
    subparsers = argparse.ArgumentParser().add_subparsers()
    for module in COMMANDS:
        module.add_parser(subparsers)
    return dict(subparsers.choices)


def typed_flags():
    """(command, flag, type) of every optional flag whose type is one of prune/commands/_types.py."""
    for command, parser in command_parsers().items():
        for action in parser._actions:
            if action.option_strings and getattr(action.type, "__module__", None) == _types.__name__:
                yield command, action.option_strings[0], action.type


DERIVED = [(command, [*REQUIRED.get(command, ()), flag, BAD[kind][0]], 2, f"argument {flag}: ")
           for command, flag, kind in typed_flags() if kind in BAD]
DERIVED_HINTS = {(command, flag): BAD[kind][1] for command, flag, kind in typed_flags() if kind in BAD}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = save_tiny_pair(tmp_path_factory.mktemp("flags"), drafter_layers=2, block_size=4)
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p0", "input_ids": [5, 6, 7]}) + "\n")
    (root / "empty.jsonl").write_text("\n  \n")
    (root / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x81" * 8)
    (root / "plain.txt").write_text("not a folder\n")
    (root / "big_space.toml").write_text("[fixed]\nlayers_to_remove = 2\n")
    (root / "data").mkdir()
    (root / "data" / "manifest.json").write_text(json.dumps({"shards": 0}))
    (root / "taken").mkdir()
    (root / "taken" / "file").write_text("x")
    shutil.copytree(root / "drafter", root / "broken")
    weights = root / "broken" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (root / "work").mkdir()
    files = {"prompts": "prompts.jsonl", "empty": "empty.jsonl", "binary": "binary.jsonl", "plain": "plain.txt",
             "big_space": "big_space.toml"}
    folders = ("drafter", "target", "data", "taken", "broken")
    return {"tmp": str(root / "work"), **{key: str(root / name) for key, name in files.items()},
            **{name: str(root / name) for name in folders}}


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Every bad flag must be refused before a model loads (or the demo target is fetched)."""

    def refuse(*_, **__):
        raise AssertionError("a model was loaded before the bad flag was refused")

    # Modules that bind these functions by name at import bind the real ones here, not `refuse` for good.
    for module in ("models.pair", "decode.generator", "prune.heal", "prune.progressive", "prune.speed",
                   "sweeps.objective", "prune.trajectories"):
        importlib.import_module(module)
    for where in ("models.pair.load_pair", "models.drafter.load_drafter", "models.target.load_target",
                  "models.demo.resolve_demo_target"):
        monkeypatch.setattr(where, refuse)


def outcome(capsys, argv) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in-process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def check(capsys, paths, command, arguments, code, expected) -> str:
    argv = [part.format(**paths) for part in (command, *arguments)]
    got, err = outcome(capsys, argv)
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1 and "Traceback" not in err, (argv, got, err)
    assert expected.format(**paths) in lines[0], (argv, lines[0])
    assert lines[0].startswith("Error: " if code == 1 else f"prune {command}: error: ")
    return lines[0]


@pytest.mark.parametrize("command, arguments, code, expected", CASES,
                         ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_a_bad_flag_is_one_line_and_no_traceback(capsys, paths, command, arguments, code, expected):
    check(capsys, paths, command, arguments, code, expected)


@pytest.mark.parametrize("command, arguments, code, expected", DERIVED, ids=[f"{c[0]} {c[1][-2]}" for c in DERIVED])
def test_every_typed_flag_refuses_a_bad_value(capsys, paths, command, arguments, code, expected):
    line = check(capsys, paths, command, arguments, code, expected)
    assert DERIVED_HINTS[command, arguments[-2]] in line
    assert line.endswith(f"; see prune {command} --help")


def test_the_tables_cover_every_command_and_every_shared_type():
    commands = set(command_parsers())
    assert commands == {case[0] for case in CASES}, "add a CASES row for each new command"
    kinds = {kind for _, _, kind in typed_flags()}
    assert kinds <= set(BAD), f"add a bad value to BAD for {kinds - set(BAD)}"
    assert len(DERIVED) >= 60  # every command's typed flags, not a few


def test_a_model_config_with_heads_not_a_multiple_of_kv_heads_is_refused():
    from conftest import build_tiny_drafter
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        build_tiny_drafter(num_attention_heads=3, num_key_value_heads=2)
