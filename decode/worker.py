"""The worker thread that runs the async decoder's packed pass while the caller's thread verifies.

One worker is created on first use and reused by every decode call (and by the timing of concurrent
passes), so no call pays for a new thread; likewise one CUDA stream per GPU (`draft_stream`) carries
every drafter pass on that GPU. On a CPU the two concurrent passes would otherwise each ask
for every core and fight over them; `thread_split` gives the worker `draft_threads` intra-op threads and
the caller the rest while both passes run (torch's thread count is per thread), then restores the
caller's count, so a round without a packed pass verifies and drafts with every core. On a GPU the passes run on their own streams and the split does nothing.
"""

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_WORKER: ThreadPoolExecutor | None = None
_WORKER_THREADS: int | None = None  # the worker's intra-op thread count, once set
_STREAMS: dict[int, "torch.cuda.Stream"] = {}  # GPU index -> the drafter's stream there
_STREAMS_LOCK = threading.Lock()


def _forget_worker() -> None:
    # A forked child inherits the executor object but not its thread: submitting to it would wait forever.
    # Nor can it use its parent's CUDA streams (or wait on a lock another thread of the parent held).
    global _WORKER, _WORKER_THREADS, _STREAMS_LOCK
    _WORKER, _WORKER_THREADS = None, None
    _STREAMS.clear()
    _STREAMS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_worker)


def draft_worker() -> ThreadPoolExecutor:
    """The shared single-thread executor of packed passes."""
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3d-draft")
    return _WORKER


def draft_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The CUDA stream of drafter passes on `device`, made once per GPU and shared by every draft engine
    (None off CUDA). Engines share it safely: each pass waits for the caller's stream and ends with a
    host read of its predictions (decode/engine.py)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        if index not in _STREAMS:
            _STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return _STREAMS[index]


def default_draft_threads(total: int) -> int:
    """Intra-op threads for the drafter's packed pass out of `total`: a quarter, at least one.

    The drafter is small and its passes are bound by per-operation overhead, which more threads do not
    shorten; the target's verify pass is bound by its weights' memory traffic and arithmetic, which they
    do. On 2 cores this gives one thread each.
    """
    return max(1, total // 4)


@contextlib.contextmanager
def thread_split(device: torch.device, draft_threads: int | None = None):
    """Within the block, the worker runs `draft_threads` threads and the caller the remaining ones (CPU)."""
    if device.type != "cpu":
        yield
        return
    total = torch.get_num_threads()
    draft = draft_threads or default_draft_threads(total)
    torch.set_num_threads(max(1, total - draft))
    global _WORKER_THREADS
    if _WORKER_THREADS != draft:  # a round trip to the worker only when its count changes
        draft_worker().submit(torch.set_num_threads, draft).result()
        _WORKER_THREADS = draft
    try:
        yield
    finally:
        torch.set_num_threads(total)
