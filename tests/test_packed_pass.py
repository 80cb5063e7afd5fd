"""The packed drafter pass against independent forwards (docs/design.md: Masks, Decoders, Layer surgery).

A mask leak in the packed pass does not break decoding exactness, so the only way to catch one is to
compare every packed candidate with a forward of that candidate alone. The references here never use
models.masks: they build their own 4D masks (or use the model's plain causal path).
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from models.cache import cache_length, crop_to, keep_rows
from models.inference import drafter_hidden, masked_logits
from models.masks import BlockSpec, batch_layouts, block_layout

B = 4
MASK = 97  # the tiny drafter's mask id (see conftest)
DRAFT_VOCAB = 97
LOGIT_TOL = 1e-4
KV_TOL = 1e-5


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(params=["sdpa", "eager"])
def drafter(request, make_tiny_drafter):
    model = make_tiny_drafter(num_hidden_layers=3, block_size=B, seed=1)
    model.set_attn_implementation(request.param)
    return model


# ----------------------------------------------------------------------------------------------------
# Helpers, independent of models.masks
# ----------------------------------------------------------------------------------------------------


def mask_vocab(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float().clone()
    logits[..., MASK] = float("-inf")
    logits[..., DRAFT_VOCAB:] = float("-inf")
    return logits


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, tol: float = LOGIT_TOL, what: str = ""):
    assert got.shape == want.shape, what
    got_inf, want_inf = torch.isinf(got), torch.isinf(want)
    assert torch.equal(got_inf, want_inf), f"{what}: -inf entries differ"
    assert not torch.isnan(got).any(), f"{what}: NaN logits"
    diff = (got[~got_inf] - want[~want_inf]).abs().max().item()
    assert diff < tol, f"{what}: max abs diff {diff:.3g}"


def candidate_reference(model, clean: list[int], guess: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncached forward of one candidate alone: clean tokens, optional guess, then B mask slots.

    Clean tokens (and the guess) are causal; every slot sees every clean token and every slot.
    Returns (logits of the slots (B, V), logits of the last clean token (V,)).
    """
    clean = clean + ([guess] if guess is not None else [])
    ids = clean + [MASK] * B
    n, c = len(ids), len(clean)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            allowed[q, k] = k <= q if q < c else True
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    logits = model(
        input_ids=torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(n)[None], use_cache=False
    ).logits[0]
    logits = mask_vocab(logits)
    return logits[c:], logits[c - 1]


def causal_logits(model, ids: list[int]) -> torch.Tensor:
    return mask_vocab(model(torch.tensor([ids])).logits[0])


def query_ids(chain: list[int], blocks: list[BlockSpec]) -> list[int]:
    ids = list(chain)
    for block in blocks:
        ids += ([block.guess] if block.guess is not None else []) + [MASK] * B
    return ids


def prefill(model, ids: list[int]) -> DynamicCache:
    """A fresh cache holding `ids`, written by the model's own causal path (no models.masks)."""
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids]), cache=cache, use_cache=True)
    assert cache_length(cache) == len(ids)
    return cache


def assert_cache_rows_equal(got: DynamicCache, row: int, length: int, want: DynamicCache, what: str = ""):
    assert len(got.layers) == len(want.layers)
    for n, (g, w) in enumerate(zip(got.layers, want.layers)):
        assert w.keys.shape[2] == length
        for name in ("keys", "values"):
            a, b = getattr(g, name)[row, :, :length], getattr(w, name)[0]
            diff = (a - b).abs().max().item()
            assert diff < KV_TOL, f"{what}: layer {n} {name} differ by {diff:.3g}"


# ----------------------------------------------------------------------------------------------------
# One sequence
# ----------------------------------------------------------------------------------------------------


def test_packed_pass_matches_independent_forwards(drafter, token_ids):
    model = drafter
    prefix = token_ids(7, seed=2).tolist()
    chain = token_ids(B, seed=3).tolist()  # V = [t, d1 .. d(B-1)]
    P = len(prefix)

    # Prefill the prefix with drafter_hidden; its logits are the plain causal ones.
    cache = DynamicCache(config=model.config)
    prefill_layout = batch_layouts([block_layout(0, P, [], B)], 0, torch.float32, "cpu")
    hidden = drafter_hidden(model, torch.tensor([prefix]), prefill_layout, cache)
    assert tuple(hidden.shape) == (1, P, model.config.hidden_size)
    assert cache_length(cache) == P
    assert_logits_close(masked_logits(model, hidden[0]), causal_logits(model, prefix), what="prefill")

    # One packed pass: the chain, candidates for outcomes a = 0 (two guesses), 1, 2 and all accepted.
    blocks = [BlockSpec(P + 0, 5), BlockSpec(P + 0, 6), BlockSpec(P + 1, 7), BlockSpec(P + 2, 8)]
    blocks.append(BlockSpec(P + B - 1))
    layout = block_layout(P, B, blocks, B)
    packed = batch_layouts([layout], P, torch.float32, "cpu")
    ids = query_ids(chain, blocks)
    hidden = drafter_hidden(model, torch.tensor([ids]), packed, cache)[0]
    assert hidden.shape[0] == layout.query_len == len(ids)
    assert cache_length(cache) == P + len(ids)

    # The chain rows are a plain causal forward of prefix + chain.
    full = prefix + chain
    assert_logits_close(masked_logits(model, hidden[:B]), causal_logits(model, full)[P:], what="chain")

    # Every candidate equals the candidate alone.
    for n, block in enumerate(blocks):
        want_slots, want_last_clean = candidate_reference(model, full[: block.anchor + 1], block.guess)
        got_slots = masked_logits(model, hidden[layout.slot_rows[n]])
        assert_logits_close(got_slots, want_slots, what=f"block {n} slots")
        if block.guess is not None:
            got_guess = masked_logits(model, hidden[layout.guess_rows[n]])
            assert_logits_close(got_guess, want_last_clean, what=f"block {n} guess row")

    # Crop to each outcome's committed length: the cache equals a fresh prefill, and the next round
    # (bonus token + one block, the sync layout) gives the same logits as the fresh cache and as the
    # candidate alone.
    for a in (0, 2, B - 1):
        committed = P + a + 1
        cropped = copy.deepcopy(cache)
        crop_to(cropped, committed)
        assert cache_length(cropped) == committed
        fresh = prefill(model, full[:committed])
        assert_cache_rows_equal(cropped, 0, committed, fresh, what=f"crop to {committed}")

        bonus = 9 + a
        next_blocks = [BlockSpec(committed)]
        next_layout = batch_layouts([block_layout(committed, 1, next_blocks, B)], committed, torch.float32, "cpu")
        next_ids = torch.tensor([query_ids([bonus], next_blocks)])
        got = masked_logits(model, drafter_hidden(model, next_ids, next_layout, cropped)[0])
        again = masked_logits(model, drafter_hidden(model, next_ids, next_layout, fresh)[0])
        assert_logits_close(got, again, tol=KV_TOL, what=f"continue after crop to {committed}")
        want_slots, want_bonus = candidate_reference(model, full[:committed] + [bonus], None)
        assert_logits_close(got[1:], want_slots, what=f"next round slots after crop to {committed}")
        assert_logits_close(got[0], want_bonus, what=f"next round bonus row after crop to {committed}")


def test_crop_to_edges(make_tiny_drafter, token_ids):
    model = make_tiny_drafter(num_hidden_layers=2, block_size=B)
    ids = token_ids(6, seed=4).tolist()
    cache = prefill(model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    crop_to(cache, 6)  # a no-op
    for (k, v), layer in zip(before, cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    for bad in (7, -1):
        with pytest.raises(ValueError):
            crop_to(cache, bad)
    assert cache_length(cache) == 6
    crop_to(cache, 2)
    assert cache_length(cache) == 2
    assert all(layer.keys.shape[2] == 2 and layer.values.shape[2] == 2 for layer in cache.layers)
    assert_cache_rows_equal(cache, 0, 2, prefill(model, ids[:2]), what="crop to 2")
    assert cache_length(None) == 0


# ----------------------------------------------------------------------------------------------------
# A batch of sequences with different cache lengths
# ----------------------------------------------------------------------------------------------------


def single_row_pass(model, prefix, chain, blocks):
    """Row alone: prefill with drafter_hidden, then one packed pass; returns (hidden (Q, H), cache)."""
    cache = DynamicCache(config=model.config)
    P = len(prefix)
    drafter_hidden(model, torch.tensor([prefix]), batch_layouts([block_layout(0, P, [], B)], 0, torch.float32, "cpu"), cache)
    layout = batch_layouts([block_layout(P, len(chain), blocks, B)], P, torch.float32, "cpu")
    hidden = drafter_hidden(model, torch.tensor([query_ids(chain, blocks)]), layout, cache)[0]
    return hidden, cache


def pad_ids(rows: list[list[int]], fill: int = 3) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows])


def test_batched_rows_with_different_cache_lengths(drafter, token_ids):
    model = drafter
    prefixes = [token_ids(5, seed=10).tolist(), token_ids(9, seed=11).tolist()]
    chains = [token_ids(B, seed=12).tolist(), token_ids(B, seed=13).tolist()]
    lens = [len(p) for p in prefixes]
    blocks = [
        [BlockSpec(lens[0] + 0, 4), BlockSpec(lens[0] + 2, 1), BlockSpec(lens[0] + B - 1)],
        [BlockSpec(lens[1] + 1, 2)],
    ]

    # Padded batch prefill: row 0 holds 5 valid slots and 4 padding slots.
    cache = DynamicCache(config=model.config)
    prefill_layouts = [block_layout(0, n, [], B) for n in lens]
    batched = batch_layouts(prefill_layouts, 0, torch.float32, "cpu")
    hidden = drafter_hidden(model, pad_ids(prefixes), batched, cache)
    padded = max(lens)
    assert cache_length(cache) == padded
    for r in range(2):
        assert_logits_close(
            masked_logits(model, hidden[r, : lens[r]]), causal_logits(model, prefixes[r]), what=f"prefill row {r}"
        )

    # One batched packed pass.
    layouts = [block_layout(lens[r], B, blocks[r], B) for r in range(2)]
    batched = batch_layouts(layouts, padded, torch.float32, "cpu")
    hidden = drafter_hidden(model, pad_ids([query_ids(chains[r], blocks[r]) for r in range(2)]), batched, cache)
    assert not torch.isnan(hidden).any()
    q_max = batched.query_len
    assert cache_length(cache) == padded + q_max

    alone = [single_row_pass(model, prefixes[r], chains[r], blocks[r]) for r in range(2)]
    for r in range(2):
        alone_hidden, _ = alone[r]
        q = layouts[r].query_len
        assert_logits_close(
            masked_logits(model, hidden[r, :q]), masked_logits(model, alone_hidden), what=f"row {r} all rows"
        )
        for n in range(len(blocks[r])):
            rows = layouts[r].slot_rows[n]
            assert_logits_close(
                masked_logits(model, hidden[r, rows]),
                masked_logits(model, alone_hidden[rows]),
                what=f"row {r} block {n}",
            )

    # Commit outcome a_r in each row: keep the valid prefix slots and the chain up to a_r, left-aligned.
    outcomes = [2, 0]
    committed = [lens[r] + outcomes[r] + 1 for r in range(2)]
    new_len = max(committed)
    keep = []
    for r in range(2):
        slots = list(range(lens[r])) + list(range(padded, padded + outcomes[r] + 1))
        keep.append(slots + [0] * (new_len - len(slots)))
    keep_rows(cache, torch.tensor(keep))
    assert cache_length(cache) == new_len
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (2, model.config.num_key_value_heads, new_len, model.config.head_dim)
        assert layer.values.shape == layer.keys.shape
    full = [prefixes[r] + chains[r] for r in range(2)]
    for r in range(2):
        fresh = prefill(model, full[r][: committed[r]])
        assert_cache_rows_equal(cache, r, committed[r], fresh, what=f"keep_rows row {r}")

    # The next round continues from the compacted batch exactly as each row alone.
    bonuses = [[20], [21]]
    next_blocks = [[BlockSpec(committed[r])] for r in range(2)]
    next_layouts = [block_layout(committed[r], 1, next_blocks[r], B) for r in range(2)]
    batched = batch_layouts(next_layouts, new_len, torch.float32, "cpu")
    hidden = drafter_hidden(model, pad_ids([query_ids(bonuses[r], next_blocks[r]) for r in range(2)]), batched, cache)
    for r in range(2):
        want_slots, want_bonus = candidate_reference(model, full[r][: committed[r]] + bonuses[r], None)
        got = masked_logits(model, hidden[r, : next_layouts[r].query_len])
        assert_logits_close(got[1:], want_slots, what=f"row {r} next round slots")
        assert_logits_close(got[0], want_bonus, what=f"row {r} next round bonus row")


def test_keep_rows_gathers_the_requested_slots():
    # Pure index check on a hand-made cache, so a wrong axis or order shows up exactly.
    cache = DynamicCache()
    keys = torch.arange(2 * 3 * 5 * 2, dtype=torch.float32).reshape(2, 3, 5, 2)
    cache.update(keys, -keys, 0)
    keep = torch.tensor([[0, 2, 4], [1, 1, 3]])
    keep_rows(cache, keep)
    layer = cache.layers[0]
    for r in range(2):
        for j in range(3):
            assert torch.equal(layer.keys[r, :, j], keys[r, :, keep[r, j]])
            assert torch.equal(layer.values[r, :, j], -keys[r, :, keep[r, j]])
    assert cache_length(cache) == 3


# ----------------------------------------------------------------------------------------------------
# masked_logits
# ----------------------------------------------------------------------------------------------------


def test_masked_logits_masks_mask_id_and_padding_rows(make_tiny_drafter):
    model = make_tiny_drafter()  # vocab 99, mask id 97, draft_vocab_size 97
    hidden = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = masked_logits(model, hidden)
    assert logits.dtype == torch.float32
    assert tuple(logits.shape) == (2, 3, 99)
    assert bool(torch.isneginf(logits[..., 97:]).all())
    raw = model.lm_head(hidden)
    assert torch.equal(logits[..., :97], raw[..., :97])
    assert bool(torch.isfinite(logits[..., :97]).all())


def test_masked_logits_mask_id_below_padding(make_tiny_drafter):
    # Mask id inside the draft vocabulary range, padding rows 95..98 above it.
    model = make_tiny_drafter(mask_token_id=40, draft_vocab_size=95)
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = masked_logits(model, hidden)
    ninf = torch.isneginf(logits)
    expected = torch.zeros(99, dtype=torch.bool)
    expected[40] = True
    expected[95:] = True
    assert torch.equal(ninf, expected.expand(4, -1))


def test_masked_logits_without_padding_and_in_bf16(make_tiny_drafter):
    model = make_tiny_drafter(mask_token_id=98, draft_vocab_size=None).to(torch.bfloat16)
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    logits = masked_logits(model, hidden)
    assert logits.dtype == torch.float32
    assert torch.isneginf(logits).nonzero()[:, 1].unique().tolist() == [98]
