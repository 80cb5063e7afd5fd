"""Run the drafter on a (batched) block layout and read per-slot logits.

The decoder layers run on every query token; the lm_head runs only on the rows asked for, because at
vocabulary sizes of 50k-150k the head dominates a small drafter's pass.
"""

import torch

from .drafter import draft_vocab_limit
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
    out = model.model(
        input_ids=input_ids,
        attention_mask=layout.mask,
        position_ids=layout.positions,
        cache=cache,
        use_cache=True,
    )
    return out.last_hidden_state


def masked_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits `(..., vocab)` of `hidden` `(..., hidden_size)`, with the mask id and padding rows at -inf."""
    logits = model.lm_head(hidden).float()
    logits[..., model.config.mask_token_id] = float("-inf")
    limit = draft_vocab_limit(model.config)
    if limit < logits.shape[-1]:
        logits[..., limit:] = float("-inf")
    return logits
