"""The drafter model, its attention masks, layer surgery, checkpoints and target loading.

Importing this package is cheap; torch and transformers load with the submodules that need them.
"""
