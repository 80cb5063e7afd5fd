"""The layer evaluations of an unfinished scoring round, kept on disk so that a killed run loses at most one.

A `ScoringJournal` is the file OUT/scoring-XX.json (XX: the step whose layers the round chooses), the JSON
document `{"key": str, "base": Evaluation, "screen_base": Evaluation, "screened": {"index": [Evaluation,
LayerScore]}, "layers": {"index": LayerScore}}` (prune.scoring.ScoringMemory), rewritten atomically
(models.checkpoint.atomic_write_text) after the round's baseline evaluation and after each evaluation.
Its key fingerprints everything those evaluations depend on: the run's settings and pass times, the prompts
and trajectories, and the weights, dtype and device of the drafter being scored. A journal with another key
(a resume with other settings or prompts, another drafter, device or dtype) is never read: it is
overwritten. Floats survive the JSON round trip exactly, so a resumed round scores exactly as an
uninterrupted one. The campaign (prune.progressive) removes a journal once its step is recorded in
state.json, and all of them when the run ends.
"""

import json
from dataclasses import asdict
from pathlib import Path

from models.checkpoint import atomic_write_text

from .cache import fingerprint
from .scoring import Evaluation, LayerScore, ScoringMemory

PATTERN = "scoring-*.json"


class ScoringJournal(ScoringMemory):
    """One scoring round's saved evaluations (prune.scoring.ScoringMemory), in a file."""

    def __init__(self, file: str | Path, key: str):
        super().__init__()
        self.file, self.key = Path(file), key
        saved = _read(self.file)
        if saved.get("key") == key:
            self.base = Evaluation(**saved["base"]) if saved.get("base") else None
            self.screen_base = Evaluation(**saved["screen_base"]) if saved.get("screen_base") else None
            self.screened = {int(i): (Evaluation(**e), LayerScore(**s))
                             for i, (e, s) in saved.get("screened", {}).items()}
            self.layers = {int(i): LayerScore(**s) for i, s in saved.get("layers", {}).items()}

    @classmethod
    def for_round(cls, out, step: int, *keyed) -> "ScoringJournal":
        """The journal of the round that chooses step `step`'s layers in run folder `out`; `keyed`: the JSON
        values and modules its evaluations depend on (fingerprinted into the key)."""
        return cls(Path(out) / f"scoring-{step:02d}.json", fingerprint("scoring-round", step, *keyed))

    def remove(self) -> None:
        self.file.unlink(missing_ok=True)

    def _save(self) -> None:
        document = {"key": self.key, "base": asdict(self.base) if self.base is not None else None,
                    "screen_base": asdict(self.screen_base) if self.screen_base is not None else None,
                    "screened": {str(i): [asdict(e), asdict(s)] for i, (e, s) in sorted(self.screened.items())},
                    "layers": {str(i): asdict(s) for i, s in sorted(self.layers.items())}}
        atomic_write_text(self.file, json.dumps(document) + "\n")


def remove_journals(out) -> None:
    """Remove every scoring journal of run folder `out` (the run has ended)."""
    for file in Path(out).glob(PATTERN):
        file.unlink(missing_ok=True)


def _read(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
