"""Search spaces of `prune sweep`: a TOML file mapping campaign settings to Optuna distributions.

The file has `[params.NAME]` tables (searched) and a `[fixed]` table (not searched); `default_space.toml`
next to this module documents the format and the names, and is the space used without `--space`.
"""

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from models.errors import ConfigError, one_of
from prune.criteria import CRITERIA

DEFAULT_SPACE = Path(__file__).with_name("default_space.toml")

# Every name a space may set, with the type of its values.
NAMES = {
    "layers_to_remove": int, "min_retention": float, "per_step": int, "stop_on_speedup": bool,
    "criterion": str, "packed_budget": int, "heal_steps": int, "lora_rank": int, "lora_alpha": int,
    "heal_lr": float, "calibration_prompts": int, "vocab_size": int,
}
HEAL_NAMES = ("heal_steps", "lora_rank", "lora_alpha", "heal_lr")
VOCAB_NAMES = ("vocab_size",)  # not searched without the ids' ranking (no head steps)
TYPES = ("int", "float", "categorical")


@dataclass
class Param:
    """One searched setting: an int or float range (optionally stepped or log-scaled) or a set of choices."""

    name: str
    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: list = field(default_factory=list)

    def suggest(self, trial):
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        if self.type == "float":
            return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)
        return trial.suggest_categorical(self.name, self.choices)

    def values_bound(self) -> float:
        """The largest value this parameter can take (numbers only)."""
        return max(self.choices) if self.type == "categorical" else self.high


@dataclass
class SearchSpace:
    """Searched parameters and fixed values, by name (see NAMES)."""

    params: dict[str, Param]
    fixed: dict[str, object]
    source: str = "<text>"

    @classmethod
    def from_file(cls, path=None) -> "SearchSpace":
        path = Path(path) if path is not None else DEFAULT_SPACE
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the search space {path} ({exc.strerror or exc}); check --space") from None
        return cls.from_text(text, str(path))

    @classmethod
    def from_text(cls, text: str, source: str = "<text>") -> "SearchSpace":
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"search space {source} is not valid TOML: {exc}") from None
        unknown_tables = set(document) - {"params", "fixed"}
        if unknown_tables:
            raise ConfigError(f"search space {source}: unknown table(s) {sorted(unknown_tables)}; "
                              "use [params.NAME] and [fixed]")
        params = {name: _param(name, spec, source) for name, spec in document.get("params", {}).items()}
        fixed = dict(document.get("fixed", {}))
        for name, value in fixed.items():
            _check_name(name, source)
            _check_value(name, value, source)
        both = set(params) & set(fixed)
        if both:
            raise ConfigError(f"search space {source}: {sorted(both)} is both searched and fixed; keep one")
        return cls(params, fixed, source)

    def suggest(self, trial) -> dict:
        """Values of every setting for one trial (searched ones suggested by `trial`, then the fixed ones)."""
        values = {name: param.suggest(trial) for name, param in self.params.items()}
        return {**values, **self.fixed}

    def without(self, names) -> "SearchSpace":
        """This space minus some names (e.g. the healing ones when there is no healing data)."""
        return SearchSpace({k: v for k, v in self.params.items() if k not in names},
                           {k: v for k, v in self.fixed.items() if k not in names}, self.source)

    def largest(self, name: str, default):
        """The largest value `name` can take in this space (`default` when the space does not set it)."""
        if name in self.params:
            return self.params[name].values_bound()
        return self.fixed.get(name, default)

    def record(self) -> dict:
        """The space as plain JSON (stored with the study, so workers can check they search the same one)."""
        return json.loads(json.dumps({"params": {k: vars(v) for k, v in sorted(self.params.items())},
                                      "fixed": dict(sorted(self.fixed.items()))}))


def _check_name(name: str, source: str) -> None:
    if name not in NAMES:
        raise ConfigError(f"search space {source}: unknown setting {name!r}; choose from {', '.join(NAMES)}")


def _check_value(name: str, value, source: str) -> None:
    kind = NAMES[name]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(f"search space {source}: {name} = {value!r} must be a {kind.__name__}")
    if name == "criterion" and value not in CRITERIA:
        raise ConfigError(f"search space {source}: criterion = {value!r} is not a criterion; choose {one_of(CRITERIA)}")


def _param(name: str, spec, source: str) -> Param:
    _check_name(name, source)
    if not isinstance(spec, dict) or spec.get("type") not in TYPES:
        raise ConfigError(f"search space {source}: [params.{name}] needs type = one of {', '.join(TYPES)}")
    known = {"type", "low", "high", "step", "log", "choices"}
    extra = set(spec) - known
    if extra:
        raise ConfigError(f"search space {source}: [params.{name}] has unknown key(s) {sorted(extra)}")
    kind = spec["type"]
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"search space {source}: [params.{name}] needs a non-empty choices list")
        for choice in choices:
            _check_value(name, choice, source)
        return Param(name, kind, choices=choices)
    if NAMES[name] not in (int, float) or (kind == "float" and NAMES[name] is int):
        raise ConfigError(f"search space {source}: {name} takes {NAMES[name].__name__} values; "
                          f"use type = \"{'int' if NAMES[name] is int else 'categorical'}\"")
    low, high = spec.get("low"), spec.get("high")
    for key, value in (("low", low), ("high", high)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"search space {source}: [params.{name}] needs a numeric {key}")
        _check_value(name, value if kind == "float" else int(value), source)
    if low > high:
        raise ConfigError(f"search space {source}: [params.{name}] low {low} > high {high}")
    if spec.get("log") and spec.get("step"):
        raise ConfigError(f"search space {source}: [params.{name}] cannot have both step and log")
    if spec.get("log") and low <= 0:
        raise ConfigError(f"search space {source}: [params.{name}] log scale needs low > 0")
    return Param(name, kind, low, high, spec.get("step"), bool(spec.get("log", False)))
