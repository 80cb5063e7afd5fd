"""Healing after layer removal: a short fine-tune with the drafter's own training loss.

What trains is a table (`TRAINERS`, named by prune.config.HEAL_WEIGHTS): LoRA adapters (peft), merged into
the weights with `merge_and_unload` after, or the decoder layers themselves. Either way the heal runs
`prune.training.loop.train` with the block-diffusion loss on the distillation data, and the healed drafter is
again a plain `Qwen3ForCausalLM` that saves and loads without peft. Settings: prune.config.HealConfig. The
caller decides whether to keep the result (docs/design.md, Progressive pruning: keep the pre-heal weights
when a heal lowers tau). `heal_folder` is `prune heal`: one longer heal of an exported drafter, distilled from
its unpruned source, checkpointed and exported like a step (docs/design.md, Healing a finished drafter).
"""

import copy
import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from models.checkpoint import atomic_write_text, ensure_writable_output
from models.drafter import load_drafter
from models.shards import DEFAULT_MAX_SHARD_SIZE
from models.errors import CheckpointError, ConfigError
from models.faults import fault_point
from prune.training.config import TrainConfig
from prune.training.loop import train
from prune.training.loss import Example

from .cache import fingerprint
from .config import HealConfig, complete_settings, settings_record
from .export import export_step, read_report, resolve_export_dtype

CHECKPOINT_EVERY = 10  # updates between checkpoints of a resumable heal (a minute or two on two CPU cores)


def train_config(config: HealConfig, checkpoint_dir=None, progress: bool = False, label: str = "heal") -> TrainConfig:
    """The training loop's settings for a heal (prune.training.config.TrainConfig).

    `checkpoint_dir`: keep the adapter's training state there every `CHECKPOINT_EVERY` updates, and continue
    from it when it holds a checkpoint of these settings (a long heal killed midway resumes). `progress`,
    `label`: show the updates on stderr under that name."""
    return TrainConfig(
        steps=config.steps, batch_size=config.batch_size, lr=config.lr,
        warmup_steps=min(config.warmup_steps, config.steps), blocks_per_sequence=config.blocks_per_sequence,
        max_length=config.max_length, gamma=config.gamma, distill_weight=config.distill_weight, seed=config.seed,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        checkpoint_every=CHECKPOINT_EVERY if checkpoint_dir else 0, progress=progress, progress_label=label,
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


def merge_lora(peft_model) -> torch.nn.Module:
    """The plain drafter with the adapters folded into its weights."""
    return peft_model.merge_and_unload()


def unfreeze_decoder(model: torch.nn.Module, config: HealConfig) -> torch.nn.Module:
    """A copy of `model` whose decoder layers and final norm train; the embedding (tied to the head) stays, so
    the vocabulary's rows keep the meaning the drafter's other layers read."""
    trainable = copy.deepcopy(model)
    for name, param in trainable.named_parameters():
        param.requires_grad_(".layers." in name or name.endswith("model.norm.weight"))
    return trainable


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with no weight left trainable, as a loaded drafter is."""
    return model.requires_grad_(False)


@dataclass(frozen=True)
class Trainer:
    """How a heal trains (one entry of TRAINERS): `prepare(model, config)` makes a trainable copy, `finish`
    turns the trained copy into the plain drafter to keep."""

    prepare: Callable[[torch.nn.Module, HealConfig], torch.nn.Module]
    finish: Callable[[torch.nn.Module], torch.nn.Module]


TRAINERS: dict[str, Trainer] = {
    "lora": Trainer(add_lora, merge_lora),
    "full": Trainer(unfreeze_decoder, freeze),
}


def heal(model: torch.nn.Module, examples: list[Example], config: HealConfig, device=None, teacher=None,
         checkpoint_dir=None, progress: bool = False, label: str = "heal"):
    """Fine-tune a copy of `model` on `examples` (what trains: `config.train`, TRAINERS); returns (healed
    model, loss history).

    `teacher`: the drafter `model` was pruned from (or a prune.training.loss.Teacher around it), matched with
    weight `config.distill_weight`.
    `checkpoint_dir`, `progress`, `label`: as in `train_config`."""
    config.validate()
    if config.steps == 0:
        return copy.deepcopy(model), []
    trainer = TRAINERS[config.train]
    trainable = trainer.prepare(model, config)
    history = train(trainable, examples, train_config(config, checkpoint_dir, progress, label), device=device,
                    teacher=teacher if config.distill_weight > 0 else None)
    fault_point("heal")
    return trainer.finish(trainable).eval(), history


def heal_folder(source, destination, teacher_dir, examples: list[Example], config: HealConfig, data: list[str],
                dtype: torch.dtype | None = None, overwrite: bool = False, progress: bool = False,
                drafter_keys: dict | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    """Heal the drafter folder `source` (distilled from the drafter folder `teacher_dir`) and export it to
    `destination` with `source`'s pruning history and a record of the heal; returns that record.

    The adapter's training state is kept in `checkpoint_folder(destination)` and the heal continues from it
    when rerun with the same source, teacher, data and settings (another combination is refused); the folder
    is removed once the export is complete. `drafter_keys`: the drafter keys of a source or teacher whose
    config.json lacks them (models.drafter.load_drafter); `max_shard_size`: as in prune.export.export_step.
    """
    ensure_writable_output(destination, overwrite)
    source, teacher_dir = Path(source).resolve(), Path(teacher_dir).resolve()
    model, teacher = load_drafter(source, drafter_keys=drafter_keys), load_drafter(teacher_dir, drafter_keys=drafter_keys)
    keys = ("vocab_size", "block_size", "mask_token_id", "hidden_size")
    differ = [k for k in keys if getattr(model.config, k, None) != getattr(teacher.config, k, None)]
    if differ:
        raise ConfigError(f"{source} and the teacher {teacher_dir} differ in {', '.join(differ)}: the teacher must "
                          "be the drafter SOURCE was pruned from; pass that one with --teacher")
    record = {"source": str(source), "teacher": str(teacher_dir), "data": [str(d) for d in data],
              "examples": len(examples), "settings": asdict(config)}
    identity = {**record, "source_hash": fingerprint(model), "teacher_hash": fingerprint(teacher)}
    checkpoints = checkpoint_folder(destination)
    marker = checkpoints / "heal.json"
    if marker.is_file() and _recorded(marker) != settings_record(identity):
        raise CheckpointError(f"{checkpoints} holds a heal of another source, teacher, data or settings; delete "
                              "it to start over, or rerun that heal's command")
    checkpoints.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps(identity, indent=2, sort_keys=True, default=str) + "\n")
    started = time.monotonic()
    healed, history = heal(model, examples, config, teacher=teacher, checkpoint_dir=checkpoints / "adapter",
                           progress=progress)
    losses = [h["loss"] for h in history]
    record.update(loss_first=losses[0], loss_last=losses[-1], loss=losses,
                  seconds_this_call=round(time.monotonic() - started, 1))
    report, steps = read_report(source)
    report["heal"] = record
    entry = {"step": "heal", "layers": healed.config.num_hidden_layers}
    export_step(healed, destination, source, report, [*steps, entry],
                dtype=dtype or resolve_export_dtype(None, source), overwrite=overwrite, max_shard_size=max_shard_size)
    shutil.rmtree(checkpoints)
    return record


def _recorded(marker: Path) -> dict:
    """The identity a killed heal recorded, with the settings added since (e.g. `train`) at their defaults:
    what that version trained, so its checkpoint continues under the same flags."""
    return complete_settings(json.loads(marker.read_text()), {"settings": settings_record(HealConfig())})


def checkpoint_folder(destination) -> Path:
    """Where `heal_folder` keeps the adapter's training state for `destination`: a sibling folder holding
    heal.json (what is healed, with what) and adapter/ (the training loop's checkpoint)."""
    destination = Path(destination)
    return destination.with_name(destination.name + ".heal-checkpoint")
