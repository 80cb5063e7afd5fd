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
- The head runs only on supervised rows (`head_losses`, in chunks of rows), over the ids inference can
  propose (those `masked_logits` leaves finite: not the mask id nor padded vocabulary rows, and only the
  draft vocabulary where the drafter has one). The mask id and padding are never targets, and a target
  outside a draft vocabulary adds no cross entropy, so the loss stays finite; the softmax is normalised
  over the ids inference can propose, and no gradient is spent pushing down logits that inference
  discards anyway.
"""

import hashlib
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


def _supervised_hidden(model: torch.nn.Module, batch: DiffusionBatch, rows: torch.Tensor, runner=None) -> torch.Tensor:
    """Final hidden states `(rows, hidden_size)` of `model` at flat query rows `rows` of `batch`: by its
    transformers forward, or by `runner` (models.inference.decoder_runner of `model`, an inference forward
    over an empty cache: no gradients, the lean forward's fewer operations; 0.75x the CPU time of a loss
    ranking's batch on the demo drafter)."""
    if runner is not None:
        cache = runner.new_cache(batch.input_ids.shape[0], capacity=batch.input_ids.shape[1])
        hidden = runner.forward(batch.input_ids, batch.position_ids, batch.attention_mask, cache)
    else:
        hidden = causal_lm(model).model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).last_hidden_state  # (batch, Q, hidden)
    return hidden.reshape(-1, hidden.shape[-1])[rows]


def _supervised_logits(model: torch.nn.Module, batch: DiffusionBatch, rows: torch.Tensor) -> torch.Tensor:
    """Masked logits `(rows, vocab)` float32 of `model` at flat query rows `rows` of `batch`."""
    return masked_logits(causal_lm(model), _supervised_hidden(model, batch, rows))


def draft_slots(batch: DiffusionBatch, values: torch.Tensor, fill) -> torch.Tensor:
    """`(blocks, B - 1)`: per-slot `values` `(S,)` of the batch's supervised slots laid out by block, draft slots
    1..B-1 only (the block's last slot has no draft to verify), `fill` where a slot is not supervised."""
    size = batch.block_size
    dense = torch.full((batch.num_blocks * size,), fill, dtype=values.dtype, device=values.device)
    dense[batch.slot_block * size + batch.slot_number] = values
    return dense.view(-1, size)[:, : size - 1]


class Teacher:
    """The frozen drafter whose predictions a distilling loss matches (`drafter_loss`).

    `hidden(batch, rows)`: its final hidden states at flat query rows `rows` of `batch`, computed without
    grad. With `remember`, they are kept per batch, keyed by the batch's contents (ids, mask, positions and
    rows): a campaign's heals draw the same seeded batches from the same unpruned drafter, so every heal
    after the first reads the teacher's states instead of running its layers again (docs/design.md, Drafter
    training). At most `most` batches are kept (about 1 MB each for the demo drafter's heal batches). The
    model must not change while remembered states are read.
    """

    def __init__(self, model: torch.nn.Module, remember: bool = False, most: int = 256):
        self.model = model
        self.remembered: dict[bytes, torch.Tensor] | None = {} if remember else None
        self.most = most

    @classmethod
    def of(cls, teacher: "torch.nn.Module | Teacher | None") -> "Teacher | None":
        """`teacher` as a Teacher (a plain model remembers nothing)."""
        return teacher if teacher is None or isinstance(teacher, Teacher) else cls(teacher)

    def hidden(self, batch: DiffusionBatch, rows: torch.Tensor) -> torch.Tensor:
        key = self._key(batch, rows) if self.remembered is not None else None
        if key is not None and key in self.remembered:
            return self.remembered[key]
        with torch.no_grad():
            states = _supervised_hidden(self.model, batch, rows)
        if key is not None and len(self.remembered) < self.most:
            self.remembered[key] = states
        return states

    @staticmethod
    def _key(batch: DiffusionBatch, rows: torch.Tensor) -> bytes:
        digest = hashlib.blake2b(digest_size=32)
        for tensor in (batch.input_ids, batch.position_ids, batch.attention_mask, rows):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.digest()


HEAD_CHUNK_ROWS = 128  # logit rows `head_losses` holds at once: 25 MB at a 49k vocabulary, not a batch's 300


def head_losses(lm: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, distill_weight: float = 0.0,
                teacher_lm: torch.nn.Module | None = None,
                teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's loss through the drafter's head: (1 - w) * CE(target) + w * KL(teacher || model), w =
    `distill_weight` with a teacher and 0 without; and each row's argmax.

    Args:
        lm: the drafter's `Qwen3ForCausalLM` (its `lm_head` is bias-free).
        hidden: `(rows, hidden_size)`, the drafter's final hidden states at the supervised rows.
        targets: LongTensor `(rows,)`, never the mask id nor a padding row; an id outside a draft vocabulary
            adds no cross entropy (its row still matches the teacher).
        teacher_lm, teacher_hidden: the teacher's model (same vocabulary) and its hidden states at the same
            rows (no grad).

    Returns:
        (loss `(rows,)` float32 with a graph to `hidden` and the head's weight, argmax LongTensor `(rows,)`).

    The softmaxes run over the ids inference can propose, the ids `masked_logits` leaves finite: the head's
    other rows are left out rather than set to -inf, which is the same distribution at less arithmetic. The
    `(rows, vocab)` logits are computed `HEAD_CHUNK_ROWS` rows at a time and never kept: autograd would
    otherwise hold several such tensors per batch (hundreds of MB at a 49k vocabulary, the slowest part of a
    CPU heal). The gradient of a row's loss with respect to its logits is q - (1 - w) onehot - w p (q, p:
    the model's and the teacher's probabilities); backward multiplies it by the head, each row by its
    incoming gradient. While the head is frozen (a LoRA heal) that product is taken in the forward pass
    (`(rows, hidden_size)`, small); a trained head needs each row's incoming gradient for its own weight
    gradient, so backward computes the chunks again. Autocast is off inside: the head runs in float32, as
    `masked_logits` returns it.
    """
    if teacher_hidden is None or distill_weight <= 0:
        teacher_lm, teacher_hidden, distill_weight = None, None, 0.0
    with torch.no_grad():
        probe = masked_logits(lm, lm.lm_head.weight.new_zeros(1, hidden.shape[-1]))[0]
    proposable = torch.isfinite(probe).nonzero().flatten()  # (V',) ids
    column = torch.full_like(probe, -1, dtype=torch.long)
    column[proposable] = torch.arange(proposable.numel(), device=probe.device)
    teacher_weight = None if teacher_lm is None else teacher_lm.lm_head.weight.detach()
    loss, top = _HeadLoss.apply(hidden, lm.lm_head.weight, column[targets], proposable, teacher_weight,
                                teacher_hidden, distill_weight)
    return loss, proposable[top]


class _HeadLoss(torch.autograd.Function):
    """`head_losses` on the proposable columns (`proposable`, `(V',)` ids; `targets` are column numbers),
    chunked forward and backward (see there). Returns (loss `(rows,)`, argmax column `(rows,)`)."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def forward(ctx, hidden, weight, targets, proposable, teacher_weight, teacher_hidden, distill_weight):
        # With a frozen head, each row's gradient to its hidden state is formed here, while the chunk is at hand.
        jacobian_here = not ctx.needs_input_grad[1] and ctx.needs_input_grad[0]
        losses, argmax, jacobian = [], [], []
        for head, _, loss, top, grad in _each_chunk(hidden, weight, targets, proposable, teacher_weight,
                                                    teacher_hidden, distill_weight, jacobian_here):
            losses.append(loss)
            argmax.append(top)
            if jacobian_here:
                jacobian.append(grad @ head)
        ctx.distill_weight = distill_weight
        ctx.save_for_backward(hidden, weight, targets, proposable, teacher_weight, teacher_hidden,
                              torch.cat(jacobian) if jacobian_here else None)
        top = torch.cat(argmax)
        ctx.mark_non_differentiable(top)
        return torch.cat(losses), top

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_loss, _grad_argmax):
        hidden, weight, targets, proposable, teacher_weight, teacher_hidden, jacobian = ctx.saved_tensors
        if jacobian is not None:
            return (grad_loss[:, None] * jacobian).to(hidden.dtype), *[None] * 6
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_head = None
        for head, rows, _, _, grad in _each_chunk(hidden, weight, targets, proposable, teacher_weight,
                                                  teacher_hidden, ctx.distill_weight, True):
            grad = grad * grad_loss[rows, None]
            grad_hidden[rows] = grad @ head
            if ctx.needs_input_grad[1]:
                part = grad.T @ hidden[rows].float()
                grad_head = part if grad_head is None else grad_head + part
        grad_weight = None
        if grad_head is not None:  # the head's masked rows never reach a loss: zero gradient
            grad_weight = torch.zeros_like(weight).index_copy_(0, proposable, grad_head.to(weight.dtype))
        return grad_hidden.to(hidden.dtype), grad_weight, *[None] * 5


def _each_chunk(hidden, weight, targets, proposable, teacher_weight, teacher_hidden, distill_weight, gradient):
    """`_HeadLoss`'s chunks, `HEAD_CHUNK_ROWS` rows each (one empty chunk for no rows: a batch without
    supervised rows): (the head's proposable rows `(V', hidden_size)` float32, the chunk's row slice, and
    `_head_chunk`'s loss, argmax and - when `gradient` - d loss / d logits)."""
    head = weight.index_select(0, proposable).float()
    teacher_head = None if teacher_weight is None else teacher_weight.index_select(0, proposable).float()
    for start in range(0, max(hidden.shape[0], 1), HEAD_CHUNK_ROWS):
        rows = slice(start, start + HEAD_CHUNK_ROWS)
        yield head, rows, *_head_chunk(head, hidden[rows], targets[rows], teacher_head,
                                       None if teacher_hidden is None else teacher_hidden[rows], distill_weight,
                                       gradient)


@torch.no_grad()
def _head_chunk(head, hidden, targets, teacher_head, teacher_hidden, distill_weight, gradient):
    """One chunk of `_HeadLoss` on heads `(V', hidden_size)` float32: (loss `(c,)`, argmax column `(c,)`,
    d loss / d logits `(c, V')` when `gradient`, else None)."""
    logits = F.linear(hidden.float(), head)
    log_q = F.log_softmax(logits, -1)
    # A target outside a draft vocabulary (column -1) has no cross entropy: the drafter cannot propose it.
    proposable = (targets >= 0)[:, None].to(logits.dtype)
    picked = targets.clamp_min(0)[:, None]
    loss = -(log_q.gather(-1, picked) * proposable).squeeze(-1) * (1 - distill_weight)
    grad = None
    if gradient:
        grad = log_q.exp()
        grad.scatter_add_(-1, picked, (distill_weight - 1) * proposable)
    if teacher_head is not None:
        log_p = F.log_softmax(F.linear(teacher_hidden.float(), teacher_head), -1)
        p = log_p.exp()
        loss = loss + distill_weight * (p * (log_p - log_q)).sum(-1)
        if gradient:
            grad -= distill_weight * p
    return loss, logits.argmax(-1), grad


def drafter_loss(
    model: torch.nn.Module, batch: DiffusionBatch, gamma: float = TrainConfig.gamma,
    ar_weight: float = TrainConfig.ar_weight, teacher: "torch.nn.Module | Teacher | None" = None,
    distill_weight: float = TrainConfig.distill_weight, runner=None,
) -> LossOutput:
    """L = L_diff + ar_weight * L_AR on a batch already on the model's device.

    The mask must have the attention dtype (float32, or bfloat16 under bf16 autocast). Runs the decoder
    layers on every query row and the head only on the S + A supervised rows. With a `teacher` (a frozen
    drafter on the same device, or a `Teacher` that remembers its states) and `distill_weight` w > 0, each
    row's cross entropy becomes (1 - w) * CE + w * KL(teacher || model) (TrainConfig.distill_weight).
    `runner`: compute the hidden states by this inference runner of `model` (`_supervised_hidden`; no
    gradients), as the loss ranking does.
    """
    num_slots = batch.slot_rows.numel()
    rows = torch.cat([batch.slot_rows, batch.ar_rows])
    targets = torch.cat([batch.slot_targets, batch.ar_targets])
    teacher_lm = teacher_hidden = None
    if teacher is not None and distill_weight > 0:
        teacher = Teacher.of(teacher)
        teacher_lm, teacher_hidden = causal_lm(teacher.model), teacher.hidden(batch, rows)
    hidden = _supervised_hidden(model, batch, rows, runner)
    ce, predicted = head_losses(causal_lm(model), hidden, targets, distill_weight, teacher_lm, teacher_hidden)
    ce_slot, ce_ar = ce[:num_slots], ce[num_slots:]

    weights = slot_weights(batch.block_size, gamma).to(ce.device)[batch.slot_number]  # (S,)
    diff = (weights * ce_slot).sum() / weights.sum().clamp_min(1e-12)
    ar = ce_ar.mean() if ce_ar.numel() else ce_ar.sum()
    total = diff + ar_weight * ar

    with torch.no_grad():
        correct = predicted[:num_slots] == batch.slot_targets  # (S,)
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
