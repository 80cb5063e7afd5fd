"""Export one pruning step as a self-describing drafter folder (DESIGN section 6).

The folder is written atomically (models.checkpoint.atomic_folder through save_drafter): safetensors with no
tensor of a removed layer, a config whose `original_layer_indices` name the kept layers (0-based, in the
unpruned drafter), the tokenizer files and `generation_config.json` of the source, a model card with the
pruning history, and `prune_report.json` holding the settings, the history and the sha256 of every other file.
"""

import json
import shutil
from pathlib import Path

import torch

from models.checkpoint import folder_hashes
from models.drafter import save_drafter

from . import __version__

REPORT_NAME = "prune_report.json"


def model_card(history: list[dict], source: str) -> str:
    """A README for an exported drafter: what it is, how to load it, and the pruning history table."""
    rows = "\n".join(
        f"| {h['step']} | {h.get('removed_original', '-')} | {h['layers']} | {_fmt(h.get('tau_before_heal'))} | "
        f"{_fmt(h.get('tau'))} | {_fmt(h.get('retention'))} | {_fmt(h.get('predicted_speedup'))} |"
        for h in history
    )
    return f"""# Pruned block-diffusion drafter

Exported by d3d-prune {__version__} from `{source}`. A plain `Qwen3ForCausalLM` checkpoint: load it with
`AutoModelForCausalLM.from_pretrained(folder)`. `config.json` carries `block_size`, `mask_token_id` and
`original_layer_indices` (the 0-based indices, in the unpruned drafter, of the layers kept here).

| step | removed (original index) | layers | tau before heal | tau | retention | predicted speedup |
|---|---|---|---|---|---|---|
{rows}

`prune_report.json` holds the settings, per-step layer scores and the sha256 of every file in this folder.
"""


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def export_step(model, folder, source_dir, report: dict, history: list[dict], dtype: torch.dtype | None = None,
                overwrite: bool = False) -> Path:
    """Write `model` as a drafter folder with its model card and report; returns the folder.

    Args:
        source_dir: the unpruned drafter's folder (tokenizer files and generation_config.json come from it).
        report: JSON-ready settings and scores; the file hashes are added under "files".
        history: one dict per step (step, removed_original, layers, tau_before_heal, tau, retention, ...).
    """
    source_dir = Path(source_dir)

    def finish(tmp: Path) -> None:
        if (source_dir / "generation_config.json").is_file():
            shutil.copy2(source_dir / "generation_config.json", tmp / "generation_config.json")
        full = {**report, "tool_version": __version__, "history": history, "files": folder_hashes(tmp)}
        (tmp / REPORT_NAME).write_text(json.dumps(full, indent=2, sort_keys=True, default=str) + "\n")

    return save_drafter(model, folder, tokenizer_source=source_dir, overwrite=overwrite, dtype=dtype,
                        extra_files={"README.md": model_card(history, str(source_dir))}, before_commit=finish)


def verify_export(folder) -> list[str]:
    """Names of files whose sha256 no longer matches the export's report (empty when intact)."""
    folder = Path(folder)
    recorded = json.loads((folder / REPORT_NAME).read_text())["files"]
    current = folder_hashes(folder)
    current.pop(REPORT_NAME, None)
    return sorted(name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name))
