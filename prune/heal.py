"""Healing after layer removal: a short LoRA fine-tune with the drafter's own training loss, then merged.

The adapter (peft) trains on the distillation data with `prune.training.loop.train` and the block-diffusion
loss, and is merged into the weights with `merge_and_unload`, so the healed drafter is again a plain
`Qwen3ForCausalLM` that saves and loads without peft. Settings: prune.config.HealConfig. The caller decides
whether to keep the result (docs/design.md, Progressive pruning: keep the pre-heal weights when a heal lowers
tau).
"""

import copy
import warnings

import torch

from models.faults import fault_point
from prune.training.config import TrainConfig
from prune.training.loop import train
from prune.training.loss import Example

from .config import HealConfig


def train_config(config: HealConfig) -> TrainConfig:
    """The training loop's settings for a heal (prune.training.config.TrainConfig), without progress output."""
    return TrainConfig(
        steps=config.steps, batch_size=config.batch_size, lr=config.lr,
        warmup_steps=min(config.warmup_steps, config.steps), blocks_per_sequence=config.blocks_per_sequence,
        max_length=config.max_length, gamma=config.gamma, distill_weight=config.distill_weight, seed=config.seed,
        progress=False,
    )


def add_lora(model: torch.nn.Module, config: HealConfig):
    """Wrap a copy of `model` with fresh LoRA adapters (seeded); the input model is untouched."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(config.target_modules), bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads the attribute transformers 5 deprecated; the warning is theirs, not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(config.seed)
        return get_peft_model(copy.deepcopy(model), lora)


def heal(model: torch.nn.Module, examples: list[Example], config: HealConfig, device=None, teacher=None):
    """LoRA-fine-tune a copy of `model` on `examples` and merge it; returns (healed model, loss history).

    `teacher`: the drafter `model` was pruned from, matched with weight `config.distill_weight`."""
    config.validate()
    if config.steps == 0:
        return copy.deepcopy(model), []
    peft_model = add_lora(model, config)
    history = train(peft_model, examples, train_config(config), device=device,
                    teacher=teacher if config.distill_weight > 0 else None)
    fault_point("heal")
    merged = peft_model.merge_and_unload()
    return merged.eval(), history
