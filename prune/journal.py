"""The layer evaluations of an unfinished scoring round, kept on disk so that a killed run loses at most one.

A `ScoringJournal` is the file OUT/scoring-XX.json (XX: the step whose layers the round chooses), the JSON
document `{"key": str, "base": Evaluation, "layers": {"index": LayerScore}}` (prune.scoring), rewritten
atomically (models.checkpoint.atomic_write_text) after the round's baseline evaluation and after each layer.
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
from .scoring import Evaluation, LayerScore

PATTERN = "scoring-*.json"


class ScoringJournal:
    """One scoring round's saved evaluations: `base` (Evaluation or None) and `layers` ({index: LayerScore})."""

    def __init__(self, file: str | Path, key: str):
        self.file, self.key = Path(file), key
        self.base: Evaluation | None = None
        self.layers: dict[int, LayerScore] = {}
        saved = _read(self.file)
        if saved.get("key") == key:
            self.base = Evaluation(**saved["base"]) if saved.get("base") else None
            self.layers = {int(i): LayerScore(**s) for i, s in saved.get("layers", {}).items()}

    @classmethod
    def for_round(cls, out, step: int, *keyed) -> "ScoringJournal":
        """The journal of the round that chooses step `step`'s layers in run folder `out`; `keyed`: the JSON
        values and modules its evaluations depend on (fingerprinted into the key)."""
        return cls(Path(out) / f"scoring-{step:02d}.json", fingerprint("scoring-round", step, *keyed))

    def add_base(self, evaluation: Evaluation) -> None:
        """Record the round's baseline (the drafter with all its layers)."""
        self.base = evaluation
        self._save()

    def add_layer(self, score: LayerScore) -> None:
        """Record one layer's score."""
        self.layers[score.layer] = score
        self._save()

    def record(self, base: Evaluation, layers: list[LayerScore]) -> None:
        """Record a whole round at once (one taken from the score cache)."""
        self.base = base
        self.layers = {score.layer: score for score in layers}
        self._save()

    def remove(self) -> None:
        self.file.unlink(missing_ok=True)

    def _save(self) -> None:
        document = {"key": self.key, "base": asdict(self.base) if self.base is not None else None,
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
