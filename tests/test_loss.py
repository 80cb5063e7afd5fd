"""The training loss: inference geometry, slot weights, padding invariance."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from models.inference import drafter_hidden, masked_logits
from models.masks import BlockSpec, batch_layouts, block_layout
from prune.training.loss import Example, build_batch, drafter_loss, sample_anchors, slot_weights

B = 4
MASK_ID = 97



def make_example(prompt_len: int, response_len: int, seed: int) -> Example:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (prompt_len + response_len,), generator=g)
    return Example.from_prompt_response(ids[:prompt_len].tolist(), ids[prompt_len:].tolist())


def test_anchors_are_response_positions_and_seeded():
    example = make_example(5, 12, seed=1)
    first = sample_anchors(example.loss_mask, 6, torch.Generator().manual_seed(3))
    again = sample_anchors(example.loss_mask, 6, torch.Generator().manual_seed(3))
    assert first == again and len(first) == 6 and first == sorted(set(first))
    assert all(example.loss_mask[p] and example.loss_mask[p + 1] for p in first)
    assert sample_anchors(example.loss_mask, 100, torch.Generator().manual_seed(3)) == list(range(5, 16))


def test_training_mask_equals_inference_mask(make_tiny_drafter):
    """Each training block sees exactly what a synchronous draft at its anchor sees, and computes the same."""
    model = make_tiny_drafter(block_size=B)
    example = make_example(4, 14, seed=2)
    anchors = [6, 9, 15]
    batch = build_batch([example], B, MASK_ID, 0, anchors=[anchors])
    length = len(example)
    train_visible = batch.attention_mask[0, 0] == 0  # (Q, Q)
    with torch.no_grad():
        train_hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   position_ids=batch.position_ids, use_cache=False).last_hidden_state[0]
    for n, p in enumerate(anchors):
        rows = torch.arange(length + n * B, length + (n + 1) * B)
        # Inference: committed tokens 0..p as the clean chain, then one block of B slots anchored at p.
        ref = block_layout(0, p + 1, [BlockSpec(p)], B)
        ref_slots = ref.slot_rows[0]
        assert torch.equal(batch.position_ids[0, rows], ref.positions[ref_slots])
        # Keys of the training layout: clean positions 0..L-1, then every block's slots.
        expected = torch.zeros(len(rows), train_visible.shape[1], dtype=torch.bool)
        expected[:, : p + 1] = ref.visible[ref_slots][:, : p + 1]
        expected[:, rows] = ref.visible[ref_slots][:, ref_slots]
        assert torch.equal(train_visible[rows], expected)
        # The same numbers come out of the inference path, with the context split between cache and chain.
        split = p // 2
        cache = DynamicCache(config=model.config)
        ids = example.input_ids[None]
        with torch.no_grad():
            prefill = batch_layouts([block_layout(0, split, [], B)], 0, torch.float32, "cpu")
            drafter_hidden(model, ids[:, :split], prefill, cache)
            layout = batch_layouts([block_layout(split, p + 1 - split, [BlockSpec(p)], B)], split,
                                   torch.float32, "cpu")
            query = torch.cat([ids[:, split : p + 1], torch.full((1, B), MASK_ID)], dim=1)
            infer_hidden = drafter_hidden(model, query, layout, cache)[0, -B:]
        torch.testing.assert_close(train_hidden[rows], infer_hidden, atol=1e-5, rtol=1e-5)
    # Clean rows are plain causal over clean tokens and never see a slot.
    clean = train_visible[:length]
    assert torch.equal(clean[:, :length], torch.ones(length, length, dtype=torch.bool).tril())
    assert not clean[:, length:].any()


def test_slot_weights_decay_and_loss_matches_reference(make_tiny_drafter):
    """L_diff = sum_i w_i CE_i / sum_i w_i over supervised slots; slots past the end have weight 0."""
    assert torch.allclose(slot_weights(B, 7.0), torch.exp(-torch.arange(B) / 7.0))
    assert torch.all(slot_weights(16, 7.0)[1:] < slot_weights(16, 7.0)[:-1])
    model = make_tiny_drafter(block_size=B)
    example = make_example(3, 9, seed=4)  # response at positions 3..11
    anchors = [4, 9]  # block at 9: slots predict 10, 11, (12, 13 past the end)
    gamma, ar_weight = 2.0, 0.5
    batch = build_batch([example], B, MASK_ID, 0, anchors=[anchors])
    out = drafter_loss(model, batch, gamma=gamma, ar_weight=ar_weight)

    with torch.no_grad():
        hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids, use_cache=False).last_hidden_state[0]
    logits = masked_logits(model, hidden)
    ids, length = example.input_ids, len(example)
    num, den = 0.0, 0.0
    for n, p in enumerate(anchors):
        for i in range(1, B + 1):
            if p + i >= length:
                continue
            ce = F.cross_entropy(logits[length + n * B + i - 1], ids[p + i]).item()
            w = math.exp(-(i - 1) / gamma)
            num, den = num + w * ce, den + w
    ar_ref = F.cross_entropy(logits[2 : length - 1], ids[3:length]).item()
    assert math.isclose(out.diff.item(), num / den, rel_tol=1e-5)
    assert math.isclose(out.ar.item(), ar_ref, rel_tol=1e-5)
    assert math.isclose(out.total.item(), num / den + ar_weight * ar_ref, rel_tol=1e-5)
    assert torch.equal(out.slot_count, torch.tensor([2, 2, 1, 1]))
    assert out.accept_blocks == 1  # only the block at 4 has slots 1..B-1 inside the response
    assert math.isfinite(out.total.item())
    out.total.backward()


def test_padding_does_not_change_the_loss(make_tiny_drafter):
    model = make_tiny_drafter(block_size=B)
    short, long = make_example(3, 8, seed=5), make_example(6, 20, seed=6)
    anchors = [[3, 5, 7]]
    base = drafter_loss(model, build_batch([short], B, MASK_ID, 0, anchors=anchors, pad_multiple=1))
    padded = drafter_loss(model, build_batch([short], B, MASK_ID, 0, anchors=anchors, pad_multiple=16,
                                             extra_padding=21))
    torch.testing.assert_close(padded.total, base.total, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.slot_count, base.slot_count)
    # Next to a longer sequence (more padding on the short row) each row computes the same.
    pair = build_batch([short, long], B, MASK_ID, 0, anchors=anchors + [[6, 10, 20]])
    alone = build_batch([short], B, MASK_ID, 0, anchors=anchors, pad_multiple=1)
    with torch.no_grad():
        h_pair = model.model(input_ids=pair.input_ids, attention_mask=pair.attention_mask,
                             position_ids=pair.position_ids, use_cache=False).last_hidden_state
        h_alone = model.model(input_ids=alone.input_ids, attention_mask=alone.attention_mask,
                              position_ids=alone.position_ids, use_cache=False).last_hidden_state
    q = alone.input_ids.shape[1]
    torch.testing.assert_close(h_pair[0, :q], h_alone[0], atol=1e-5, rtol=1e-5)
    # The batched loss counts every supervised slot of both rows.
    both = drafter_loss(model, pair)
    assert int(both.slot_count.sum()) == pair.slot_rows.numel() > int(base.slot_count.sum())
    assert math.isfinite(both.total.item())


def test_the_lean_runner_computes_the_same_loss_as_the_transformers_forward(make_tiny_drafter):
    """The loss ranking's path (prune.ranking.loss_without_each_layer): an inference runner over an empty cache."""
    from models.inference import decoder_runner

    model = make_tiny_drafter(block_size=B)
    batch = build_batch([make_example(3, 8, seed=5), make_example(6, 20, seed=6)], B, MASK_ID, 0,
                        anchors=[[3, 5, 7], [6, 10, 20]])
    with torch.no_grad():
        reference = drafter_loss(model, batch)
        lean = drafter_loss(model, batch, runner=decoder_runner(model, fused=True))
    torch.testing.assert_close(lean.total, reference.total, atol=1e-5, rtol=1e-5)
    assert torch.equal(lean.slot_correct, reference.slot_correct) and lean.accept_sum == reference.accept_sum


def test_teacher_term_is_a_kl_that_vanishes_on_the_teacher_and_mixes_with_ce(make_tiny_drafter):
    """With a teacher, each row's loss is (1 - w) CE + w KL(teacher || model), KL over the proposable ids."""
    model, other = make_tiny_drafter(block_size=B), make_tiny_drafter(block_size=B, seed=5)
    batch = build_batch([make_example(3, 9, seed=4)], B, MASK_ID, 0, anchors=[[4, 9]])
    plain = drafter_loss(model, batch, gamma=2.0)
    # The model as its own teacher: KL is 0, so w = 1 leaves nothing and w = 0.25 scales the CE by 0.75.
    assert drafter_loss(model, batch, gamma=2.0, teacher=model, distill_weight=1.0).total.abs().item() < 1e-5
    scaled = drafter_loss(model, batch, gamma=2.0, teacher=model, distill_weight=0.25)
    assert math.isclose(scaled.total.item(), 0.75 * plain.total.item(), rel_tol=1e-5)
    # Another teacher: a positive divergence, finite although masked ids are -inf in both.
    taught = drafter_loss(model, batch, gamma=2.0, teacher=other, distill_weight=1.0)
    assert taught.total.item() > 0 and math.isfinite(taught.total.item())
    taught.total.backward()
    assert all(p.grad is None for p in other.parameters())  # the teacher stays frozen


def divergence(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Reference KL(teacher || model) per row on whole logits, over the ids both leave finite."""
    log_p, log_q = F.log_softmax(teacher_logits, -1), F.log_softmax(logits, -1)
    return torch.where(torch.isfinite(teacher_logits), log_p.exp() * (log_p - log_q), 0.0).sum(-1)


@pytest.mark.parametrize("distill_weight", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("head_trained", [False, True])
def test_chunked_head_losses_equal_the_whole_logits_reference(make_tiny_drafter, monkeypatch, distill_weight,
                                                              head_trained):
    """head_losses never holds the (rows, vocab) logits whole; its losses, argmax and gradients (hidden states
    and, when trained, the head) are those of the plain formula on the whole masked logits."""
    import prune.training.loss as loss_module
    from prune.training.loss import head_losses

    monkeypatch.setattr(loss_module, "HEAD_CHUNK_ROWS", 3)  # 7 rows: chunks of 3, 3 and 1
    model, teacher = make_tiny_drafter(block_size=B), make_tiny_drafter(block_size=B, seed=5)
    model.lm_head.weight.requires_grad_(head_trained)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, model.config.hidden_size, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(7, model.config.hidden_size, generator=generator)
    targets = torch.randint(0, MASK_ID, (7,), generator=generator)
    upstream = torch.rand(7, generator=generator)  # unequal row weights, as the slot weights give

    def reference():
        logits = masked_logits(model, hidden)
        loss = F.cross_entropy(logits, targets, reduction="none")
        if distill_weight > 0:
            loss = (1 - distill_weight) * loss + distill_weight * divergence(
                logits, masked_logits(teacher, teacher_hidden))
        return loss, logits.argmax(-1)

    def gradients(loss):
        (loss * upstream).sum().backward()
        grads = [hidden.grad.clone()] + ([model.lm_head.weight.grad.clone()] if head_trained else [])
        hidden.grad, model.lm_head.weight.grad = None, None
        return grads

    want, want_top = reference()
    want_grads = gradients(want)
    got, got_top = head_losses(model, hidden, targets, distill_weight, teacher, teacher_hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_top, want_top)
    for g, w in zip(gradients(got), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # A batch without supervised rows (a short held-out sequence) gives empty losses and a zero gradient.
    none, none_top = head_losses(model, hidden[:0], targets[:0], distill_weight, teacher, teacher_hidden[:0])
    assert none.shape == none_top.shape == (0,)
    none.sum().backward()
    assert hidden.grad is not None and not hidden.grad.any()
