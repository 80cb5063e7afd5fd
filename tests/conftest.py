"""Shared fixtures: tiny random drafters and saved drafter folders.

The tiny sizes are pairwise distinct (vocab 99, hidden 32, intermediate 37, 4 query heads, 2 KV heads,
head_dim 8) so that a swapped axis fails loudly instead of broadcasting. Ids 0..96 are "real" tokens,
97 is the mask token and 98 is a padding row of the embedding (draft_vocab_size = 97).
"""

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from models._wheels import CACHE_ENV, default_cache_dir

# Tiny models gain nothing from intra-op threads, and OpenMP threads that spin on a loaded 2-core machine
# made this suite 5-10x slower (measured: 7 s with one thread, 66 s with two, under a concurrent load).
# Set D3D_TEST_THREADS to use more, e.g. for integration tests on the demo pair.
torch.set_num_threads(int(os.environ.get("D3D_TEST_THREADS", "1")))
# `--dtype auto` picks bfloat16 on CPUs with native bf16; the suite asserts float32 exactness on every
# machine, so auto resolves to float32 here (tests/test_precision.py mocks the detection itself).
os.environ["D3D_PRUNE_AUTO_DTYPE"] = "float32"
# Commands log to W&B by default; tests do not, except those about tracking (they set WANDB_MODE themselves).
os.environ["WANDB_MODE"] = "disabled"

# The user's cache, read once before any test points $D3D_PRUNE_CACHE elsewhere. Tests read its downloads
# (the demo target, the suites' wheels and data) and write nothing else there: every test gets a cache of its
# own whose download folders link to these (see `isolated_cache`).
USER_CACHE = default_cache_dir()
SHARED_CACHE_FOLDERS = ("targets", "wheels", "data")
_SUITE_ROOT = pytest.StashKey[Path]()

# Pass times every test decides on unless it is about timing (marked `measured_times`): the verify width,
# candidate count, gate and stop rules then come out the same on any machine and under any load
# (decode.timing.PinnedTimes). A target step costs several drafter passes and the passes half overlap, so
# the async decoder drafts candidates and speculation pays, as on the demo pair with a quiet CPU.
PINNED_TEST_TIMES = {
    "ar_ms": 10.0, "per_token_ms": 0.2, "step_ms": 0.0, "contention": 0.25,
    "draft": {"fixed_ms": 1.0, "per_layer_ms": 0.1}, "packed": {"fixed_ms": 2.0, "per_layer_ms": 0.2},
}


def linked_cache(folder: Path) -> Path:
    """A fresh cache folder whose download folders link to the user's cache; returns it."""
    folder.mkdir(parents=True)
    for name in SHARED_CACHE_FOLDERS:
        shared = USER_CACHE / name
        shared.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(shared, target_is_directory=True)
    return folder


def pytest_configure(config):
    """Before any fixture of any scope: pinned pass times and a session cache of the suite's own, so that
    module- and session-scoped fixtures (reference runs) never measure or read the user's cache either."""
    from decode.timing import PINNED_TIMES_ENV

    config.addinivalue_line("markers", "measured_times: the test times real passes (no pinned pass times)")
    root = Path(tempfile.mkdtemp(prefix="d3d-prune-tests-"))
    config.stash[_SUITE_ROOT] = root
    pinned = root / "pass-times.json"
    pinned.write_text(json.dumps(PINNED_TEST_TIMES))
    os.environ[PINNED_TIMES_ENV] = str(pinned)
    os.environ[CACHE_ENV] = str(linked_cache(root / "session-cache"))


def pytest_unconfigure(config):
    root = config.stash.get(_SUITE_ROOT, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pinned_times_file() -> Path:
    from decode.timing import PINNED_TIMES_ENV

    return Path(os.environ[PINNED_TIMES_ENV])


@pytest.fixture(autouse=True)
def isolated_cache(request, tmp_path_factory, monkeypatch):
    """Every test gets its own cache folder ($D3D_PRUNE_CACHE); pass times stay pinned unless the test is
    marked measured_times.

    Pass times, trajectories, timings and scores a test writes land in its own folder, so no record from an
    earlier run (one measured under load, say) decides anything and the user's cache is never written; the
    download folders link to the user's cache so that the demo target and suite data are fetched once.
    """
    from decode.timing import PINNED_TIMES_ENV

    cache = linked_cache(tmp_path_factory.mktemp("cache") / "d3d-prune")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    if request.node.get_closest_marker("measured_times"):
        monkeypatch.delenv(PINNED_TIMES_ENV, raising=False)
    return cache


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
