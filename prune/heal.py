"""Healing after layer removal: a short LoRA fine-tune with the drafter's own training loss, then merged.

The adapter (peft) trains on the distillation data with `prune.training.loop.train` and the block-diffusion
loss, and is merged into the weights with `merge_and_unload`, so the healed drafter is again a plain
`Qwen3ForCausalLM` that saves and loads without peft. The caller decides whether to keep the result
(docs/design.md, Progressive pruning: keep the pre-heal weights when a heal lowers tau).
"""

import copy
import warnings
from dataclasses import dataclass

import torch

from models.errors import ConfigError
from models.faults import fault_point
from prune.training.config import TrainConfig
from prune.training.loop import train
from prune.training.loss import Example

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class HealConfig:
    """LoRA healing settings.

    Attributes:
        steps: optimizer updates (0 disables healing).
        rank, alpha, dropout: LoRA rank, scaling numerator (scale = alpha / rank) and dropout.
        target_modules: module names that get adapters.
        lr, batch_size, warmup_steps, blocks_per_sequence, max_length, gamma: as in `TrainConfig`.
        distill_weight: share of the loss that matches the teacher passed to `heal` (the drafter before
            the layers were removed) instead of the target's tokens (`TrainConfig.distill_weight`).
        seed: seeds adapter initialisation, batch order and anchors.
    """

    steps: int = 40
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    lr: float = 5e-4
    batch_size: int = 4
    warmup_steps: int = 5
    blocks_per_sequence: int = 16
    max_length: int = 320
    gamma: float = TrainConfig.gamma
    distill_weight: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        if self.steps < 0 or self.rank < 1 or self.alpha <= 0:
            raise ConfigError(
                f"heal steps {self.steps} must be >= 0, LoRA rank {self.rank} >= 1 and alpha {self.alpha} > 0 "
                "(--heal-steps, --lora-rank, --lora-alpha)"
            )

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps, batch_size=self.batch_size, lr=self.lr, warmup_steps=min(self.warmup_steps, self.steps),
            blocks_per_sequence=self.blocks_per_sequence, max_length=self.max_length, gamma=self.gamma,
            distill_weight=self.distill_weight, seed=self.seed, progress=False,
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
    history = train(peft_model, examples, config.train_config(), device=device,
                    teacher=teacher if config.distill_weight > 0 else None)
    fault_point("heal")
    merged = peft_model.merge_and_unload()
    return merged.eval(), history
