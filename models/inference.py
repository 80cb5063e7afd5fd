"""Run a model's decoder stack (lean or transformers) and read per-slot logits.

The decoder layers run on every query token; the lm_head runs only on the rows asked for, because at
vocabulary sizes of 50k-150k the head dominates a small drafter's pass. `decoder_runner` picks the
runner the decoders use: the lean forward of models/lean.py where it applies, transformers' otherwise.
"""

import torch
from transformers import DynamicCache

from .cache import DynamicKV
from .drafter_config import draft_vocab_limit
from .lean import LeanDecoder
from .masks import BatchedLayout


def drafter_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, layout: BatchedLayout, cache
) -> torch.Tensor:
    """Hidden states of a drafter pass.

    Args:
        input_ids: LongTensor `(batch, Q_max)`; mask slots hold `mask_token_id`, padding any id.
        layout: the batched mask `(batch, 1, Q_max, cache_len + Q_max)` and positions `(batch, Q_max)`.
        cache: a `DynamicCache` holding `layout.padded_cache_len` key slots per row, extended in place.

    Returns:
        Tensor `(batch, Q_max, hidden_size)` after the final norm.
    """
    return TransformersDecoder(model).forward(input_ids, layout.positions, layout.mask, DynamicKV(cache))


def masked_logits(model: torch.nn.Module, hidden: torch.Tensor, head=None) -> torch.Tensor:
    """Float32 logits `(..., vocab)` of `hidden` `(..., hidden_size)`, with the mask id and padding rows at -inf.

    `head`: the function that applies the lm_head (a runner's `logits`); default `model.lm_head`."""
    logits = (head or model.lm_head)(hidden).float()
    logits[..., model.config.mask_token_id] = float("-inf")
    limit = draft_vocab_limit(model.config)
    if limit < logits.shape[-1]:
        logits[..., limit:] = float("-inf")
    return logits


class TransformersDecoder:
    """The model's own transformers forward behind the runner interface of `LeanDecoder`.

    Used for models the lean forward does not cover (other architectures, attached adapters).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def new_cache(self, rows: int, capacity: int = 0) -> DynamicKV:
        return DynamicKV(DynamicCache(config=self.model.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: DynamicKV, lengths: list[int] | None = None,
                packed_index: torch.Tensor | None = None) -> torch.Tensor:
        # `lengths` and `packed_index` (see LeanDecoder.forward) only save arithmetic; this forward computes
        # the padding too.
        out = self.model.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               cache=cache.cache, use_cache=True)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for `hidden` `(..., hidden_size)` (final soft-capping included where set)."""
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


def decoder_runner(model: torch.nn.Module, lean: bool = True, prepack: bool = False):
    """The fastest runner for `model`'s decoder stack: `LeanDecoder` where it applies, else transformers'.

    `prepack` (frozen models only, such as the target): the lean forward runs on prepacked weights
    (models.lean.prepacked) where the device allows.

    Both run `forward(input_ids (batch, Q), positions (batch, Q), mask (batch, 1, Q, cache + Q) | None,
    cache, lengths=None, packed_index=None) -> hidden (batch, Q, hidden_size)` over a cache from their
    `new_cache(rows)`.
    """
    if lean and LeanDecoder.supports(model):
        return LeanDecoder(model, prepack=prepack)
    return TransformersDecoder(model)
