"""The attention rule of models.masks, checked pair by pair against a reference written here.

The reference below is written from docs/design.md (Masks) and deliberately shares no code with models.masks:
plain Python lists and loops, one explicit record per token.
"""

import pytest
import torch

from models.masks import BlockSpec, batch_layouts, block_layout

B = 4


# ----------------------------------------------------------------------------------------------------
# Independent reference
# ----------------------------------------------------------------------------------------------------


def reference(cache_len, chain_len, blocks, block_size):
    """Return (positions of the queries, visibility matrix as nested lists [query][key]).

    Tokens are records {kind, pos, block, anchor}; kind is "cache", "chain", "guess" or "slot".
    Keys are the cached tokens followed by the query tokens, in query order.
    """
    cached = [{"kind": "cache", "pos": p, "block": None, "anchor": None} for p in range(cache_len)]
    queries = [
        {"kind": "chain", "pos": cache_len + i, "block": None, "anchor": None} for i in range(chain_len)
    ]
    for n, (anchor, guess) in enumerate(blocks):
        next_pos = anchor + 1
        if guess is not None:
            queries.append({"kind": "guess", "pos": next_pos, "block": n, "anchor": anchor})
            next_pos += 1
        for i in range(block_size):
            queries.append({"kind": "slot", "pos": next_pos + i, "block": n, "anchor": anchor})
    keys = cached + queries

    def sees(qi, ki):
        q, k = queries[qi], keys[ki]
        k_is_context = k["kind"] in ("cache", "chain")
        if q["kind"] == "chain":
            # Token-causal over clean context; never a guess or a slot.
            return k_is_context and k["pos"] <= q["pos"]
        if q["kind"] == "guess":
            # Clean context up to the anchor, and itself.
            return (k_is_context and k["pos"] <= q["anchor"]) or ki == cache_len + qi
        if q["kind"] == "slot":
            if k_is_context:
                return k["pos"] <= q["anchor"]
            # Its own block's guess and every slot of its block, in both directions.
            return k["block"] == q["block"]
        raise AssertionError(q)

    visible = [[sees(qi, ki) for ki in range(len(keys))] for qi in range(len(queries))]
    return [q["pos"] for q in queries], visible


def check_against_reference(cache_len, chain_len, blocks, block_size=B):
    specs = [BlockSpec(anchor, guess) for anchor, guess in blocks]
    layout = block_layout(cache_len, chain_len, specs, block_size)
    positions, visible = reference(cache_len, chain_len, blocks, block_size)
    q, k = len(positions), cache_len + len(positions)

    assert layout.visible.dtype == torch.bool
    assert tuple(layout.visible.shape) == (q, k)
    assert layout.positions.tolist() == positions
    assert layout.query_len == q
    got = layout.visible.tolist()
    wrong = [(qi, ki) for qi in range(q) for ki in range(k) if got[qi][ki] != visible[qi][ki]]
    assert not wrong, f"{len(wrong)} (query, key) pairs differ from the rule, first: {wrong[:5]}"

    # Bookkeeping of where each block's guess and slots sit in the query.
    row = chain_len
    assert len(layout.guess_rows) == len(layout.slot_rows) == len(blocks)
    for n, (anchor, guess) in enumerate(blocks):
        if guess is None:
            assert layout.guess_rows[n] is None
        else:
            assert layout.guess_rows[n] == row
            assert positions[row] == anchor + 1
            row += 1
        assert layout.slot_rows[n].tolist() == list(range(row, row + block_size))
        first = anchor + (2 if guess is not None else 1)
        assert [positions[r] for r in layout.slot_rows[n].tolist()] == list(range(first, first + block_size))
        row += block_size
    assert row == q
    return layout


# ----------------------------------------------------------------------------------------------------
# The three layouts of the issue
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "anchors",
    [
        [0, 3, 4, 9],  # not block-aligned, one at the first and one at the last clean position
        [2, 2],  # two blocks on the same anchor must still not see each other
        [5],
    ],
)
def test_training_layout_matches_rule(anchors):
    # (a) training: clean stream of L tokens, no cache, N fully masked blocks at anchors.
    check_against_reference(cache_len=0, chain_len=10, blocks=[(a, None) for a in anchors])


@pytest.mark.parametrize("cache_len,chain_len", [(7, 3), (5, 1), (1, 6)])
def test_sync_draft_layout_matches_rule(cache_len, chain_len):
    # (b) synchronous draft: cached context, a chain of clean tokens, one block at the last clean position.
    check_against_reference(cache_len, chain_len, blocks=[(cache_len + chain_len - 1, None)])


def test_async_packed_layout_matches_rule():
    # (c) the async packed pass: chain V of B tokens, candidate blocks for several outcomes a with an
    # explicit guess (two guesses for a = 0), and the all-accepted block without guess.
    cache_len = 6
    blocks = [(cache_len + 0, 11), (cache_len + 0, 12), (cache_len + 1, 13), (cache_len + 2, 14)]
    blocks.append((cache_len + B - 1, None))
    layout = check_against_reference(cache_len, chain_len=B, blocks=blocks)
    assert layout.query_len == B + 4 * (B + 1) + B


def test_async_layout_with_block_size_3_and_mixed_order():
    # Block order in the query does not follow anchors; a guess-less block in the middle.
    blocks = [(9, 5), (7, None), (8, 6), (9, None)]
    check_against_reference(cache_len=7, chain_len=3, blocks=blocks, block_size=3)


def test_tiny_layout_spelled_out():
    # A literal matrix, written by hand, so that the reference above is itself checked.
    # cache k0, k1 at positions 0, 1; chain c2 at position 2; block 0 anchored at 1 with a guess:
    # g at 2, slots s at 3, 4; block 1 anchored at 2 without guess: slots t at 3, 4.
    layout = block_layout(2, 1, [BlockSpec(1, guess=42), BlockSpec(2)], block_size=2)
    #           keys: k0 k1 c2 g  s  s  t  t
    expected = [
        [1, 1, 1, 0, 0, 0, 0, 0],  # c2 (chain, pos 2)
        [1, 1, 0, 1, 0, 0, 0, 0],  # g  (guess of block 0, pos 2)
        [1, 1, 0, 1, 1, 1, 0, 0],  # s  (block 0 slot 1, pos 3)
        [1, 1, 0, 1, 1, 1, 0, 0],  # s  (block 0 slot 2, pos 4)
        [1, 1, 1, 0, 0, 0, 1, 1],  # t  (block 1 slot 1, pos 3)
        [1, 1, 1, 0, 0, 0, 1, 1],  # t  (block 1 slot 2, pos 4)
    ]
    assert layout.visible.int().tolist() == expected
    assert layout.positions.tolist() == [2, 2, 3, 4, 3, 4]


@pytest.mark.parametrize(
    "cache_len,chain_len,anchor",
    [(0, 5, 5), (0, 5, -1), (3, 2, 5), (3, 2, 100), (4, 0, 4)],
)
def test_block_layout_rejects_anchor_outside_clean_positions(cache_len, chain_len, anchor):
    with pytest.raises(ValueError, match="anchor"):
        block_layout(cache_len, chain_len, [BlockSpec(anchor)], B)


def test_block_layout_accepts_anchor_inside_cache():
    # The first and last clean positions are valid anchors, the cache included.
    check_against_reference(cache_len=3, chain_len=2, blocks=[(0, None), (4, 7)])


# ----------------------------------------------------------------------------------------------------
# batch_layouts
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batch_layouts_padding(dtype):
    layouts = [
        block_layout(5, B, [BlockSpec(5, guess=3), BlockSpec(8)], B),  # q = 4 + 5 + 4 = 13
        block_layout(2, 1, [BlockSpec(2)], B),  # q = 5
        block_layout(0, 3, [], B),  # q = 3
    ]
    padded = 7  # more than any row holds, so every row has padded cache slots
    batched = batch_layouts(layouts, padded_cache_len=padded, dtype=dtype, device="cpu")
    q_max = 13
    mask = batched.mask
    assert mask.dtype == dtype
    assert tuple(mask.shape) == (3, 1, q_max, padded + q_max)
    assert batched.padded_cache_len == padded
    assert batched.query_len == q_max
    assert tuple(batched.positions.shape) == (3, q_max)
    assert batched.positions.dtype == torch.long

    # Only 0 and -inf.
    is_zero, is_ninf = mask == 0, mask == float("-inf")
    assert bool((is_zero | is_ninf).all())
    seen = is_zero[:, 0]

    for r, layout in enumerate(layouts):
        c, q = layout.cache_len, layout.query_len
        # Real queries: the layout's own visibility on valid cache slots and on their own new keys.
        assert torch.equal(seen[r, :q, :c], layout.visible[:, :c])
        assert torch.equal(seen[r, :q, padded : padded + q], layout.visible[:, c:])
        # Padded cache slots and the keys of padded queries are invisible to every real query.
        assert not seen[r, :q, c:padded].any()
        assert not seen[r, :q, padded + q :].any()
        # Padded cache slots are invisible to padded queries too; each padded query sees only itself.
        for j in range(q, q_max):
            row = seen[r, j]
            assert row.sum().item() == 1, f"padded query {j} of row {r} sees {row.nonzero().flatten().tolist()}"
            assert row[padded + j].item()
        # No key slot in the padded cache region is visible to anybody.
        assert not seen[r, :, c:padded].any()
        assert batched.positions[r, :q].tolist() == layout.positions.tolist()
        assert batched.positions[r, q:].tolist() == [0] * (q_max - q)
    # Every row of the float mask has at least one finite entry (no all -inf softmax rows).
    assert bool(seen.any(-1).all())


def test_batch_layouts_without_padding_equals_layout():
    layout = block_layout(4, 2, [BlockSpec(5, guess=1)], B)
    batched = batch_layouts([layout], padded_cache_len=4, dtype=torch.float32, device="cpu")
    expected = torch.where(layout.visible, 0.0, float("-inf"))
    assert torch.equal(batched.mask[0, 0], expected)
    assert torch.equal(batched.positions[0], layout.positions)


def test_batch_layouts_rejects_cache_longer_than_padding():
    layout = block_layout(6, 1, [], B)
    with pytest.raises(ValueError, match="6"):
        batch_layouts([layout], padded_cache_len=5, dtype=torch.float32, device="cpu")


# ----------------------------------------------------------------------------------------------------
# mask_from_table: the same batched mask, built where the pass runs (the CUDA draft engine's path)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [5, 9])
def test_mask_from_table_equals_batch_layouts(dtype, padded):
    from models.masks import mask_from_table, query_table

    shapes = [
        (5, B, [BlockSpec(5, guess=3), BlockSpec(8)]),  # guess, blocks anchored in the chain
        (2, 1, [BlockSpec(2), BlockSpec(0, guess=9), BlockSpec(1)]),  # blocks anchored inside the cache
        (0, 3, []),  # a chain alone
        (4, 0, []),  # a row that feeds nothing
        (0, 0, []),  # an empty row beside them
    ]
    layouts = [block_layout(c, n, blocks, B) for c, n, blocks in shapes]
    lean = [block_layout(c, n, blocks, B, dense=False) for c, n, blocks in shapes]
    q_max = max(layout.query_len for layout in layouts)
    expected = batch_layouts(layouts, padded, dtype, "cpu")
    table = torch.tensor(query_table(lean, q_max, padded), dtype=torch.long)
    mask, positions = mask_from_table(table, len(lean), q_max, padded, dtype)
    assert mask.dtype == dtype and torch.equal(mask, expected.mask)
    assert torch.equal(positions, expected.positions)
    for full, light in zip(layouts, lean):  # dense=False leaves out the host mask and nothing else
        assert light.visible is None and torch.equal(light.positions, full.positions)
        assert light.guess_rows == full.guess_rows and light.query_table == full.query_table
        assert all(torch.equal(a, b) for a, b in zip(light.slot_rows, full.slot_rows))
    with pytest.raises(ValueError, match="5"):
        query_table(lean, q_max, 4)
