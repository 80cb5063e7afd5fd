"""Export one pruning step as a self-describing drafter folder (docs/design.md, Progressive pruning).

The folder is written atomically (models.checkpoint.atomic_folder through save_drafter): safetensors with no
tensor of a removed layer (one model.safetensors, or the hub's shards and index above a size, models/shards.py), a config whose `original_layer_indices` name the kept layers (0-based, in the
unpruned drafter), the tokenizer files and `generation_config.json` of the source, a model card with the
pruning history and the dtype of the weights, and `prune_report.json` holding the settings, the history, the
dtype and the sha256 of every other file (every shard). Exports keep the dtype the source drafter is stored in unless told
otherwise (`resolve_export_dtype`).
"""

import json
import shutil
from pathlib import Path

import torch

from models.checkpoint import folder_hashes
from models.drafter import save_drafter
from models.shards import DEFAULT_MAX_SHARD_SIZE, stored_dtype
from models.precision import dtype_name

from . import __version__
from .text import number

REPORT_NAME = "prune_report.json"


def model_card(history: list[dict], source: str, dtype: str, folder: str = "path/to/this/folder",
               draft_vocab: dict | None = None) -> str:
    """A README for an exported drafter: what it is, its dtype (a torch name), its draft vocabulary (the config
    entry, models/draft_vocab.py; None: it has none), how to load it and generate with it (`folder`: its path as
    exported), the history table."""
    rows = "\n".join(
        f"| {h['step']} | {_removed(h)} | {h['layers']} | {_cell(h.get('tau_before_heal'))} | "
        f"{_cell(h.get('tau'))} | {_cell(h.get('retention'))} | {_cell(h.get('predicted_speedup'))} |"
        for h in history
    )
    return f"""# Pruned block-diffusion drafter

Exported by d3d-prune {__version__} from `{source}`. Weights are stored in **{dtype}**.

A plain `Qwen3ForCausalLM` checkpoint: load it with `AutoModelForCausalLM.from_pretrained(folder)`.
`config.json` carries `block_size`, `mask_token_id` and `original_layer_indices` (the 0-based indices,
in the unpruned drafter, of the layers kept here).{_vocab_note(draft_vocab)}

Generate with it (d3d-prune installed; TARGET is the target model folder or `.gguf` file it drafts for):

```python
from decode.generator import Generator
print(Generator("{folder}", "TARGET").generate("Write a haiku about the sea.").text)
```

or from a shell: `prune generate --drafter {folder} --target TARGET --prompt "Write a haiku about the sea."`

| step | removed (original index) | layers | tau before heal | tau | retention | predicted speedup |
|---|---|---|---|---|---|---|
{rows}

`prune_report.json` holds the settings, per-step layer scores and the sha256 of every file in this folder.
"""


def _removed(step: dict) -> str:
    """What a history row removed: layers (original indices), or the head's rows down to a draft vocabulary."""
    if step.get("head_rows"):
        return f"head rows, {step['head_rows']} ids kept"
    return str(step.get("removed_original", "-"))


def _vocab_note(draft_vocab: dict | None) -> str:
    """The model card's sentence on a draft vocabulary ("" without one)."""
    if not draft_vocab:
        return ""
    return (f"\nIt proposes only from the {draft_vocab['tokens']} token ids in `{draft_vocab['file']}` (its head is "
            "computed on those rows; the target still verifies over its whole vocabulary). The head on disk is "
            "whole, so plain transformers loads it and proposes from every id.")


def _cell(value) -> str:
    return number(value, 3, whole=True)


def resolve_export_dtype(name: str | None, source_dir) -> torch.dtype:
    """The dtype to export in: `name` ("float32", "bfloat16", "float16"), or, when it is None or "source",
    the dtype the weights in `source_dir` are stored in (a bfloat16 drafter gives bfloat16 steps)."""
    if name in (None, "source"):
        name = stored_dtype(source_dir)
    return getattr(torch, name)


def round_to_dtype(model, dtype: torch.dtype):
    """Round `model`'s parameters in place to values `dtype` can hold, keeping their dtype; returns `model`.

    A run computes in one dtype (float32 by default) and may export in a narrower one. Rounding what it
    measures and keeps working on makes the recorded tau that of the exported weights, and makes the next
    step start from exactly those weights, as a resumed run (which reloads them) does. Buffers are left
    alone: they are not saved (rotary frequencies are recomputed on loading).
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dtype != dtype:
                parameter.copy_(parameter.to(dtype))
    return model


def export_step(model, folder, source_dir, report: dict, history: list[dict], dtype: torch.dtype | None = None,
                overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write `model` as a drafter folder with its model card and report; returns the folder.

    Args:
        source_dir: the unpruned drafter's folder (tokenizer files and generation_config.json come from it).
        report: JSON-ready settings and scores; the dtype and the file hashes are added ("dtype", "files").
        history: one dict per step (step, removed_original, layers, tau_before_heal, tau, retention, ...).
        dtype: the dtype of the saved weights (None: the model's own).
        max_shard_size: the largest weight file (bytes or "80MB"); above it the weights are written as shards.
    """
    source_dir = Path(source_dir)
    stored = dtype_name(dtype or next(model.parameters()).dtype)

    def finish(tmp: Path) -> None:
        if (source_dir / "generation_config.json").is_file():
            shutil.copy2(source_dir / "generation_config.json", tmp / "generation_config.json")
        vocab = getattr(model.config, "draft_vocab", None)
        full = {**report, "tool_version": __version__, "dtype": stored, "history": history,
                **({"draft_vocab": report.get("draft_vocab") or vocab} if vocab else {}),
                "files": folder_hashes(tmp)}
        (tmp / REPORT_NAME).write_text(json.dumps(full, indent=2, sort_keys=True, default=str) + "\n")

    card = model_card(history, str(source_dir), stored, str(folder), getattr(model.config, "draft_vocab", None))
    return save_drafter(model, folder, tokenizer_source=source_dir, overwrite=overwrite, dtype=dtype,
                        extra_files={"README.md": card},
                        before_commit=finish, max_shard_size=max_shard_size)


def read_report(folder) -> tuple[dict, list[dict]]:
    """(settings and records, history) of the export in `folder` (its prune_report.json), without the file
    hashes, which describe that folder only; ({}, []) for a drafter that is not an export."""
    file = Path(folder) / REPORT_NAME
    report = json.loads(file.read_text()) if file.is_file() else {}
    report.pop("files", None)
    return report, report.pop("history", [])


def verify_export(folder) -> list[str]:
    """Names of files whose sha256 no longer matches the export's report (empty when intact)."""
    folder = Path(folder)
    recorded = json.loads((folder / REPORT_NAME).read_text())["files"]
    current = folder_hashes(folder)
    current.pop(REPORT_NAME, None)
    return sorted(name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name))
