"""The one place that shortens KV caches.

transformers 5.x changed `Cache.crop(n)`: it now takes a *negative* count of tokens to drop and raises on
a positive value (4.x took the length to keep). Every caller goes through `crop_to`, which takes the
length to keep, or `keep_rows`, the batched form used when rows of one cache hold different lengths.
"""

import torch
import transformers
from transformers import DynamicCache

from .transfer import upload

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
            the caller masks padded slots out of attention. Uploaded once per device (not once per layer).
    """
    on_device: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        # keys/values: (batch, kv_heads, length, head_dim)
        device = layer.keys.device
        if device not in on_device:
            on_device[device] = upload(keep, device) if keep.device.type == "cpu" else keep.to(device)
        index = on_device[device][:, None, :, None].expand(
            -1, layer.keys.shape[1], -1, layer.keys.shape[3]
        )
        layer.keys = torch.gather(layer.keys, 2, index)
        layer.values = torch.gather(layer.values, 2, index)


class StaticKV:
    """A preallocated key/value cache: one `(rows, kv_heads, capacity, head_dim)` buffer pair per layer.

    Every row holds `length` key slots (rows of a batch pad to the longest; the caller masks padding).
    A pass reserves room for its Q new slots, writes each layer's keys and values there, reads the
    buffers up to `length + Q` as views (no copy), and finally advances `length`. Capacity doubles when
    a pass would overflow it, so the cost of growth is amortised and no pass concatenates.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.shape = (rows, kv_heads, max(1, capacity), head_dim)
        self.keys = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def reserve(self, new_slots: int) -> None:
        """Make room for `new_slots` slots after `length` (copies the valid part once when growing)."""
        needed = self.length + new_slots
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        self.shape = (*self.shape[:2], capacity, self.shape[3])
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = old.new_empty(self.shape)
                grown[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = grown

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `(rows, kv_heads, Q, head_dim)` keys/values after `length`; return the layer's keys and
        values up to `length + Q` (views)."""
        end = self.length + keys.shape[2]
        self.keys[layer][:, :, self.length : end] = keys
        self.values[layer][:, :, self.length : end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, new_slots: int) -> None:
        self.length += new_slots

    def crop(self, length: int) -> None:
        """Keep the first `length` slots of every row."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Row r keeps the old slots `keep[r]` `(rows, new_length)`, left-aligned (see `keep_rows`).

        Only the slots that move are copied: after a pass a row keeps its old prefix where it is and moves
        a few new slots down, so a full gather would copy the whole cache to change a handful of slots.
        `keep` is read where it is (the host, for the draft engine): the moving slots are found there and
        sent to the device in one non-blocking copy, so trimming costs the device no sync.
        """
        new_length = keep.shape[1]
        self.reserve(max(0, new_length - self.length))
        rows, slots = (keep != torch.arange(new_length, device=keep.device)).nonzero(as_tuple=True)
        if len(rows):
            sources = keep[rows, slots]
            device = self.keys[0].device
            if keep.device != device:
                rows, slots, sources = upload(torch.stack([rows, slots, sources]), device).unbind(0)
            for buffers in (self.keys, self.values):
                for buffer in buffers:
                    buffer[rows, :, slots] = buffer[rows, :, sources]  # the right side is read first
        self.length = new_length


class DynamicKV:
    """A transformers `DynamicCache` behind the interface of `StaticKV` (length, crop, keep_rows)."""

    def __init__(self, cache: DynamicCache):
        self.cache = cache

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        crop_to(self.cache, length)

    def keep_rows(self, keep: torch.Tensor) -> None:
        keep_rows(self.cache, keep)
