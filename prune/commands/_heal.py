"""Healing data of `prune run`, `prune sweep` and `prune heal`: the --heal-data flags, the demo drafter's default
mix, and loading the examples they name (one resolver, so that every command heals the demo drafter on the same
data it was last trained on); the same resolver gives the loss criterion its held-in data (--loss-data)."""

import sys

from . import _types


def add_heal_data_arg(parser) -> None:
    """--heal-data DIR [DIR ...] and --heal-data-weights W [W ...] of `prune run` and `prune sweep`."""
    parser.add_argument("--heal-data", default=None, metavar="DIR", nargs="+", type=_types.data_dir,
                        help="distillation data folders for healing (prune distill output) (default: the demo "
                        "drafter's shipped folders, models/demo.py DEMO_HEAL_DATA, with the demo drafter; none "
                        "otherwise: no healing)")
    parser.add_argument("--heal-data-weights", default=None, metavar="W", nargs="+", type=_types.positive_int,
                        help="repeat each --heal-data folder's sequences this many times (default: 1 each; the "
                        "demo mix's own weights with its folders)")


def add_loss_data_arg(parser) -> None:
    """--loss-data DIR [DIR ...] and --loss-examples N: the held-in data of the `loss` criterion (prune score,
    run, sweep)."""
    from prune.config import ScoreConfig

    parser.add_argument("--loss-data", default=None, metavar="DIR", nargs="+", type=_types.data_dir,
                        help="distillation data folders (prune distill output) on which the loss criterion measures "
                        "the drafter's training loss without each layer (default: the demo drafter's shipped "
                        "folders, models/demo.py DEMO_HEAL_DATA, with the demo drafter)")
    parser.add_argument("--loss-examples", type=_types.positive_int, default=ScoreConfig.loss_examples, metavar="N",
                        help="sequences the loss criterion draws (seeded by --seed) from --loss-data, 16 blocks each: "
                        "its ranking costs one drafter pass per 8 of them per layer")


def loss_data(args, criteria) -> tuple[str, ...]:
    """The --loss-data folders of `args` (or the demo drafter's shipped ones) when one of the `criteria` names
    (--criterion, --prescreen; None skipped) reads held-in data, else (): settings that nothing reads stay out
    of a run's record and cache keys."""
    from prune.criteria import CRITERIA

    if not any(name and CRITERIA[name].reads == "loss data" for name in criteria):
        return ()
    chosen = heal_data(args.loss_data, None, args.drafter, flags="--loss-data")
    return tuple(chosen[0]) if chosen else ()


def heal_data(folders: list[str] | None, weights: list[int] | None, drafter: str | None,
              flags: str = "--heal-data") -> tuple[list[str], list[int]] | None:
    """(folders, weights) to heal `drafter` on: the given folders, else the demo drafter's shipped mix when
    `drafter` is the demo drafter (None = the demo drafter) and every folder of it is present, else None.

    `flags` names the folder flag in errors (its weights flag is `flags` + "-weights").
    """
    from pathlib import Path

    from models.demo import DEMO_DRAFTER_DIR, DEMO_HEAL_DATA
    from models.errors import ConfigError
    from prune.training.driver import folder_weights

    if folders:
        return list(folders), folder_weights(folders, weights, flags)
    if weights:
        raise ConfigError(f"{flags}-weights weighs {flags} folders; give the folders with {flags}")
    demo = drafter is None or Path(drafter).resolve() == DEMO_DRAFTER_DIR.resolve()
    if not (demo and all(Path(folder).is_dir() for folder, _ in DEMO_HEAL_DATA)):
        return None
    return [str(folder) for folder, _ in DEMO_HEAL_DATA], [weight for _, weight in DEMO_HEAL_DATA]


def load_heal_examples(folders: list[str], weights: list[int]) -> list:
    """Every folder's training examples, repeated `weight` times. An unfinished generation is used as far as
    it goes, with a note: healing needs examples, not all of them."""
    from prune.training.data import load_examples, read_manifest

    examples = []
    for folder, weight in zip(folders, weights):
        found = load_examples(folder, partial=True)
        planned = read_manifest(folder).get("num_prompts")
        if planned and len(found) < planned:
            print(f"note: healing on the {len(found)} finished examples of {folder} ({planned} planned)",
                  file=sys.stderr)
        examples += found * weight
    return examples


def describe(folders: list[str], weights: list[int]) -> list[str]:
    """How a run's record names its healing data: "folder xW" per folder."""
    return [f"{folder} x{weight}" for folder, weight in zip(folders, weights)]


def heal_examples(args) -> tuple[list | None, list[str] | None]:
    """The healing examples of `prune run` / `prune sweep` (--heal-data, or the demo mix for the demo drafter)
    and how the record names them; (None, None) when there is nothing to heal on."""
    chosen = heal_data(args.heal_data, args.heal_data_weights, args.drafter)
    if chosen is None:
        return None, None
    return load_heal_examples(*chosen), describe(*chosen)
