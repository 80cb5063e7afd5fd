"""The demo drafter's record of training prompts (models/provenance.py), made once from its data.

The folders of its last stage's `--data` (training.json) are taken in that order: the ones in data/ read as
the stage read them (`--partial-data`); the two folders of suite material are not in the repository, but their
prompts are a pure function of the prompt style (the suites' `train` parts, and CHAMP's formats around the
`train` problems), so they are drawn again here. Every set the stage inherited was among its `--data`, so none
comes first, and the file made here is the shipped one byte for byte.

    python -c "from scripts.record_demo_prompts import main; main()"
"""

import json

from pathlib import Path

from models.demo import DEMO_DRAFTER_DIR
from models.provenance import FILE, prompt_set, summary, training_prompts_text
from prune.training.data import training_prompt_set
from prune.training.driver import TRAINING_RECORD
from prune.training.prompts import collect_training_prompts

REPOSITORY = DEMO_DRAFTER_DIR.parent.parent
STYLES = {"demo-distill-calib": ("train", 257), "demo-distill-champ": ("champ", 921)}  # folders never committed


def _prompt_set(folder: str) -> dict:
    name = Path(folder).name
    if name in STYLES:
        style, count = STYLES[name]
        return prompt_set(name, [p["prompt"] for p in collect_training_prompts(count, style=style)])
    return training_prompt_set(REPOSITORY / folder, partial=True)


def main() -> None:
    data = json.loads((DEMO_DRAFTER_DIR / TRAINING_RECORD).read_text())["settings"]["data"]
    sets = [_prompt_set(folder) for folder in data]
    (DEMO_DRAFTER_DIR / FILE).write_text(training_prompts_text(sets))
    config_file = DEMO_DRAFTER_DIR / "config.json"
    config = json.loads(config_file.read_text())
    config["training_prompt_sets"] = summary(sets)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for entry in summary(sets):
        print(entry)
