"""Drafter training: distillation data, the block-diffusion loss, the training loop, the start from the target.

- `prune.training.prompts`: training prompts kept apart from evaluation: collect_training_prompts.
- `prune.training.data`: distillation data folders (the target's greedy answers, resumable shards) and
  reading them back as training examples: generate_distillation_data, load_examples, split_examples.
- `prune.training.loss`: the training loss L = L_diff + lambda * L_AR in the inference geometry:
  Example, build_batch, drafter_loss.
- `prune.training.loop`: the training loop (AdamW, schedule, resumable checkpoints): train.
- `prune.training.config`: TrainConfig and the defaults of `prune train-drafter` (torch-free).
- `prune.training.transplant`: the drafter's start from its target: drafter_from_target, pca_embedding.
- `prune.training.driver`: `prune train-drafter` as a function: train_demo_drafter.

LoRA healing (prune/heal.py) trains with the same loss and loop. Importing this package imports nothing
heavy; its modules import torch where they need it.
"""
