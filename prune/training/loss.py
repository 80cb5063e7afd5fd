"""The drafter's training loss, L = L_diff + lambda * L_AR (docs/design.md, Masks), in the inference geometry.

One training sequence of L tokens (prompt + the target's greedy response) becomes one query layout built
by `models.masks.block_layout`: the clean stream (cache_len = 0, chain_len = L) followed by N blocks of
B mask slots at random anchors p_n. This is exactly the geometry of a synchronous draft anchored at p_n,
so a slot sees the same keys in training as at inference.

- Anchors: positions p with both x_p and x_{p+1} in the response (at inference the anchor is always a
  verified response token), drawn without replacement from a `torch.Generator`.
- L_diff: slot i (1-based) of the block at p predicts x_{p+i} with weight w_i = exp(-(i-1)/gamma);
  slots past the sequence end or on prompt positions get weight 0. Normalised by sum(w_i * valid).
- L_AR: next-token cross entropy of the clean stream, on rows whose next token is a response token.
- The head runs only on supervised rows, and its logits are masked exactly as at inference
  (`masked_logits`: the mask id and padded vocabulary rows at -inf). Those ids are never targets, so the
  loss stays finite; the softmax is then normalised over the ids inference can propose, and no gradient
  is spent pushing down logits that inference discards anyway.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.errors import DataError
from models.inference import masked_logits
from models.masks import BlockSpec, Layout, batch_layouts, block_layout

from .config import TrainConfig


@dataclass
class Example:
    """One training sequence.

    Attributes:
        input_ids: LongTensor `(L,)`, prompt followed by response.
        loss_mask: BoolTensor `(L,)`, True on response tokens (the supervised positions).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def from_prompt_response(cls, prompt_ids, response_ids) -> "Example":
        """Build from two id lists; the response part is supervised."""
        ids = torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(prompt_ids) :] = True
        return cls(ids, mask)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class DiffusionBatch:
    """A padded batch of training layouts; row indices are flat indices into `(batch * Q)`.

    Attributes:
        input_ids: LongTensor `(batch, Q)`; clean tokens, then `mask_token_id` at slots and padding.
        attention_mask: float Tensor `(batch, 1, Q, Q)`, 0 where visible and -inf elsewhere.
        position_ids: LongTensor `(batch, Q)`.
        slot_rows: LongTensor `(S,)`, flat query index of every supervised slot.
        slot_targets: LongTensor `(S,)`, the token at the slot's position.
        slot_number: LongTensor `(S,)`, 0-based slot index i - 1 within its block.
        slot_block: LongTensor `(S,)`, index of the slot's block among the batch's `num_blocks` blocks.
        ar_rows: LongTensor `(A,)`, flat query index of every clean row whose next token is supervised.
        ar_targets: LongTensor `(A,)`, that next token.
        num_blocks: blocks in the batch; block_size: B.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    slot_rows: torch.Tensor
    slot_targets: torch.Tensor
    slot_number: torch.Tensor
    slot_block: torch.Tensor
    ar_rows: torch.Tensor
    ar_targets: torch.Tensor
    num_blocks: int
    block_size: int

    def to(self, device, mask_dtype: torch.dtype | None = None) -> "DiffusionBatch":
        """Move every tensor to `device` (non-blocking); optionally cast the mask (e.g. to bfloat16)."""
        moved = {
            name: getattr(self, name).to(device, non_blocking=True)
            for name in ("input_ids", "position_ids", "slot_rows", "slot_targets", "slot_number",
                         "slot_block", "ar_rows", "ar_targets")
        }
        mask = self.attention_mask.to(device, dtype=mask_dtype or self.attention_mask.dtype, non_blocking=True)
        return DiffusionBatch(attention_mask=mask, num_blocks=self.num_blocks, block_size=self.block_size, **moved)


@dataclass
class LossOutput:
    """Losses and metrics of one batch. Losses are scalar tensors (`total` carries the graph).

    Attributes:
        slot_correct: LongTensor `(B,)`, per slot index, supervised slots whose argmax equals the target.
        slot_count: LongTensor `(B,)`, supervised slots per slot index.
        accept_sum: 0-d tensor, sum over full blocks of 1 + the leading run of correct slots 1..B-1 (a
            teacher-forced proxy of a round's acceptance length on the target's own trajectory).
        accept_blocks: 0-d tensor, number of full blocks (slots 1..B-1 all supervised) in accept_sum.
    Metrics stay on the device (no host sync inside the loss); read them with float() / int().
    """

    total: torch.Tensor
    diff: torch.Tensor
    ar: torch.Tensor
    slot_correct: torch.Tensor
    slot_count: torch.Tensor
    accept_sum: torch.Tensor
    accept_blocks: torch.Tensor

    @property
    def slot_accuracy(self) -> torch.Tensor:
        """Float `(B,)`: fraction of supervised slots at each index whose argmax is right (nan if none)."""
        return self.slot_correct.float() / self.slot_count.float()

    @property
    def accept_proxy(self) -> float:
        blocks = int(self.accept_blocks)
        return float(self.accept_sum) / blocks if blocks else float("nan")


def anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """LongTensor: every position p where a block can be anchored, loss_mask[p] and loss_mask[p + 1] (both
    response tokens; at inference a round starts at a verified response token).

    Args:
        loss_mask: BoolTensor `(L,)`.
    """
    return torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_blocks: int, generator: torch.Generator) -> list[int]:
    """Up to `num_blocks` distinct anchors (`anchor_positions`), sorted.

    Args:
        loss_mask: BoolTensor `(L,)`.
    """
    valid = anchor_positions(loss_mask)
    if valid.numel() == 0 or num_blocks <= 0:
        return []
    pick = torch.randperm(valid.numel(), generator=generator)[:num_blocks]
    return sorted(valid[pick].tolist())


def build_batch(
    examples: list[Example],
    block_size: int,
    mask_token_id: int,
    blocks_per_sequence: int,
    generator: torch.Generator | None = None,
    anchors: list[list[int]] | None = None,
    max_length: int | None = None,
    pad_multiple: int = 16,
    extra_padding: int = 0,
    mask_dtype: torch.dtype = torch.float32,
) -> DiffusionBatch:
    """Lay out `examples` as clean stream + mask blocks and pad them into one batch (on CPU).

    Args:
        generator: draws the anchors (`sample_anchors`), example by example; unused when `anchors` gives
            them per example.
        max_length: crop longer sequences to their first `max_length` tokens.
        pad_multiple: pad the query length to a multiple of this (aligned masks suit the GPU kernels).
        extra_padding: add this many more padded query rows (tests use it).
        mask_dtype: dtype of the float mask; build it in the attention dtype (bfloat16 under bf16 autocast)
            to halve the bytes built and copied per step.
    """
    if anchors is None and generator is None:
        raise ValueError("build_batch needs a generator or explicit anchors")
    rows, num_blocks = [], 0
    for r, example in enumerate(examples):
        ids, supervised = example.input_ids, example.loss_mask.bool()
        if ids.shape != supervised.shape or ids.ndim != 1 or ids.numel() == 0:
            raise DataError(f"example {r}: input_ids {tuple(ids.shape)} and loss_mask {tuple(supervised.shape)} "
                            "must be equal non-empty 1-D tensors")
        if max_length is not None:
            ids, supervised = ids[:max_length], supervised[:max_length]
        row_anchors = anchors[r] if anchors is not None else sample_anchors(supervised, blocks_per_sequence, generator)
        rows.append(_lay_out(ids, supervised, row_anchors, block_size, mask_token_id, num_blocks))
        num_blocks += len(row_anchors)
    return _pad(rows, num_blocks, block_size, mask_token_id, pad_multiple, extra_padding, mask_dtype)


@dataclass
class _Row:
    """One example laid out: its query layout and its supervised rows, row indices within the example.

    Attributes:
        layout: the `Layout` of the clean stream (L tokens) and the N blocks after it.
        tokens: LongTensor `(L + N * B,)`, the clean ids, then `mask_token_id` at every slot.
        slot_rows, slot_targets, slot_number, slot_block: LongTensors `(S_r,)`, as in `DiffusionBatch`.
        ar_rows, ar_targets: LongTensors `(A_r,)`, as in `DiffusionBatch`.
    """

    layout: Layout
    tokens: torch.Tensor
    slot_rows: torch.Tensor
    slot_targets: torch.Tensor
    slot_number: torch.Tensor
    slot_block: torch.Tensor
    ar_rows: torch.Tensor
    ar_targets: torch.Tensor


def _lay_out(ids: torch.Tensor, supervised: torch.Tensor, anchors: list[int], block_size: int, mask_token_id: int,
             first_block: int) -> _Row:
    """Lay out one cropped example `ids`/`supervised` (`(L,)` each) with blocks at `anchors` (sorted).

    `first_block` numbers the example's first block among the batch's blocks.
    """
    length = ids.numel()
    layout = block_layout(0, length, [BlockSpec(p) for p in anchors], block_size)
    tokens = torch.cat([ids, torch.full((len(anchors) * block_size,), mask_token_id)])
    # AR: clean row t predicts x_{t+1} where that token is supervised.
    ar_rows = torch.nonzero(supervised[1:]).flatten()
    if not anchors:
        empty = torch.zeros(0, dtype=torch.long)
        return _Row(layout, tokens, empty, empty, empty, empty, ar_rows, ids[ar_rows + 1])
    # Slot i (0-based j) of block n: query row L + n*B + j, position p_n + 1 + j.
    offsets = torch.arange(block_size)
    target_pos = torch.tensor(anchors)[:, None] + 1 + offsets[None, :]  # (N, B)
    inside = target_pos < length
    valid = inside & supervised[target_pos.clamp(max=length - 1)]  # (N, B)
    rows = length + torch.arange(len(anchors) * block_size).view(-1, block_size)  # (N, B)
    blocks = first_block + torch.arange(len(anchors))[:, None].expand(-1, block_size)  # (N, B)
    return _Row(layout, tokens, rows[valid], ids[target_pos[valid]], offsets[None, :].expand_as(valid)[valid],
                blocks[valid], ar_rows, ids[ar_rows + 1])


def _pad(rows: list[_Row], num_blocks: int, block_size: int, mask_token_id: int, pad_multiple: int,
         extra_padding: int, mask_dtype: torch.dtype) -> DiffusionBatch:
    """Pad the laid-out examples to one query length Q (a multiple of `pad_multiple`) and make their row
    indices flat indices into `(batch * Q)`."""
    q_max = max(row.layout.query_len for row in rows) + extra_padding
    q_max = -(-q_max // pad_multiple) * pad_multiple
    # A padded dummy layout of q_max clean tokens makes batch_layouts pad every row to q_max; drop it after.
    batched = batch_layouts([row.layout for row in rows] + [block_layout(0, q_max, [], block_size)], 0, mask_dtype,
                            "cpu")
    input_ids = torch.full((len(rows), q_max), mask_token_id, dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, : row.tokens.numel()] = row.tokens
    return DiffusionBatch(
        input_ids=input_ids,
        attention_mask=batched.mask[:-1],
        position_ids=batched.positions[:-1],
        slot_rows=torch.cat([row.slot_rows + r * q_max for r, row in enumerate(rows)]),
        slot_targets=torch.cat([row.slot_targets for row in rows]),
        slot_number=torch.cat([row.slot_number for row in rows]),
        slot_block=torch.cat([row.slot_block for row in rows]),
        ar_rows=torch.cat([row.ar_rows + r * q_max for r, row in enumerate(rows)]),
        ar_targets=torch.cat([row.ar_targets for row in rows]),
        num_blocks=num_blocks,
        block_size=block_size,
    )


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying `Qwen3ForCausalLM` of a plain or peft-wrapped drafter."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Float `(B,)`: w_i = exp(-(i - 1) / gamma) for slots i = 1..B."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / gamma)


def _supervised_logits(model: torch.nn.Module, batch: DiffusionBatch, rows: torch.Tensor) -> torch.Tensor:
    """Masked logits `(rows, vocab)` float32 of `model` at flat query rows `rows` of `batch`."""
    lm = causal_lm(model)
    hidden = lm.model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state  # (batch, Q, hidden)
    return masked_logits(lm, hidden.reshape(-1, hidden.shape[-1])[rows])


def draft_slots(batch: DiffusionBatch, values: torch.Tensor, fill) -> torch.Tensor:
    """`(blocks, B - 1)`: per-slot `values` `(S,)` of the batch's supervised slots laid out by block, draft slots
    1..B-1 only (the block's last slot has no draft to verify), `fill` where a slot is not supervised."""
    size = batch.block_size
    dense = torch.full((batch.num_blocks * size,), fill, dtype=values.dtype, device=values.device)
    dense[batch.slot_block * size + batch.slot_number] = values
    return dense.view(-1, size)[:, : size - 1]


def teacher_divergence(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) per row `(rows,)`, over the ids both leave finite (masked ids are -inf in both)."""
    finite = torch.isfinite(teacher_logits)
    log_p, log_q = F.log_softmax(teacher_logits, -1), F.log_softmax(logits, -1)
    return torch.where(finite, log_p.exp() * (log_p - log_q), 0.0).sum(-1)


def drafter_loss(
    model: torch.nn.Module, batch: DiffusionBatch, gamma: float = TrainConfig.gamma,
    ar_weight: float = TrainConfig.ar_weight, teacher: torch.nn.Module | None = None,
    distill_weight: float = TrainConfig.distill_weight,
) -> LossOutput:
    """L = L_diff + ar_weight * L_AR on a batch already on the model's device.

    The mask must have the attention dtype (float32, or bfloat16 under bf16 autocast). Runs the decoder
    layers on every query row and the head only on the S + A supervised rows. With a `teacher` (a frozen
    drafter on the same device) and `distill_weight` w > 0, each row's cross entropy becomes
    (1 - w) * CE + w * KL(teacher || model) (TrainConfig.distill_weight).
    """
    num_slots = batch.slot_rows.numel()
    rows = torch.cat([batch.slot_rows, batch.ar_rows])
    logits = _supervised_logits(model, batch, rows)  # (S + A, vocab) float32
    targets = torch.cat([batch.slot_targets, batch.ar_targets])
    ce = F.cross_entropy(logits, targets, reduction="none")
    if teacher is not None and distill_weight > 0:
        with torch.no_grad():
            teacher_logits = _supervised_logits(teacher, batch, rows)
        ce = (1 - distill_weight) * ce + distill_weight * teacher_divergence(logits, teacher_logits)
    ce_slot, ce_ar = ce[:num_slots], ce[num_slots:]

    weights = slot_weights(batch.block_size, gamma).to(ce.device)[batch.slot_number]  # (S,)
    diff = (weights * ce_slot).sum() / weights.sum().clamp_min(1e-12)
    ar = ce_ar.mean() if ce_ar.numel() else ce_ar.sum()
    total = diff + ar_weight * ar

    with torch.no_grad():
        correct = logits[:num_slots].argmax(-1) == batch.slot_targets  # (S,)
        size = batch.block_size
        slot_correct = torch.zeros(size, dtype=torch.long, device=ce.device).index_add_(
            0, batch.slot_number, correct.long()
        )
        slot_count = torch.bincount(batch.slot_number, minlength=size)
        # (blocks, B - 1) tables for the leading-run acceptance proxy over full blocks.
        full = draft_slots(batch, torch.ones_like(correct), False).all(-1)
        run = draft_slots(batch, correct, False).long().cumprod(-1).sum(-1)  # (blocks,) leading correct slots
        accept_sum = (run[full] + 1).sum()
        accept_blocks = full.sum()
    return LossOutput(total, diff.detach(), ar.detach(), slot_correct, slot_count, accept_sum, accept_blocks)


@torch.no_grad()
def expected_acceptance(model: torch.nn.Module, batch: DiffusionBatch) -> torch.Tensor:
    """Float `(blocks,)`: each block's expected acceptance length on the target's own trajectory.

    With p_i the model's probability of the target's token at draft slot i = 1..B-1 of a block (teacher
    forced: the clean stream is the target's trajectory), the block scores 1 + sum_k p_1 ... p_k, the tokens
    a round anchored there would commit if each draft were accepted with the drafter's probability of the
    target's token. Slots past the sequence end count as rejected. Unlike the greedy acceptance length (a
    leading run of argmax matches, `LossOutput.accept_sum`), it moves with every change of the model's
    probabilities, not only with those that flip an argmax, so small calibration sets still rank models.
    """
    logits = _supervised_logits(model, batch, batch.slot_rows)  # (S, vocab) float32
    prob = logits.log_softmax(-1).gather(-1, batch.slot_targets[:, None]).squeeze(-1).exp()
    return 1.0 + draft_slots(batch, prob, 0.0).cumprod(-1).sum(-1)
