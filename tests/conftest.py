"""Shared fixtures: tiny random drafters and saved drafter folders.

The tiny sizes are pairwise distinct (vocab 99, hidden 32, intermediate 37, 4 query heads, 2 KV heads,
head_dim 8) so that a swapped axis fails loudly instead of broadcasting. Ids 0..96 are "real" tokens,
97 is the mask token and 98 is a padding row of the embedding (draft_vocab_size = 97).
"""

import contextlib
import os

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and OpenMP threads that spin on a loaded 2-core machine
# made this suite 5-10x slower (measured: 7 s with one thread, 66 s with two, under a concurrent load).
# Set D3D_TEST_THREADS to use more, e.g. for integration tests on the demo pair.
torch.set_num_threads(int(os.environ.get("D3D_TEST_THREADS", "1")))
# `--dtype auto` picks bfloat16 on CPUs with native bf16; the suite asserts float32 exactness on every
# machine, so auto resolves to float32 here (tests/test_precision.py mocks the detection itself).
os.environ["D3D_PRUNE_AUTO_DTYPE"] = "float32"
# Commands log to W&B by default; tests do not, except those about tracking (they set WANDB_MODE themselves).
os.environ["WANDB_MODE"] = "disabled"

TINY_DRAFTER_SIZES = dict(
    vocab_size=99,
    mask_token_id=97,
    draft_vocab_size=97,
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
TINY_REAL_VOCAB = 97  # ids below this are real tokens


def build_tiny_drafter(num_hidden_layers: int = 2, block_size: int = 4, seed: int = 0, **overrides):
    """A float32 random drafter with the tiny sizes above; `overrides` replace any create_drafter argument."""
    from models.drafter import create_drafter

    kwargs = {**TINY_DRAFTER_SIZES, **overrides}
    return create_drafter(num_hidden_layers=num_hidden_layers, block_size=block_size, seed=seed, **kwargs)


@pytest.fixture(scope="session")
def make_tiny_drafter():
    """Factory fixture: `make_tiny_drafter(num_hidden_layers=2, block_size=4, seed=0, **overrides)`."""
    return build_tiny_drafter


@pytest.fixture(scope="session")
def token_ids():
    """Factory of reproducible random real-token id tensors: `token_ids(*shape, seed=0)`."""

    def make(*shape: int, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, TINY_REAL_VOCAB, shape, generator=generator)

    return make


@pytest.fixture
def saved_tiny_drafter(tmp_path):
    """A tiny 2-layer drafter saved with save_drafter: returns `(model, folder)`."""
    from models.drafter import save_drafter

    model = build_tiny_drafter()
    folder = save_drafter(model, tmp_path / "drafter")
    return model, folder



@contextlib.contextmanager
def export_interrupted_at(monkeypatch, call: int):
    """Within the block, the `call`-th step export of prune.progressive raises KeyboardInterrupt (a kill
    while a step is written); the real export is restored on leaving."""
    from prune import progressive

    real_export, calls = progressive.export_step, []

    def interrupted_export(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real_export(*args, **kwargs)

    monkeypatch.setattr(progressive, "export_step", interrupted_export)
    try:
        yield
    finally:
        monkeypatch.setattr(progressive, "export_step", real_export)
