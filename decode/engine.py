"""The drafter side of every decoder: batched block-diffusion passes over per-row KV caches.

One `DraftEngine` serves a batch of sequences (rows) in lockstep; live decoding uses one row, replayed
scoring many. Each row's cache holds a prefix of its committed tokens. A pass feeds, per row, a chain
of clean tokens (the committed tokens not yet cached, then any unverified drafts) and blocks of mask
slots anchored on that chain; `keep` then tells each row how many chain tokens to retain, which drops
the drafts that were rejected and every candidate block.

On CUDA the passes run on the drafter's own stream (decode.worker.draft_stream) while the caller's stream
(the target's) runs on. The ordering rules that make this safe:
- every pass (`forward`, a batched `keep`) first makes the drafter stream wait for the caller's current
  stream, or for the point `mark_ready` recorded: weights changed, copied or merged there just before (a
  layer removed, an optimizer step, a LoRA merge, a dtype rounding) are what the pass reads;
- `forward` ends in one host wait (the read of its predictions), so when it returns the stream has
  finished with every tensor it did not allocate itself (the weights): the caller may change or free them
  at once; a batched `keep` touches only the engine's own cache;
- the engine's own tensors (its KV cache, each pass's inputs) are allocated on the drafter stream, so
  the caching allocator hands their memory out again only in that stream's order.
A CUDA pass sends its inputs (ids, the query table its mask is built from on the device, the packed-token
index, the slots to read) in one non-blocking copy from pinned memory and reads its predictions back in
one copy and one sync. On the CPU the inputs are built where the pass runs, as before.
"""

import contextlib
from dataclasses import dataclass

import torch

from models.drafter_config import draft_vocab_limit
from models.inference import decoder_runner, draft_logits, id_logits
from models.lean import packed_index
from models.masks import BlockSpec, batch_layouts, block_layout, mask_from_table, query_table
from models.transfer import upload_parts

from .worker import draft_stream


GROUPS = 64  # `top_k` reads a row's vocabulary as this many interleaved slices


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.topk(k, dim=-1)` `(rows, vocab)` -> values and indices `(rows, k)`, largest first.

    On a CPU, torch's top-k over a whole vocabulary runs a selection per row (1.0-1.5 ms for 16 rows of
    49216 on 2 cores, as much as the lm_head's product). The top k instead come from k candidate groups:
    the vocabulary read as `(GROUPS, vocab / GROUPS)`, each column a group whose maximum is one vectorised
    reduction; an entry of the top k lies in a group whose maximum is among the k largest, so the top k of
    those k groups' entries are the row's top k (0.2 ms). Same values; among equal values the indices may
    be other equal entries' (torch.topk's order among ties is unspecified too). Elsewhere, or where the
    vocabulary does not split evenly, torch.topk.
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % GROUPS or vocab // GROUPS < k:
        return logits.topk(k, dim=-1)
    width = vocab // GROUPS
    _, groups = logits.view(rows, GROUPS, width).amax(dim=1).topk(k, dim=-1)  # (rows, k) column indices
    candidates = (groups[:, :, None] + width * torch.arange(GROUPS, device=logits.device)).flatten(1)
    values, picked = logits.gather(1, candidates).topk(k, dim=-1)
    return values, candidates.gather(1, picked)


@dataclass
class DraftRequest:
    """What one row asks of a pass.

    Attributes:
        chain: clean tokens fed after the row's cached positions.
        blocks: blocks of mask slots with absolute anchors (and optional guess tokens).
    """

    chain: list[int]
    blocks: list[BlockSpec]


@dataclass
class BlockPrediction:
    """The drafter's reading of one block's B slots.

    Attributes:
        tokens: argmax id per slot.
        probs: probability of that argmax per slot (the drafter's confidence).
        alternatives: per slot, the next-best (id, probability) pairs, argmax excluded, best first.
    """

    tokens: list[int]
    probs: list[float]
    alternatives: list[list[tuple[int, float]]]


class ContextIds:
    """Per row, the ids of its context that a drafter's draft vocabulary lacks: proposable too (`DraftEngine`).

    A draft vocabulary holds the ids the target writes most often (models/draft_vocab.py); what it misses
    most is what a sequence copies from its own context: identifiers of a code prompt, names and numbers of
    a question, words the answer has already used. So every clean token a row is fed (prompt, committed
    output; its drafts are vocabulary ids already) that the vocabulary lacks joins that row's extra ids,
    and its passes score those head rows beside the vocabulary's, each row its own (docs/design.md, Draft
    vocabulary). The target verifies every proposal, so this moves acceptance only; the same chains give
    the same ids in live and replayed decoding.

    Args:
        vocab: the draft vocabulary, int64 `(K,)`.
        config: the drafter's config (its proposable ids: below draft_vocab_size, never the mask id).
        rows: sequences of the engine.
    """

    def __init__(self, vocab: torch.Tensor, config, rows: int):
        self.outside = frozenset(vocab.tolist()) | {config.mask_token_id}  # never an extra id
        self.limit = draft_vocab_limit(config)
        self.ids: list[dict[int, None]] = [{} for _ in range(rows)]  # insertion-ordered sets
        self._last = None  # (rows read, extras per row then, columns): a pass's columns, reused while unchanged

    def note(self, row: int, tokens: list[int]) -> None:
        """Add the proposable ids of `tokens` (fed to `row`) that the vocabulary lacks to the row's extras."""
        seen = self.ids[row]
        for token in tokens:
            if token not in seen and token < self.limit and token not in self.outside:
                seen[token] = None

    def columns(self, rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """For the read blocks of `rows` (one entry per block): the extra ids of those rows together, int64
        `(U,)` ascending, and which of them each block's row holds, bool `(blocks, U)` (None where one row holds
        them all); None when none has any. Most passes add no extra id, so the last pass's answer is reused."""
        sizes = [len(self.ids[r]) for r in rows]  # the extras only grow: equal sizes, equal sets
        if self._last is not None and self._last[:2] == (rows, sizes):
            return self._last[2]
        distinct = sorted(set(rows))
        union = sorted(set().union(*(self.ids[r] for r in distinct)))
        found = None
        if union:
            allowed = None
            if len(distinct) > 1:
                column = {token: u for u, token in enumerate(union)}
                held = torch.zeros(len(distinct), len(union), dtype=torch.bool)  # per distinct row
                for i, r in enumerate(distinct):
                    held[i, [column[token] for token in self.ids[r]]] = True
                place = {r: i for i, r in enumerate(distinct)}
                allowed = held[[place[r] for r in rows]].to(device, non_blocking=True)
            found = torch.tensor(union, dtype=torch.int64).to(device, non_blocking=True), allowed
        self._last = (list(rows), sizes, found)
        return found


class DraftEngine:
    """Runs drafter passes for `rows` sequences sharing one batched KV cache.

    Args:
        model: the drafter (`Qwen3ForCausalLM` with `block_size` and `mask_token_id` in its config).
        rows: number of sequences decoded in lockstep.
        fan_out: alternatives kept per slot (bonus-token guesses for async candidates).
        lean: run the lean forward (models/lean.py) where it applies; False forces transformers'.
        context_vocab: with a draft vocabulary, each row may also propose the ids of its own context (the
            clean tokens fed to it: prompt and committed output) that lie outside the vocabulary (`ContextIds`).
    """

    def __init__(self, model: torch.nn.Module, rows: int = 1, fan_out: int = 4, lean: bool = True,
                 context_vocab: bool = True):
        self.model = model
        self.block_size: int = model.config.block_size
        self.mask_id: int = model.config.mask_token_id
        self.fan_out = fan_out
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.stream = draft_stream(self.device)  # one per GPU, shared by every engine; None off CUDA
        # Inputs staged in one upload and the mask built on the device (off the CPU; see the module docstring).
        self.staged = self.device.type != "cpu"
        self._ready = None  # a CUDA event the next pass waits for (see mark_ready)
        self.rows = rows
        # The fused form (models/lean.py), where the lean forward keeps derived copies (a CPU; a GPU runs the
        # drafter's own weights): a drafter's outputs need not follow transformers' order of operations. Its
        # layer products are not prepacked: measured on 2 AVX2 cores, they gain nothing from it (its lm_head does).
        self.runner = decoder_runner(model, lean, fused=True)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.cache = self.runner.new_cache(rows)  # drafter-stream memory, reused in that stream's order
        self.cache_lens = [0] * rows  # valid cached positions per row
        self.padded_len = 0  # key slots per row in the cache tensors
        vocab = getattr(self.runner, "head_ids", None)
        self.context = ContextIds(vocab, model.config, rows) if context_vocab and vocab is not None else None

    def mark_ready(self) -> None:
        """Record, on the calling thread's current stream, the point the next pass must wait for.

        The async decoder calls it before handing the packed pass to its worker thread: the pass then
        waits for everything queued before that point (weight updates, uploads), but not for the
        verify pass the caller queues right after, so the two still overlap.
        """
        if self.stream is not None:
            self._ready = torch.cuda.current_stream(self.device).record_event()

    def _on_stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        # Work queued on the caller's stream before this pass (a weight update, a layer copy, a merge) must
        # finish before the drafter stream reads it.
        if self._ready is not None:
            self.stream.wait_event(self._ready)
            self._ready = None
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    @torch.inference_mode()
    def forward(self, requests: list[DraftRequest | None]) -> list[list[BlockPrediction]]:
        """Run one pass; rows with None feed nothing. Returns, per row, one prediction per block."""
        layouts, inputs = [], []
        for row, request in enumerate(requests):
            if request is None:
                request = DraftRequest([], [])
            layout = block_layout(self.cache_lens[row], len(request.chain), request.blocks, self.block_size,
                                  dense=not self.staged)
            ids = list(request.chain)
            for block in request.blocks:
                ids += ([block.guess] if block.guess is not None else []) + [self.mask_id] * self.block_size
            layouts.append(layout)
            inputs.append(ids)
            if self.context is not None:
                self.context.note(row, request.chain)
        q_max = max(len(ids) for ids in inputs)
        if q_max == 0:
            self._ready = None  # nothing ran: the next pass waits for the caller's whole stream instead
            return [[] for _ in requests]
        lengths = [len(ids) for ids in inputs]
        reads = [(r, n) for r, layout in enumerate(layouts) for n in range(len(layout.blocks))]
        with self._on_stream():
            if self.staged:
                input_ids, positions, mask, packed, index_r, index_q = self._staged_inputs(layouts, inputs, q_max,
                                                                                           lengths, reads)
                hidden = self.runner.forward(input_ids, positions, mask, self.cache, lengths=lengths,
                                             packed_index=packed)
                return self._read_blocks(hidden, layouts, reads, index_r, index_q)
            batched = batch_layouts(layouts, self.padded_len, self.dtype, self.device)
            input_ids = torch.full((len(inputs), q_max), self.mask_id, dtype=torch.long)
            for row, ids in enumerate(inputs):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            hidden = self.runner.forward(input_ids.to(self.device), batched.positions, batched.mask, self.cache,
                                         lengths=lengths)
            if not reads:
                return self._read_blocks(hidden, layouts, reads, None, None)
            index_r = torch.cat([torch.full((self.block_size,), r) for r, _ in reads])
            index_q = torch.cat([layouts[r].slot_rows[n] for r, n in reads])
            return self._read_blocks(hidden, layouts, reads, index_r.to(self.device), index_q.to(self.device))

    def _staged_inputs(self, layouts, inputs: list[list[int]], q_max: int, lengths: list[int], reads):
        """A pass's inputs in one upload (models.transfer.upload_parts), issued before the pass launches:
        (input_ids, positions, mask, packed-token index or None, rows and query indices of the slots read).
        The mask is built on the device from the query table (models.masks.mask_from_table)."""
        batch, block = len(inputs), self.block_size
        ids = [token for row in inputs for token in row + [self.mask_id] * (q_max - len(row))]
        firsts = [int(layouts[r].slot_rows[n][0]) for r, n in reads]
        rows = [r for r, _ in reads for _ in range(block)]
        queries = [first + i for first in firsts for i in range(block)]
        input_ids, table, packed, index_r, index_q = upload_parts(
            [ids, query_table(layouts, q_max, self.padded_len), packed_index(lengths, q_max), rows, queries],
            self.device)
        mask, positions = mask_from_table(table, batch, q_max, self.padded_len, self.dtype)
        return input_ids.view(batch, q_max), positions, mask, packed if packed.numel() else None, index_r, index_q

    def _read_blocks(self, hidden: torch.Tensor, layouts, reads, index_r, index_q) -> list[list[BlockPrediction]]:
        """Per row, the predictions of its blocks (`reads`: (row, block) pairs; index_r/index_q: the rows and
        query indices of their slots in `hidden`); on CUDA the pass ends here in one host wait."""
        if not reads:
            self._host_wait()  # a pass with nothing to read still ends in a host wait
            return [[] for _ in layouts]
        slots = hidden[index_r, index_q]
        # Over a draft vocabulary the head computes its rows alone (a distribution renormalised over them), and
        # its columns map back to target ids here (models/draft_vocab.py).
        logits, ids = draft_logits(self.model, slots, self.runner)
        # The few top probabilities without the full softmax: exp(logit - logsumexp) (blocks * B, F + 1).
        k = min(self.fan_out + 1, logits.shape[-1])
        top_l, top_i = top_k(logits, k)
        total = logits.logsumexp(dim=-1, keepdim=True)
        if ids is not None:
            top_i = ids[top_i]
        extra = self.context.columns([r for r, _ in reads], self.device) if self.context is not None else None
        if extra is not None:  # the rows' context ids outside the draft vocabulary, each row's own alone
            extra_ids, allowed = extra
            more = id_logits(self.model, slots, extra_ids)  # (blocks * B, U)
            if allowed is not None:
                more.masked_fill_(~allowed.repeat_interleave(self.block_size, dim=0), float("-inf"))
            total = torch.logaddexp(total, more.logsumexp(dim=-1, keepdim=True))
            more_l, more_i = more.topk(min(k, more.shape[-1]), dim=-1)
            top_l, order = torch.cat([top_l, more_l], dim=-1).topk(k, dim=-1)
            top_i = torch.cat([top_i, extra_ids[more_i]], dim=-1).gather(-1, order)
        top_p = (top_l - total).exp()
        top_p = top_p.view(len(reads), self.block_size, -1)
        top_i = top_i.view(len(reads), self.block_size, -1)
        if self.device.type == "cuda":  # both copies queued, then one sync (instead of one per tolist)
            top_p, top_i = top_p.to("cpu", non_blocking=True), top_i.to("cpu", non_blocking=True)
            self._host_wait()
        probs, tokens = top_p.tolist(), top_i.tolist()
        out: list[list[BlockPrediction]] = [[] for _ in layouts]
        for k, (r, _) in enumerate(reads):
            out[r].append(
                BlockPrediction(
                    tokens=[slot[0] for slot in tokens[k]],
                    probs=[slot[0] for slot in probs[k]],
                    alternatives=[list(zip(ids[1:], ps[1:])) for ids, ps in zip(tokens[k], probs[k])],
                )
            )
        return out

    def _host_wait(self) -> None:
        """Wait until the drafter stream has run everything queued on it (CUDA; nothing to wait for elsewhere)."""
        if self.stream is not None:
            self.stream.synchronize()

    @torch.inference_mode()  # the cache buffers are inference tensors, made inside forward
    def keep(self, counts: list[int]) -> None:
        """After a pass, keep the first `counts[r]` chain tokens of each row in its cache."""
        new_lens = [c + k for c, k in zip(self.cache_lens, counts)]
        if self.rows == 1:
            self.cache.crop(self.padded_len + counts[0])  # bookkeeping alone: no device work to order
        else:
            with self._on_stream():
                new_padded = max(new_lens)
                keep = torch.zeros(self.rows, new_padded, dtype=torch.long)
                for r, (c, k) in enumerate(zip(self.cache_lens, counts)):
                    keep[r, :c] = torch.arange(c)
                    keep[r, c : c + k] = torch.arange(self.padded_len, self.padded_len + k)
                self.cache.keep_rows(keep)  # built on the host; the cache sends what moves in one copy
        self.cache_lens = new_lens
        self.padded_len = max(new_lens) if self.rows > 1 else new_lens[0]
