"""The demo drafter's record of training prompts (models/provenance.py), made once from its data.

The five folders in data/ are read as its stages read them (`--partial-data`); the two folders of suite
material are not in the repository, but their prompts are a pure function of the prompt style (the suites'
`train` parts, and CHAMP's formats around the `train` problems), so they are drawn again here. The sets come
in the order of stage 7's `--data` (every inherited set was among them, so none comes first), so the file
made here is the shipped one byte for byte.

    python -c "from scripts.record_demo_prompts import main; main()"
"""

import json

from models.demo import DEMO_DRAFTER_DIR, DEMO_HEAL_DATA
from models.provenance import FILE, prompt_set, summary, training_prompts_text
from prune.training.data import training_prompt_set
from prune.training.prompts import collect_training_prompts

DATA = tuple(folder for folder, _ in DEMO_HEAL_DATA)  # the shipped folders of the last training mix, in its order
STYLES = (("demo-distill-calib", "train", 257), ("demo-distill-champ", "champ", 921))
SHIPPED_BEFORE_STYLES = 4  # stage 7's --data: the first four shipped folders, the two styles, then everyday1


def main() -> None:
    drawn = [prompt_set(name, [p["prompt"] for p in collect_training_prompts(count, style=style)])
             for name, style, count in STYLES]
    shipped = [training_prompt_set(folder, partial=True) for folder in DATA]
    sets = shipped[:SHIPPED_BEFORE_STYLES] + drawn + shipped[SHIPPED_BEFORE_STYLES:]
    (DEMO_DRAFTER_DIR / FILE).write_text(training_prompts_text(sets))
    config_file = DEMO_DRAFTER_DIR / "config.json"
    config = json.loads(config_file.read_text())
    config["training_prompt_sets"] = summary(sets)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for entry in summary(sets):
        print(entry)
