"""Build the tiny benchmark pair quoted in the decoder notes: a costly target and a cheap trained drafter.

    python tests/make_tiny_pair.py OUT     (then: prune bench --drafter OUT/drafter --target OUT/target
                                             --prompts OUT/prompts.jsonl --max-new-tokens 96)

The target is a 12-layer, 384-wide Llama whose layers are silenced (its next token depends only on the current
one, so a small drafter can learn it) but still computed, so verification costs what such a model costs. The
drafter is a 2-layer, 32-wide Qwen3 block-diffusion drafter (B = 16) trained for 300 steps on the target's own
greedy continuations. Deterministic on one thread.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _pairs import trained_drafter  # noqa: E402

from models.drafter import save_drafter  # noqa: E402


def main(out: str) -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(1)
    target, drafter = trained_drafter(block_size=16, steps=300, target_layers=12, target_hidden=384)
    target.config.eos_token_id = None
    target.save_pretrained(f"{out}/target")
    save_drafter(drafter, f"{out}/drafter", overwrite=True)
    generator = torch.Generator().manual_seed(42)
    with open(f"{out}/prompts.jsonl", "w") as handle:
        for i in range(12):
            length = int(torch.randint(4, 30, (1,), generator=generator))
            ids = torch.randint(0, 97, (length,), generator=generator).tolist()
            handle.write(json.dumps({"id": f"t{i}", "input_ids": ids}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny-pair")
