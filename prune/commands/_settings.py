"""Settings dataclasses <-> flags: one table that `prune run`, `score`, `sweep`, `heal` and `train-drafter`
build their settings from, and read `--config FILE.toml` through.

A setting has one name, its dataclass field's. In a config file it is that field under its dataclass's
section (SECTIONS: `[run] min_retention`, `[heal] rank`, `[decode] packed_budget`); on the command line it is
the flag `--` + the command's prefix for the section + the field, with dashes (`--min-retention`; `prune run`
prefixes the heal section, `--heal-rank`); a switch that turns a setting off is `--no-` + the field
(`--no-stop-on-speedup`). A field whose flag a command lacks is still a setting of it, read from the file
alone (the expert knobs: `[heal] dropout`, `[decode] fan_out`, ...). INTERNAL names the fields that neither a
flag nor a file sets, and why. Flags given on the command line override the file (`given_dests`), so the
settings a command builds, and a run records, are the file's merged with the flags.

Nothing here imports torch.
"""

import argparse
import difflib
import functools
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Callable

from decode.config import DecodeConfig
from models.errors import ConfigError, one_of
from prune.config import FINISHING_HEAL, HealConfig, RunConfig, ScoreConfig
from prune.training.config import TrainConfig
from sweeps.config import TRIAL_BOOTSTRAP, SweepConfig

# The section of each settings dataclass in a config file.
SECTIONS: dict[type, str] = {RunConfig: "run", SweepConfig: "sweep", ScoreConfig: "score", DecodeConfig: "decode",
                             HealConfig: "heal", TrainConfig: "train"}

# (section, field) -> why no flag and no file sets it.
INTERNAL: dict[tuple[str, str], str] = {
    ("decode", "block_size"): "every round may verify the drafter's whole block; `prune bench --block-size` limits it",
    ("decode", "width_policy"): "--width and the measured pass times choose it",
    ("decode", "candidate_policy"): "--candidates and the measured pass times choose it",
    ("decode", "gate_policy"): "scoring and pruning draft every round",
    ("decode", "tree_branches"): "scoring and pruning verify chains; `prune bench` and `generate` have --tree-branches",
    ("decode", "temperature"): "scoring and pruning decode greedily",
    ("decode", "seed"): "it seeds sampling, and scoring and pruning decode greedily",
    ("decode", "stop_ids"): "they are the pair's end-of-sequence ids",
    ("train", "distill_weight"): "it weighs a teacher drafter, and train-drafter trains without one",
    ("train", "resume"): "train-drafter always resumes a checkpoint of the same settings",
    ("train", "progress_label"): "it names the progress bar",
}


@dataclass(frozen=True)
class Rule:
    """How a flag's value differs from its field's (the default: not at all; a list becomes a tuple).

    Attributes:
        dest: the flag's dest before the command's prefix (default: the field's name).
        negate: the flag says the opposite (`--no-progress` sets `progress` false); a file gives the field.
        to_field: the field's value of the flag's (a file's value is the flag's, and passes the same checks).
    """

    dest: str | None = None
    negate: bool = False
    to_field: Callable | None = None


RULES: dict[tuple[str, str], Rule] = {
    ("run", "check_tokens"): Rule(to_field=lambda tokens: tokens or None),  # 0: as many as max_new_tokens
    ("train", "progress"): Rule(dest="no_progress", negate=True),
    ("decode", "context_vocab"): Rule(dest="no_context_vocab", negate=True),
}


@dataclass(frozen=True)
class Binding:
    """The settings of one command.

    Attributes:
        base: the settings it starts from (a file-only setting the file leaves out keeps its value here).
        prefixes: section -> prefix of its flags' dests ("heal_": --heal-rank).
        dests: (section, field) -> dest, where a flag's dest is not the rule's (one --seed seeds everything).
        shared: dests that set several fields (every field mapped to one must be meant to).
    """

    base: Callable[[], object]
    prefixes: dict[str, str] = field(default_factory=dict)
    dests: dict[tuple[str, str], str] = field(default_factory=dict)
    shared: frozenset[str] = frozenset()


BINDINGS: dict[str, Binding] = {
    "run": Binding(RunConfig, {"heal": "heal_"}, {("heal", "seed"): "seed"}, frozenset({"seed"})),
    "score": Binding(ScoreConfig),
    "sweep": Binding(lambda: SweepConfig(study="", out="", score=ScoreConfig(bootstrap=TRIAL_BOOTSTRAP)),
                     {"heal": "heal_"}, {("heal", "seed"): "seed"}, frozenset({"seed"})),
    "heal": Binding(lambda: FINISHING_HEAL),
    "train-drafter": Binding(TrainConfig),
}


@dataclass(frozen=True)
class Setting:
    """One field of a command's settings: where it is (`path` from the command's settings dataclass, its
    `section` and `name` in a file), the dest of its flag, its type and its rule."""

    path: str
    section: str
    name: str
    dest: str
    kind: object
    rule: Rule

    @property
    def key(self) -> str:
        return f"[{self.section}] {self.name}"

    def to_field(self, value):
        """The field's value of its dest's value."""
        if self.rule.negate:
            value = not value
        if self.rule.to_field is not None:
            value = self.rule.to_field(value)
        return tuple(value) if isinstance(value, list) else value


@functools.cache
def settings_of(command: str) -> tuple[Setting, ...]:
    """Every setting of `command` (a BINDINGS name), in field order (a nested section's where its field is).
    Raises RuntimeError where two fields meet on a dest the binding does not share."""
    binding = BINDINGS[command]
    found: list[Setting] = []

    def walk(settings, path: str) -> None:
        section = SECTIONS[type(settings)]
        hints = typing.get_type_hints(type(settings))
        for f in fields(settings):
            value = getattr(settings, f.name)
            if is_dataclass(value):
                walk(value, f"{path}{f.name}.")
            elif (section, f.name) not in INTERNAL:
                rule = RULES.get((section, f.name), Rule())
                dest = binding.dests.get((section, f.name),
                                         binding.prefixes.get(section, "") + (rule.dest or f.name))
                found.append(Setting(path + f.name, section, f.name, dest, _kind(hints[f.name]), rule))

    walk(binding.base(), "")
    dests = [s.dest for s in found]
    clashes = {d for d in dests if dests.count(d) > 1} - binding.shared
    if clashes:
        raise RuntimeError(f"prune {command}: settings meet on dests {sorted(clashes)}; give one a dest or share it")
    return tuple(found)


def sections_of(command: str) -> list[str]:
    """The sections a config file of `command` may hold, in table order."""
    return list(dict.fromkeys(s.section for s in settings_of(command)))


def build(args, command: str, overrides: dict | None = None):
    """The settings dataclass of `command` from its parsed flags `args` (a file's values are in them already,
    `read_config`): each setting whose dest `args` holds takes its value, the others keep the binding's
    base. `overrides`: {path: value} that the command computes ("score.decode": the tuned DecodeConfig)."""
    overrides = overrides or {}
    by_path = {s.path: s for s in settings_of(command)}

    def fill(settings, path: str):
        changes = {}
        for f in fields(settings):
            where = path + f.name
            if where in overrides:
                changes[f.name] = overrides[where]
            elif is_dataclass(getattr(settings, f.name)):
                changes[f.name] = fill(getattr(settings, f.name), where + ".")
            elif where in by_path and hasattr(args, by_path[where].dest):
                changes[f.name] = by_path[where].to_field(getattr(args, by_path[where].dest))
        return replace(settings, **changes)

    return fill(BINDINGS[command].base(), "")


def section_values(args, section: str) -> dict:
    """{field: value} of the settings of `section` that the command of `args` reads from its flags or file
    (args.command; {} for a command without a binding): how shared builders (prune.commands._common
    .decode_configs) take the settings a file gives."""
    command = getattr(args, "command", None)
    if command not in BINDINGS:
        return {}
    return {s.name: s.to_field(getattr(args, s.dest)) for s in settings_of(command)
            if s.section == section and hasattr(args, s.dest)}


def config_help(command: str) -> str:
    first = settings_of(command)[0]
    sections = sections_of(command)
    listed = ("sections " if len(sections) > 1 else "section ") + ", ".join(f"[{name}]" for name in sections)
    return (f"TOML settings: {listed} keyed by field ({first.key} = ... is {_flag(first)}; also the expert "
            "settings no flag sets); flags given override it (default: none)")


def add_config_arg(parser, command: str) -> None:
    """--config FILE.toml of a command of BINDINGS (read by `read_config` once the flags are parsed)."""
    from . import _types

    parser.add_argument("--config", default=None, metavar="FILE.toml", type=_types.text_file, help=config_help(command))


def given_dests(parser: argparse.ArgumentParser, arguments: list[str]) -> set[str]:
    """The dests of the flags `arguments` give (not their defaults): the command line's settings, which
    override a config file's. Parses `arguments` again with every default suppressed."""
    saved, defaults = [(action, action.default) for action in parser._actions], dict(parser._defaults)
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, _ = argparse.ArgumentParser.parse_known_args(parser, arguments)
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(defaults)
    return set(vars(namespace))


def read_config(parser: argparse.ArgumentParser, command: str, namespace, arguments: list[str]) -> None:
    """Set the dests of `namespace` that the config file `namespace.config` gives and the command line
    `arguments` do not. Raises ConfigError, one line naming the file and the key, for a file that is no
    TOML, an unknown section or key, a value of the wrong type or out of its flag's range, or one flag
    given two values."""
    path = namespace.config
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}); fix the file given with --config") from None
    settings = settings_of(command)
    actions = {action.dest: action for action in parser._actions}
    values: dict[str, tuple[Setting, object]] = {}
    for section, table in document.items():
        for setting, value in _entries(path, command, settings, section, table):
            given = _flag_value(path, setting, value, actions.get(setting.dest))
            if setting.dest in values and values[setting.dest][1] != given:
                other = values[setting.dest][0]
                raise ConfigError(f"{path}: {other.key} and {setting.key} are one setting here ({_flag(setting)}) "
                                  "and differ; give one value")
            values[setting.dest] = setting, given
    explicit = given_dests(parser, arguments)
    for dest, (_, value) in values.items():
        if dest not in explicit:
            setattr(namespace, dest, value)


def _entries(path, command: str, settings: list[Setting], section: str, table):
    """(setting, value) of each key of `section` of a config file, or a ConfigError naming what is unknown."""
    names = {s.section: [] for s in settings}
    for s in settings:
        names[s.section].append(s.name)
    if not isinstance(table, dict):
        home = next((s.section for s in settings if s.name == section), None)
        where = f"put it under [{home}]" if home else f"prune {command} reads sections {_listed(names)}"
        raise ConfigError(f"{path}: {section} is outside a section; {where}")
    if section not in names:
        raise ConfigError(f"{path}: unknown section [{section}]; prune {command} reads {_listed(names)}")
    by_name = {s.name: s for s in settings if s.section == section}
    for key, value in table.items():
        if key in by_name:
            yield by_name[key], value
            continue
        if (section, key) in INTERNAL:
            raise ConfigError(f"{path}: [{section}] {key} is no setting of prune {command}: "
                              f"{INTERNAL[section, key]}; remove it")
        close = difflib.get_close_matches(key, names[section], n=1)
        hint = f"did you mean {close[0]}?" if close else f"the keys of [{section}] are {', '.join(names[section])}"
        raise ConfigError(f"{path}: unknown key [{section}] {key}; {hint}")


def _listed(names: dict) -> str:
    return ", ".join(f"[{name}]" for name in names)


def _flag(setting: Setting) -> str:
    return "--" + setting.dest.replace("_", "-")


def _flag_value(path, setting: Setting, value, action):
    """The value a config file's `value` of `setting` gives its dest: the field's type checked, then the
    flag's own type and choices where the command has the flag (so a file and a flag take the same values)."""
    where = f"{path}: {setting.key} = {json.dumps(value, default=str)}"
    if not _fits(value, setting.kind):
        raise ConfigError(f"{where} is not {_describe(setting.kind)}; give one")
    if setting.rule.negate:
        value = not value
    if setting.kind is float and not isinstance(value, list):
        value = float(value)
    if action is None or action.nargs == 0:
        return value
    items = []
    for item in value if isinstance(value, list) else [value]:
        if action.type is not None:
            try:
                item = action.type(str(item))
            except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if action.choices is not None and item not in action.choices:
            raise ConfigError(f"{where}: choose {one_of(action.choices)}")
        items.append(item)
    return items if isinstance(value, list) else items[0]


def _kind(annotation):
    """The type a setting's value has in a file: `int | None` -> int; tuples stay tuple[X, ...]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        present = [a for a in typing.get_args(annotation) if a is not type(None)]
        return present[0] if len(present) == 1 else annotation
    return annotation


def _fits(value, kind) -> bool:
    if typing.get_origin(kind) is tuple:
        return isinstance(value, list) and all(_fits(item, typing.get_args(kind)[0]) for item in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind) if isinstance(kind, type) else True


def _describe(kind) -> str:
    if typing.get_origin(kind) is tuple:
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(typing.get_args(kind)[0], "values")
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, str(kind))
