"""Settings of drafter training and their defaults, in one place; torch-free, so `prune --help` can show them.

- `TrainConfig`: one run of the training loop (`prune.training.loop.train`); LoRA healing builds one too.
- `TRAIN_DRAFTER_DEFAULTS`: the defaults of `prune train-drafter` (the demo drafter's shape, schedule and
  evaluation); the loop settings it shares with `TrainConfig` are taken from there.
"""

from dataclasses import dataclass

from models.errors import ConfigError


@dataclass
class TrainConfig:
    """Settings of one training run. Steps count optimizer updates.

    Attributes:
        steps: optimizer updates in the whole run.
        batch_size: sequences per micro-batch.
        grad_accum: micro-batches per optimizer update (effective batch = batch_size * grad_accum).
        lr: peak learning rate, reached after `warmup_steps`.
        min_lr_ratio: the schedule decays to lr * min_lr_ratio at the last step.
        warmup_steps: linear warmup from 0.
        schedule: "cosine", "linear" or "constant" after the warmup.
        weight_decay: AdamW decay on matrices (norm weights and biases are not decayed).
        beta1, beta2: AdamW betas.
        grad_clip: clip the global gradient norm to this (0 disables).
        bf16: run forward and backward under bfloat16 autocast (weights stay float32).
        blocks_per_sequence: N, mask blocks per training sequence (fewer when the response is short).
        gamma: slot weight decay, w_i = exp(-(i-1)/gamma).
        ar_weight: lambda, weight of the autoregressive loss on the clean stream.
        distill_weight: w in [0, 1]; with a teacher drafter (`train(..., teacher=)`), every supervised row's
            loss is (1 - w) * cross entropy on the target's token + w * KL(teacher || model) over the ids
            inference can propose. Healing uses it to pull a pruned drafter back to the drafter it came from.
        max_length: crop sequences to this many tokens.
        pad_multiple: pad the query length of each batch to a multiple of this.
        seed: seeds batch order and anchors.
        eval_every: call the callback every this many steps (and after the last; 0 = only after the last).
        checkpoint_every: save a checkpoint every this many steps (and after the last; 0 = only after the last).
        checkpoint_dir: the checkpoint folder; None disables checkpoints.
        resume: continue from `checkpoint_dir` when it holds a checkpoint of this config.
        progress: show a progress bar on stderr.
        progress_label: the progress bar's name (a log's lines start with it).
        max_seconds: stop early once this call has trained this long (0 = no limit); for machines lent for a
            fixed time. The stop depends on timing, so such a run is reproducible only up to the step reached.
    """

    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    bf16: bool = False
    blocks_per_sequence: int = 16
    gamma: float = 7.0
    ar_weight: float = 1.0
    distill_weight: float = 0.0
    max_length: int = 1024
    pad_multiple: int = 16
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume: bool = True
    progress: bool = True
    progress_label: str = "train"
    max_seconds: float = 0.0

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        positive = ("steps", "batch_size", "grad_accum", "blocks_per_sequence", "max_length", "pad_multiple")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r} must be a positive integer")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r} must be >= 0")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(f"TrainConfig.schedule = {self.schedule!r}; choose cosine, linear or constant")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"lr {self.lr} must be > 0 and min_lr_ratio {self.min_lr_ratio} in [0, 1]")
        if not self.gamma > 0 or self.ar_weight < 0 or self.grad_clip < 0:
            raise ConfigError(f"gamma {self.gamma} must be > 0, ar_weight {self.ar_weight} and grad_clip "
                              f"{self.grad_clip} >= 0")
        if not 0 <= self.distill_weight <= 1:
            raise ConfigError(f"distill_weight {self.distill_weight} must be in [0, 1]")


_LOOP = TrainConfig()
# Every default `prune train-drafter` shows: TrainConfig's where the command keeps the loop's own, the demo
# drafter's recipe for the rest (a longer schedule on shorter crops than the loop's, and the drafter's sizes).
TRAIN_DRAFTER_DEFAULTS = dict(
    **{name: getattr(_LOOP, name) for name in ("grad_accum", "blocks_per_sequence", "gamma", "ar_weight", "seed",
                                               "max_seconds")},
    steps=2000, batch_size=16, lr=1.5e-3, warmup_steps=100, max_length=512, eval_every=100, checkpoint_every=100,
    layers=36, hidden_size=192, intermediate_size=576, heads=3, kv_heads=1, head_dim=64, block_size=16,
    init="slice", calibration_sequences=48, max_mb=60.0, eval_size=64,
)
