"""The one attention-mask builder, shared by training and every inference layout.

The rule (docs/design.md, Masks). Tokens are *clean* (committed or real text, plus explicit guesses) or
*mask slots*. A block is B mask slots anchored after clean position p, optionally preceded by one
explicit guessed clean token at p + 1 (then the slots sit after the guess).

- A clean chain token at position i sees clean tokens at positions <= i (cache and chain).
- A guess token at p + 1 sees clean tokens at positions <= p, and itself.
- A mask slot sees clean tokens at positions <= p, its block's guess, and every slot of its block.
- Nothing else: no token of another block, and clean tokens never see slots.

Slot i (1-based) of a block sits at RoPE position p + i (p + 1 + i after a guess) and predicts the token
at that position. A query layout is: `cache_len` positions already in the KV cache, then a chain of
`chain_len` clean tokens at positions cache_len .. cache_len + chain_len - 1, then the blocks in order.
"""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BlockSpec:
    """One block of mask slots.

    Attributes:
        anchor: absolute position p of the last clean token the block conditions on.
        guess: token id of an explicit clean token placed at p + 1 before the slots, or None.
    """

    anchor: int
    guess: int | None = None


@dataclass
class Layout:
    """The query layout of one drafter pass over one sequence.

    Attributes:
        cache_len: positions already held in the KV cache (keys 0 .. cache_len - 1).
        chain_len: clean tokens fed at the head of the query.
        block_size: B, mask slots per block.
        blocks: the blocks, in query order after the chain.
        positions: LongTensor `(Q,)`, the RoPE position of every query token.
        visible: BoolTensor `(Q, cache_len + Q)`, True where a query may attend to a key.
        guess_rows: per block, the query index of its guess token, or None.
        slot_rows: per block, LongTensor `(B,)` of the query indices of its slots.
        query_table: per query token, the lists `visible` is computed from: (positions, groups: -1 for the
            chain or n for block n, is_slot, horizons: the last clean position the token sees); what
            `mask_from_table` builds a batch's mask from on the device.
    """

    cache_len: int
    chain_len: int
    block_size: int
    blocks: list[BlockSpec]
    positions: torch.Tensor
    visible: torch.Tensor | None
    guess_rows: list[int | None] = field(default_factory=list)
    slot_rows: list[torch.Tensor] = field(default_factory=list)
    query_table: tuple[list[int], list[int], list[bool], list[int]] = field(default_factory=lambda: ([], [], [], []))

    @property
    def query_len(self) -> int:
        return int(self.positions.shape[0])


def block_layout(cache_len: int, chain_len: int, blocks: list[BlockSpec], block_size: int,
                 dense: bool = True) -> Layout:
    """Build positions and the visibility matrix for one sequence (see the module docstring).

    `dense=False` leaves `visible` None: the caller builds the mask from `query_table` on the device
    (`mask_from_table`) instead of on the host.

    Raises:
        ValueError: when a block's anchor is not a clean position of this layout.
    """
    last_clean = cache_len + chain_len - 1
    # Per query token: position, group (-1 chain, n for block n), is_slot, horizon (last clean position seen).
    positions, groups, is_slot, horizons = [], [], [], []
    for i in range(chain_len):
        positions.append(cache_len + i)
        groups.append(-1)
        is_slot.append(False)
        horizons.append(cache_len + i)
    guess_rows, slot_rows = [], []
    for n, block in enumerate(blocks):
        if not 0 <= block.anchor <= last_clean:
            raise ValueError(f"block {n} anchor {block.anchor} is outside the clean positions 0..{last_clean}")
        first_slot = block.anchor + 1
        if block.guess is not None:
            guess_rows.append(len(positions))
            positions.append(block.anchor + 1)
            groups.append(n)
            is_slot.append(False)
            horizons.append(block.anchor)
            first_slot += 1
        else:
            guess_rows.append(None)
        slot_rows.append(torch.arange(len(positions), len(positions) + block_size))
        for i in range(block_size):
            positions.append(first_slot + i)
            groups.append(n)
            is_slot.append(True)
            horizons.append(block.anchor)

    q_pos = torch.tensor(positions, dtype=torch.long)
    table = (positions, groups, is_slot, horizons)
    if not dense:
        return Layout(cache_len, chain_len, block_size, list(blocks), q_pos, None, guess_rows, slot_rows, table)
    q_group = torch.tensor(groups, dtype=torch.long)
    q_slot = torch.tensor(is_slot, dtype=torch.bool)
    q_horizon = torch.tensor(horizons, dtype=torch.long)

    # Keys: the cache (clean, group -1) followed by the query tokens themselves.
    k_pos = torch.cat([torch.arange(cache_len), q_pos])
    k_group = torch.cat([torch.full((cache_len,), -1, dtype=torch.long), q_group])
    k_slot = torch.cat([torch.zeros(cache_len, dtype=torch.bool), q_slot])

    k_is_clean_context = (k_group == -1)[None, :]  # cache or chain keys
    sees_context = k_is_clean_context & (k_pos[None, :] <= q_horizon[:, None])
    # Inside a block: the guess sees itself; slots see the guess and all slots of their block.
    same_block = (q_group[:, None] == k_group[None, :]) & (q_group[:, None] >= 0)
    sees_block = same_block & (q_slot[:, None] | ~k_slot[None, :])
    visible = sees_context | sees_block
    return Layout(cache_len, chain_len, block_size, list(blocks), q_pos, visible, guess_rows, slot_rows, table)


@dataclass
class BatchedLayout:
    """Several layouts padded into one batched pass over a cache whose rows hold different lengths.

    Row r's cache is left-aligned: slots 0 .. cache_lens[r] - 1 are valid, the rest up to the padded
    cache length are padding. New keys follow at `padded_cache_len` onwards.

    Attributes:
        mask: float Tensor `(batch, 1, Q_max, padded_cache_len + Q_max)`, 0 where visible, -inf elsewhere.
        positions: LongTensor `(batch, Q_max)`; padded queries get position 0.
        padded_cache_len: key slots already in the cache (the same for every row).
    """

    layouts: list[Layout]
    mask: torch.Tensor
    positions: torch.Tensor
    padded_cache_len: int

    @property
    def query_len(self) -> int:
        return int(self.positions.shape[1])


def batch_layouts(
    layouts: list[Layout], padded_cache_len: int, dtype: torch.dtype, device: torch.device | str
) -> BatchedLayout:
    """Pad per-sequence layouts into one 4D float mask and position ids for a batched forward."""
    q_max = max(layout.query_len for layout in layouts)
    batch = len(layouts)
    visible = torch.zeros(batch, q_max, padded_cache_len + q_max, dtype=torch.bool)
    positions = torch.zeros(batch, q_max, dtype=torch.long)
    for r, layout in enumerate(layouts):
        c, q = layout.cache_len, layout.query_len
        if c > padded_cache_len:
            raise ValueError(f"row {r} holds {c} cached positions, more than the padded {padded_cache_len}")
        if layout.visible is None:
            raise ValueError(f"row {r} was laid out without its dense mask; use mask_from_table")
        visible[r, :q, :c] = layout.visible[:, :c]
        visible[r, :q, padded_cache_len : padded_cache_len + q] = layout.visible[:, c:]
        positions[r, :q] = layout.positions
        # Padded query rows attend to their own key so that softmax never sees an all -inf row.
        pad = torch.arange(q, q_max)
        visible[r, pad, padded_cache_len + pad] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return BatchedLayout(layouts, mask[:, None].to(device), positions.to(device), padded_cache_len)


PAD_GROUP = -2  # the group of a padded query in a query table: it sees only its own key


def query_table(layouts: list[Layout], q_max: int, padded_cache_len: int) -> list[int]:
    """The batch's query tables flattened for `mask_from_table`: positions, groups, is_slot and horizons,
    each `(batch, q_max)` row-major, then each row's cache length `(batch,)`. Padded queries get position
    0 (as in `batch_layouts`), group PAD_GROUP and horizon -1."""
    for r, layout in enumerate(layouts):
        if layout.cache_len > padded_cache_len:
            raise ValueError(f"row {r} holds {layout.cache_len} cached positions, more than the padded "
                             f"{padded_cache_len}")
    pad = [q_max - layout.query_len for layout in layouts]
    fill = (0, PAD_GROUP, 0, -1)
    flat: list[int] = []
    for column, value in enumerate(fill):
        for layout, missing in zip(layouts, pad):
            flat += layout.query_table[column]
            flat += [value] * missing
    return flat + [layout.cache_len for layout in layouts]


def mask_from_table(table: torch.Tensor, batch: int, q_max: int, padded_cache_len: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask and positions of `batch_layouts`, built where `table` is (the device) from `query_table`'s
    flat LongTensor `(4 * batch * q_max + batch,)`, instead of on the host and then copied.

    Returns (mask `(batch, 1, q_max, padded_cache_len + q_max)`, 0 where visible and -inf elsewhere;
    positions `(batch, q_max)`), equal to `batch_layouts`' for the same layouts.
    """
    position, group, slot, horizon = table[: 4 * batch * q_max].view(4, batch, q_max).unbind(0)
    cache_len = table[4 * batch * q_max :]
    slot = slot.bool()
    # Cache keys: slot j of row r holds clean position j below the row's cache length, padding above it.
    key = torch.arange(padded_cache_len, device=table.device)
    sees_cache = (key < cache_len[:, None, None]) & (key <= horizon[:, :, None])
    # The new keys are the queries themselves: the clean chain up to the horizon, and the own block.
    sees_chain = (group[:, None, :] == -1) & (position[:, None, :] <= horizon[:, :, None])
    same_block = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    sees_block = same_block & (slot[:, :, None] | ~slot[:, None, :])
    own = torch.eye(q_max, dtype=torch.bool, device=table.device) & (group == PAD_GROUP)[:, :, None]
    visible = torch.cat([sees_cache, sees_chain | sees_block | own], dim=2)
    mask = torch.zeros(visible.shape, dtype=dtype, device=table.device).masked_fill_(~visible, float("-inf"))
    return mask[:, None], position


def tree_mask(parents: list[int], cache_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask `(1, 1, n, cache_len + n)` of a verify pass that feeds a draft tree: n tokens with
    `parents[i]` the index of token i's parent among them (-1 for the first, whose parent is the cache's last
    position). Each token sees every cached key, its ancestors and itself (0), nothing else (-inf): the
    attention a chain of its path would see. A chain (parents i - 1) gives the causal mask."""
    n = len(parents)
    visible = torch.zeros(n, cache_len + n, dtype=torch.bool)
    visible[:, :cache_len] = True
    for i, parent in enumerate(parents):
        if parent >= 0:
            visible[i, cache_len : cache_len + i] = visible[parent, cache_len : cache_len + i]
        visible[i, cache_len + i] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return mask.to(device)[None, None]
