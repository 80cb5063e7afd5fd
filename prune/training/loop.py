"""The training loop for the drafter's loss: building a drafter (`prune train-drafter`) and LoRA healing.

`train(model, dataset, config)` runs AdamW with warmup + cosine/linear decay, gradient clipping and
accumulation, optional bf16 autocast, on any device. Everything random comes from two seeded
`torch.Generator`s (batch order, anchors), so a run is reproducible. Checkpoints (trainable weights,
optimizer, scheduler, generator states, step, loss history) are written atomically to one folder as
safetensors + JSON (no pickle); a later call with the same config resumes from it and ends with the same
weights as an uninterrupted run. Only parameters with `requires_grad` are trained and checkpointed, so
a peft-wrapped model trains its adapters only.
"""

import functools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from models.checkpoint import atomic_folder
from models.errors import CheckpointError, ConfigError
from models.faults import fault_point

from .config import TrainConfig
from .loss import DiffusionBatch, Example, Teacher, build_batch, causal_lm, drafter_loss, sample_anchors

CHECKPOINT_STATE = "trainer_state.json"
# Settings that may change between a run and its resumption without changing its result.
RESUME_FREE_FIELDS = ("eval_every", "checkpoint_every", "checkpoint_dir", "resume", "progress", "progress_label",
                      "max_seconds")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of `config.lr` for optimizer update `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    span = max(1, config.steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape


class _Sampler:
    """Endless shuffled batches of dataset indices; each epoch is a fresh permutation."""

    def __init__(self, size: int, batch_size: int, seed: int):
        self.size, self.batch_size = size, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(size, generator=self.generator)
        self.cursor = 0

    def state(self) -> tuple:
        return self.generator.get_state(), self.order.clone(), self.cursor

    def set_state(self, state: tuple) -> None:
        generator, self.order, self.cursor = state
        self.generator.set_state(generator)

    def next(self) -> list[int]:
        picked = []
        while len(picked) < self.batch_size:
            if self.cursor == self.size:
                self.order, self.cursor = torch.randperm(self.size, generator=self.generator), 0
            take = min(self.batch_size - len(picked), self.size - self.cursor)
            picked += self.order[self.cursor : self.cursor + take].tolist()
            self.cursor += take
        return picked


class _Batches:
    """Micro-batches in the seeded order: each is drawn here (batch order, then anchors) and built on CPU in
    a worker thread while the device computes the one before."""

    def __init__(self, dataset: list[Example], lm_config, config: TrainConfig):
        self.dataset, self.config = dataset, config
        self.sampler = _Sampler(len(dataset), config.batch_size, config.seed)
        self.anchors = torch.Generator().manual_seed(config.seed + 1)
        self.build = functools.partial(
            build_batch, block_size=lm_config.block_size, mask_token_id=lm_config.mask_token_id,
            blocks_per_sequence=config.blocks_per_sequence, max_length=config.max_length,
            pad_multiple=config.pad_multiple, mask_dtype=torch.bfloat16 if config.bf16 else torch.float32)
        self.worker = self.pending = None

    def start(self, worker: ThreadPoolExecutor) -> None:
        """Draw the first micro-batch; `worker` builds this one and every later one."""
        self.worker = worker
        self.pending = self._draw()

    def next(self, device: torch.device) -> DiffusionBatch:
        """The micro-batch drawn last, on `device`; the next one is drawn and its build queued."""
        batch = self.pending[1].result().to(device)
        self.pending = self._draw()
        return batch

    @property
    def rng_before(self) -> tuple:
        """(sampler state, anchor generator state) from before the pending draw: what a checkpoint stores so
        that a resumed run draws that micro-batch again."""
        return self.pending[0]

    def _draw(self):
        """Draw the next micro-batch's examples and anchors (RNG in this thread, in order); (states before the
        draw, the future of the built batch)."""
        before = (self.sampler.state(), self.anchors.get_state())
        examples = [self.dataset[i] for i in self.sampler.next()]
        anchors = [sample_anchors(ex.loss_mask[: self.config.max_length].bool(), self.config.blocks_per_sequence,
                                  self.anchors) for ex in examples]
        return before, self.worker.submit(self.build, examples, anchors=anchors)


class _Optimizer:
    """The trainable parameters of one run, their AdamW optimizer and its learning-rate schedule.

    Matrices are decayed by `config.weight_decay`; norm weights and biases (fewer than 2 dims) are not.
    """

    def __init__(self, model: torch.nn.Module, config: TrainConfig):
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters")
        groups = [
            {"params": [p for _, p in self.params if p.ndim >= 2], "weight_decay": config.weight_decay},
            {"params": [p for _, p in self.params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, config))

    def step(self, config: TrainConfig) -> tuple[float, float]:
        """Clip the gradients (or only measure their norm, `grad_clip` 0), update the weights and advance the
        schedule; returns (global gradient norm before clipping, the learning rate of this update)."""
        trainable = [p for _, p in self.params]
        if config.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([
                torch.linalg.vector_norm(p.grad) for p in trainable if p.grad is not None])))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm, lr


def train(
    model: torch.nn.Module,
    dataset: list[Example],
    config: TrainConfig,
    callback: Callable[[int, torch.nn.Module], dict | None] | None = None,
    device: str | torch.device | None = None,
    teacher: "torch.nn.Module | Teacher | None" = None,
) -> list[dict]:
    """Train `model` on `dataset` with the drafter's loss; return the loss history.

    Args:
        model: a drafter (plain or peft-wrapped); its config gives `block_size` and `mask_token_id`.
        dataset: training sequences; the batch order is drawn from `config.seed`.
        callback: `callback(step, model) -> dict | None`, called in eval mode under `no_grad` every
            `config.eval_every` steps and after the last; a returned dict is merged into that step's record.
        device: where to train (default: where the model is); the model is moved there.
        teacher: a drafter (in eval mode) whose predictions the loss also matches (`config.distill_weight`),
            or a `prune.training.loss.Teacher` around one; moved to `device`, never trained.

    Returns:
        One dict per optimizer update: step (1-based), lr, loss, diff, ar, grad_norm, accept_proxy,
        slot1_acc, seconds (wall time of the update), tokens (query rows processed), plus callback metrics.
    """
    config.validate()
    if not dataset:
        raise ConfigError("the training dataset is empty; generate distillation data first")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device)
    optim = _Optimizer(model, config)
    batches = _Batches(dataset, causal_lm(model).config, config)
    history: list[dict] = []
    step = 0
    folder = Path(config.checkpoint_dir) if config.checkpoint_dir else None
    if folder is not None and config.resume and (folder / CHECKPOINT_STATE).is_file():
        step, history = _load_checkpoint(folder, config, optim.params, optim.optimizer, optim.scheduler,
                                         batches.sampler, batches.anchors)
    teacher = Teacher.of(teacher)
    if teacher is not None:
        teacher.model.to(device)  # read under no_grad only (prune.training.loss), so it is neither trained nor changed
    model.train()
    call_start = time.perf_counter()
    bar = _progress_bar(config.progress, config.progress_label, config.steps, step)
    with bar as advance, ThreadPoolExecutor(1) as worker:
        batches.start(worker)  # the CPU builds the next batch while the device computes this one
        while step < config.steps:
            record = _update(model, batches, optim, config, device, step, teacher)
            step += 1
            history.append(record)
            out_of_time = config.max_seconds > 0 and time.perf_counter() - call_start > config.max_seconds
            last = step == config.steps or out_of_time
            if callback is not None and (last or (config.eval_every and step % config.eval_every == 0)):
                model.eval()
                with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                    record.update(callback(step, model) or {})
                model.train()
            if folder is not None and (last or (config.checkpoint_every and step % config.checkpoint_every == 0)):
                _save_checkpoint(folder, config, step, history, optim.params, optim.optimizer, optim.scheduler,
                                 batches.rng_before)
                fault_point("train-checkpoint")
            advance(record)
            if out_of_time:
                break
    model.eval()
    return history


def _update(model: torch.nn.Module, batches: _Batches, optim: _Optimizer, config: TrainConfig,
            device: torch.device, step: int, teacher: Teacher | None = None) -> dict:
    """Optimizer update `step` + 1 over `config.grad_accum` micro-batches; returns its history record.

    Losses are averaged over the micro-batches (each backward is scaled by 1 / grad_accum); the record
    reads them back in one host-device sync, after every backward is queued.
    """
    started = time.perf_counter()
    optim.optimizer.zero_grad(set_to_none=True)
    outs, tokens = [], 0
    for _ in range(config.grad_accum):
        batch = batches.next(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            out = drafter_loss(model, batch, config.gamma, config.ar_weight, teacher, config.distill_weight)
        (out.total / config.grad_accum).backward()
        outs.append(out)
        tokens += batch.input_ids.numel()
    sums = {name: sum(float(getattr(o, name).detach()) for o in outs) / config.grad_accum
            for name in ("total", "diff", "ar")}
    sums = {"loss": sums.pop("total"), **sums, "tokens": tokens}
    correct = sum(int(o.slot_correct[0]) for o in outs)
    count = sum(int(o.slot_count[0]) for o in outs)
    accept_sum = sum(float(o.accept_sum) for o in outs)
    accept_blocks = sum(int(o.accept_blocks) for o in outs)
    if not math.isfinite(sums["loss"]):
        raise ConfigError(f"training diverged at step {step + 1} (loss {sums['loss']}); lower the learning "
                          "rate, or turn bf16 off")
    grad_norm, lr = optim.step(config)
    return {
        "step": step + 1, "lr": lr, **sums, "grad_norm": grad_norm,
        "slot1_acc": correct / count if count else float("nan"),
        "accept_proxy": accept_sum / accept_blocks if accept_blocks else float("nan"),
        "seconds": time.perf_counter() - started,
    }


def _progress_bar(enabled: bool, label: str, total: int, done: int):
    """Context manager yielding `advance(record)`: a rich bar with the loss on a terminal, a line now and then in
    a log file (prune.progress), nothing when disabled."""
    import contextlib
    import sys

    @contextlib.contextmanager
    def bar():
        if not enabled:
            yield lambda record: None
            return
        if not sys.stderr.isatty():
            from prune import progress

            with progress.progress_bar(label, total - done, log_every_s=progress.LOG_EVERY_S) as advance:
                yield lambda record: advance()
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[status]}"))
        with Progress(*columns, console=Console(stderr=True)) as progress:
            task = progress.add_task(label, total=total, completed=done, status="")
            yield lambda record: progress.update(
                task, advance=1, status=f"loss {record['loss']:.3f} acc1 {record['slot1_acc']:.3f}")

    return bar()


# ------------------------------------------------------------------------------------------------------
# Checkpoints: trainable weights, optimizer tensors and RNG states as safetensors; the rest as JSON.
# ------------------------------------------------------------------------------------------------------


def _comparable(config: TrainConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if k not in RESUME_FREE_FIELDS}


def _save_checkpoint(folder, config, step, history, params, optimizer, scheduler, rng_before) -> None:
    """Write the state after `step`; `rng_before` = (sampler state, anchor generator state) before the next draw."""
    from safetensors.torch import save_file

    weights = {name: p.detach().to("cpu").contiguous() for name, p in params}
    opt = optimizer.state_dict()
    opt_tensors = {
        f"state.{index}.{key}": value.detach().to("cpu").contiguous()
        for index, state in opt["state"].items()
        for key, value in state.items()
    }
    (sampler_generator, sampler_order, sampler_cursor), anchors = rng_before
    rng = {
        "sampler": sampler_generator,
        "sampler_order": sampler_order,
        "anchors": anchors,
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = state
    state = {
        "step": step,
        "sampler_cursor": sampler_cursor,
        "config": asdict(config),
        "param_names": [name for name, _ in params],
        "optimizer_param_groups": opt["param_groups"],
        "scheduler": scheduler.state_dict(),
        "history": history,
    }
    with atomic_folder(folder, overwrite=True) as tmp:
        save_file(weights, str(tmp / "trainable.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file(rng, str(tmp / "rng.safetensors"))
        (tmp / CHECKPOINT_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))


def _load_checkpoint(folder, config, params, optimizer, scheduler, sampler, anchors):
    from safetensors.torch import load_file

    try:
        state = json.loads((folder / CHECKPOINT_STATE).read_text())
        weights = load_file(str(folder / "trainable.safetensors"))
        opt_tensors = load_file(str(folder / "optimizer.safetensors"))
        rng = load_file(str(folder / "rng.safetensors"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} cannot be read ({exc}); delete it to start over") from None
    saved, current = state["config"], _comparable(config)
    changed = sorted(k for k in current if saved.get(k) != current[k])
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in changed)
        raise ConfigError(f"checkpoint {folder} was written with other settings ({detail}); use the same "
                          "settings to resume, or another checkpoint folder (or resume=False) to start over")
    names = [name for name, _ in params]
    if state["param_names"] != names or set(weights) != set(names):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise CheckpointError(f"checkpoint {folder} holds other trainable tensors (missing {missing[:3]}, "
                              f"unexpected {extra[:3]}); it belongs to another model")
    for name, p in params:
        if tuple(weights[name].shape) != tuple(p.shape):
            raise CheckpointError(f"checkpoint {folder}: {name} has shape {list(weights[name].shape)}, the model "
                                  f"{list(p.shape)}; it belongs to another model")
    with torch.no_grad():
        for name, p in params:
            p.copy_(weights[name])
    opt_state: dict[int, dict] = {}
    for key, value in opt_tensors.items():
        _, index, field = key.split(".", 2)
        opt_state.setdefault(int(index), {})[field] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer_param_groups"]})
    scheduler.load_state_dict(state["scheduler"])
    sampler.set_state((rng["sampler"], rng["sampler_order"], state["sampler_cursor"]))
    anchors.set_state(rng["anchors"])
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    return state["step"], state["history"]
