"""The one place that shortens KV caches.

transformers 5.x changed `Cache.crop(n)`: it now takes a *negative* count of tokens to drop and raises on
a positive value (4.x took the length to keep). Every caller goes through `crop_to`, which takes the
length to keep, or `keep_rows`, the batched form used when rows of one cache hold different lengths.
"""

import torch
import transformers
from transformers import DynamicCache

# Older releases name the cache argument `past_key_values` and silently ignore `cache=`, which would
# run every cached forward without its cache: refuse them loudly instead.
if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24):
    raise ImportError(
        f"d3d-prune's decoders need transformers >= 5.24 (found {transformers.__version__}); "
        "install the version pinned in pyproject.toml"
    )


def cache_length(cache: DynamicCache | None) -> int:
    """Number of positions held by `cache` (0 for None or an empty cache)."""
    return 0 if cache is None else cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Truncate every layer of `cache` in place so that it holds exactly the first `length` positions."""
    current = cache.get_seq_length()
    if length > current or length < 0:
        raise ValueError(f"cannot crop a cache of {current} positions to {length}")
    if length < current:
        cache.crop(length - current)


def keep_rows(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Rewrite a batched cache in place so that row r holds the key slots `keep[r]`, left-aligned.

    Args:
        keep: LongTensor of shape `(batch, new_length)`; entry `keep[r, j]` is the old slot index that
            becomes slot j of row r. Rows shorter than `new_length` repeat any valid index as padding;
            the caller masks padded slots out of attention.
    """
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        # keys/values: (batch, kv_heads, length, head_dim)
        index = keep.to(layer.keys.device)[:, None, :, None].expand(
            -1, layer.keys.shape[1], -1, layer.keys.shape[3]
        )
        layer.keys = torch.gather(layer.keys, 2, index)
        layer.values = torch.gather(layer.values, 2, index)
