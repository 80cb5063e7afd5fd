"""The shipped demo drafter (models/demo_drafter): present, valid, loadable, paired with its tokenizer."""

import json

import torch
from transformers import AutoTokenizer

from models.demo import demo_drafter_dir
from models.drafter import load_drafter, validate_checkpoint
from models.inference import masked_logits

MAX_BYTES = 60 * 10**6


def test_demo_drafter_validates_and_is_small():
    folder = demo_drafter_dir()
    config = validate_checkpoint(folder)
    assert config.num_hidden_layers == 36 and config.block_size == 16 and config.model_type == "qwen3"
    assert list(config.original_layer_indices) == list(range(36))
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= MAX_BYTES
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    card = (folder / "README.md").read_text()
    for word in ("tau", "humaneval", "champ", "prune train-drafter", "steps"):
        assert word in card


def test_demo_drafter_loads_and_drafts_real_tokens():
    folder = demo_drafter_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    drafter = load_drafter(folder)
    config = drafter.config
    assert config.mask_token_id == len(tokenizer) == config.draft_vocab_size
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt").input_ids
    block = torch.full((1, config.block_size), config.mask_token_id)
    with torch.no_grad():
        hidden = drafter.model(input_ids=torch.cat([ids, block], 1)).last_hidden_state
        logits = masked_logits(drafter, hidden[0, ids.shape[1] :])
    assert torch.isfinite(logits.max(-1).values).all()
    assert (logits.argmax(-1) < len(tokenizer)).all()  # never the mask id or a padding row
