"""Run a model's decoder stack (lean or transformers) and read per-slot logits.

The decoder layers run on every query token; the lm_head runs only on the rows asked for, and a drafter's
only on its draft vocabulary where it has one (models/draft_vocab.py), because at vocabulary sizes of
50k-150k the head dominates a small drafter's pass. `decoder_runner` picks the
runner the decoders use: the lean forward of models/lean.py where it applies, transformers' otherwise.
"""

import os
import statistics
import time
import weakref

import torch
from transformers import DynamicCache

from .cache import DynamicKV
from .drafter_config import draft_vocab_limit
from .errors import ConfigError
from .draft_vocab import draft_vocab, head_selection
from .lean import LeanDecoder, can_prepack, forget_unused, head_product
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


def masked_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits `(..., vocab)` of `hidden` `(..., hidden_size)` over the whole head, every id the drafter
    never proposes at -inf: the mask id, padding rows, and the ids outside its draft vocabulary where it has
    one (models/draft_vocab.py). The full-width view training and expected acceptance read; decoding computes
    the proposable rows alone (`draft_logits`)."""
    logits = model.lm_head(hidden).float()
    ids = draft_vocab(model)
    if ids is not None:
        outside = torch.full((logits.shape[-1],), float("-inf"), device=logits.device)
        outside[ids] = 0.0
        return logits + outside
    return _mask_unproposable(model, logits)


def draft_logits(model: torch.nn.Module, hidden: torch.Tensor, runner) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's float32 logits `(..., R)` for `hidden` `(..., hidden_size)` over the ids it may propose, as
    its runner's head computes them, and the ids of those columns: (logits over the first R ids, the mask id
    and any padding rows at -inf, None), or, with a draft vocabulary, (logits over its K rows alone, its ids
    int64 `(K,)`; every one proposable)."""
    logits = runner.logits(hidden).float()
    ids = getattr(runner, "head_ids", None)
    return (logits, ids) if ids is not None else (_mask_unproposable(model, logits), None)


def id_logits(model: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits `(..., U)` of `hidden` `(..., hidden_size)` on the head rows `ids` (int64 `(U,)` on the
    model's device; column u is token `ids[u]`): a few rows gathered per call, such as the ids outside a drafter's
    draft vocabulary that a sequence's context holds (decode.engine, docs/design.md)."""
    weight, bias = model.lm_head.weight, getattr(model.lm_head, "bias", None)
    rows = weight.detach().index_select(0, ids)
    return torch.nn.functional.linear(hidden, rows, None if bias is None else bias.index_select(0, ids)).float()


def _mask_unproposable(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (in place) over the first R ids (the whole head, or its proposable prefix) with the mask id and
    the padding rows among them at -inf."""
    if model.config.mask_token_id < logits.shape[-1]:
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
        self.head_rows = head_selection(model)  # as LeanDecoder's: the rows computed, and the map of columns to ids
        self.head_ids = self.head_rows if isinstance(self.head_rows, torch.Tensor) else None

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
        """The model's logits for `hidden` `(..., hidden_size)` over its head's rows (`head_rows`; final soft-capping
        included where set)."""
        logits = head_product(self.model, hidden, self.head_rows)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


def decoder_runner(model: torch.nn.Module, lean: bool = True, fused: bool = False):
    """The fastest runner for `model`'s decoder stack: `LeanDecoder` where it applies, else transformers'.
    A frozen target's runner comes from `target_runner`, which also picks the form of its products; a
    drafter's runs `fused` (models.lean.LeanDecoder).

    Both run `forward(input_ids (batch, Q), positions (batch, Q), mask (batch, 1, Q, cache + Q) | None,
    cache, lengths=None, packed_index=None) -> hidden (batch, Q, hidden_size)` over a cache from their
    `new_cache(rows)`.
    """
    if lean and LeanDecoder.supports(model):
        return LeanDecoder(model, fused=fused)
    return TransformersDecoder(model)


TARGET_PRODUCTS_ENV = "D3D_PRUNE_TARGET_PRODUCTS"  # one of PRODUCTS: fixes target_runner's choice
# How a target's products run, by name: LeanDecoder's `packed_from` (prepacked from that many tokens on).
PRODUCTS = {"packed": 1, "mixed": 2, "plain": None}
# frozen target -> its `packed_from`, measured once per model
_TARGET_PACKED_FROM: "weakref.WeakKeyDictionary[torch.nn.Module, int | None]" = weakref.WeakKeyDictionary()


def target_runner(model: torch.nn.Module, lean: bool = True):
    """The runner of a frozen target (`decoder_runner`), its products prepacked or plain, for one-token
    steps and for wider passes each, whichever runs faster on this machine.

    Which is faster depends on the CPU, the dtype and the tokens (models.lean.stacked): on 2 AVX2 EPYC cores
    prepacked float32 products ran a one-token step 1.6x faster than `F.linear`; on 2 AVX-512 Xeon cores
    the demo target's whole pass ran faster on plain `(in, out)` products at every width from 1 to 16
    tokens (33.8 against 45.8 ms at one, 46.9 against 51.3 at four), although its products alone, timed
    apart, had favoured prepacked ones from two rows on. So where both apply, a one-token and a 4-token
    pass of an all-prepacked and an all-plain runner are timed in turn (5 rounds after a warm-up, medians,
    about 4 s for the demo target); one-token steps get the faster at one token, wider passes the faster at
    four, for the model's lifetime. Every decoder of the process, `ar` included, then
    runs the same products. `D3D_PRUNE_TARGET_PRODUCTS` (packed, mixed or plain) fixes the choice instead.
    """
    if not (lean and LeanDecoder.supports(model)):
        return decoder_runner(model, lean)
    weight = next(model.parameters())
    if not can_prepack(weight.device, weight.dtype):
        return LeanDecoder(model)
    if model not in _TARGET_PACKED_FROM:
        _TARGET_PACKED_FROM[model] = _packed_from(model)
        forget_unused(model, _TARGET_PACKED_FROM[model])
    return LeanDecoder(model, packed_from=_TARGET_PACKED_FROM[model])


def target_products(model: torch.nn.Module) -> str | None:
    """The name in PRODUCTS of what `target_runner` chose for `model`; None before it chose (or where only
    one form applies)."""
    if model not in _TARGET_PACKED_FROM:
        return None
    return next(name for name, packed_from in PRODUCTS.items() if packed_from == _TARGET_PACKED_FROM[model])


def _packed_from(model: torch.nn.Module) -> int | None:
    """The `packed_from` that runs `model`'s passes fastest (see `target_runner`)."""
    fixed = os.environ.get(TARGET_PRODUCTS_ENV)
    if fixed:
        if fixed not in PRODUCTS:
            raise ConfigError(f"{TARGET_PRODUCTS_ENV}={fixed!r}; use {', '.join(PRODUCTS)}, or unset it")
        return PRODUCTS[fixed]
    runners = {"packed": LeanDecoder(model, packed_from=1), "plain": LeanDecoder(model, packed_from=None)}
    device = next(model.parameters()).device
    context = torch.arange(64, device=device)[None] % model.config.vocab_size
    caches = {}
    samples = {(name, width): [] for name in runners for width in (1, 4)}
    with torch.inference_mode():
        for name, runner in runners.items():
            caches[name] = runner.new_cache(1)
            runner.forward(context, torch.arange(64, device=device)[None], None, caches[name])
        for round_index in range(6):
            for name, width in samples:
                runner = runners[name]
                start = time.perf_counter()
                hidden = runner.forward(context[:, :width], torch.arange(64, 64 + width, device=device)[None], None,
                                        caches[name])
                runner.logits(hidden)
                caches[name].crop(64)
                if round_index:  # the first round warms up
                    samples[(name, width)].append(time.perf_counter() - start)
    ms = {key: statistics.median(values) for key, values in samples.items()}
    if ms[("packed", 1)] < ms[("plain", 1)]:
        return PRODUCTS["packed"]
    return PRODUCTS["mixed"] if ms[("packed", 4)] < ms[("plain", 4)] else PRODUCTS["plain"]
