"""What a drafter was trained on: a digest of every training prompt, kept in the drafter's folder.

A drafter that saw a prompt in training accepts far more of the target's tokens on it than on a new one
(the demo drafter before the three-way suite split: tau 4.79 on prompts it was trained on, 2.52 on held-out
ones), so layer scores calibrated on such prompts measure memory, not the layer. `prune run`, `prune score`,
`prune sweep` and `prune bench` compare their prompts with this record and warn on overlap.

File `training-prompts.json` beside config.json (copied with the tokenizer files whenever the drafter is
saved, so pruned steps keep it):

    {"format": 1, "digest": "sha256(prompt.strip())[:16]",
     "sets": [{"name": "demo-distill", "prompts": 2176, "sha256": "...", "digests": ["3f2a...", ...]}, ...]}

`sets[i].sha256` hashes the set's sorted digests (one line each): two drafters trained on the same prompts
show the same value. config.json carries the summary (`training_prompt_sets`: name, prompts, sha256) and the
model card lists it. A prompt is its user message: a record's "prompt", else its last user message.
"""

import hashlib
import json
import os
from pathlib import Path

FILE = "training-prompts.json"
FORMAT = 1


def prompt_digest(text: str) -> str:
    """16 hex digits of sha256 of the stripped prompt text (collisions are negligible below 10^9 prompts)."""
    return hashlib.sha256(text.strip().encode()).hexdigest()[:16]


def record_text(record: dict) -> str:
    """The user message of a prompt record: "prompt", else the last user turn of "messages"."""
    if record.get("prompt"):
        return record["prompt"]
    users = [m.get("content", "") for m in record.get("messages") or [] if m.get("role") == "user"]
    return users[-1] if users else ""


def prompt_set(name: str, texts: list[str]) -> dict:
    """One entry of the file: `{name, prompts, sha256, digests}` for the distinct prompts in `texts`."""
    digests = sorted({prompt_digest(text) for text in texts if text.strip()})
    return {"name": name, "prompts": len(digests),
            "sha256": hashlib.sha256("".join(d + "\n" for d in digests).encode()).hexdigest(), "digests": digests}


def summary(sets: list[dict]) -> list[dict]:
    """The config.json / model-card view of `sets`: name, prompts and sha256 of each."""
    return [{key: entry[key] for key in ("name", "prompts", "sha256")} for entry in sets]


def training_prompts_text(sets: list[dict]) -> str:
    """The file's contents for `sets` (entries of `prompt_set`)."""
    return json.dumps({"format": FORMAT, "digest": "sha256(prompt.strip())[:16]", "sets": sets}) + "\n"


def read_training_prompts(folder: str | os.PathLike) -> list[dict] | None:
    """The recorded sets of a drafter folder, or None when it records none (trained elsewhere, or before)."""
    file = Path(folder) / FILE
    if not file.is_file():
        return None
    document = json.loads(file.read_text())
    if document.get("format") != FORMAT:
        return None
    return document["sets"]


def overlap(sets: list[dict], texts: list[str]) -> tuple[int, dict[str, int]]:
    """(how many distinct `texts` some set holds, `{set name: how many it holds}` for the sets holding any)."""
    wanted = {prompt_digest(text) for text in texts if text.strip()}
    found, per_set = set(), {}
    for entry in sets:
        held = wanted & set(entry["digests"])
        if held:
            found |= held
            per_set[entry["name"]] = len(held)
    return len(found), per_set
