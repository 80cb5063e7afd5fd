"""The --heal-data flag of `prune run` and `prune sweep`, and loading the healing examples it names."""

import sys

from . import _types


def add_heal_data_arg(parser) -> None:
    parser.add_argument("--heal-data", default=None, metavar="DIR", type=_types.data_dir,
                        help="distillation data folder for healing (prune distill output) (default: the shipped "
                        "demo data, data/demo-distill, with the demo drafter; none otherwise: no healing)")


def heal_examples(args) -> tuple[list | None, str | None]:
    """The healing examples of --heal-data (or the demo data for the demo drafter) and their folder.

    An unfinished generation is used as far as it goes, with a note: healing needs examples, not all of them.
    """
    from models.demo import DEMO_DISTILL_DIR
    from prune.training.data import MANIFEST, load_examples, read_manifest

    folder = args.heal_data
    if folder is None and args.drafter is None and (DEMO_DISTILL_DIR / MANIFEST).is_file():
        folder = str(DEMO_DISTILL_DIR)
    if folder is None:
        return None, None
    examples = load_examples(folder, partial=True)
    planned = read_manifest(folder).get("num_prompts")
    if planned and len(examples) < planned:
        print(f"note: healing on the {len(examples)} finished examples of {folder} ({planned} planned)",
              file=sys.stderr)
    return examples, folder
