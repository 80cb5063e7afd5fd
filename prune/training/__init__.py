"""Drafter training: distillation data, the block-diffusion loss, the training loop, the start from the target.

- `prune.training.data`: distillation data folders: the target's greedy answers to training prompts,
  generated in resumable shards, read back as training `Example`s.
- `prune.training.loss`: the training loss L = L_diff + lambda * L_AR in the inference geometry:
  Example, build_batch, drafter_loss.
- `prune.training.loop`: the training loop (AdamW, schedule, resumable checkpoints): TrainConfig, train.
- `prune.training.transplant`: a drafter sliced from its target (`--init slice`): drafter_from_target.
- `prune.training.driver`: `prune train-drafter` as a library function: train_demo_drafter.

LoRA healing (prune/heal.py) trains with the same loss and loop. Importing this package imports nothing
heavy; its modules import torch.
"""
