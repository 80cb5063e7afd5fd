"""The drafter side of every decoder: batched block-diffusion passes over per-row KV caches.

One `DraftEngine` serves a batch of sequences (rows) in lockstep; live decoding uses one row, replayed
scoring many. Each row's cache holds a prefix of its committed tokens. A pass feeds, per row, a chain
of clean tokens (the committed tokens not yet cached, then any unverified drafts) and blocks of mask
slots anchored on that chain; `keep` then tells each row how many chain tokens to retain, which drops
the drafts that were rejected and every candidate block.
"""

import contextlib
from dataclasses import dataclass

import torch

from models.inference import decoder_runner, masked_logits
from models.masks import BlockSpec, batch_layouts, block_layout


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


class DraftEngine:
    """Runs drafter passes for `rows` sequences sharing one batched KV cache.

    Args:
        model: the drafter (`Qwen3ForCausalLM` with `block_size` and `mask_token_id` in its config).
        rows: number of sequences decoded in lockstep.
        fan_out: alternatives kept per slot (bonus-token guesses for async candidates).
        lean: run the lean forward (models/lean.py) where it applies; False forces transformers'.
    """

    def __init__(self, model: torch.nn.Module, rows: int = 1, fan_out: int = 4, lean: bool = True):
        self.model = model
        self.block_size = model.config.block_size
        self.mask_id = model.config.mask_token_id
        self.fan_out = fan_out
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._ready = None  # a CUDA event the next pass waits for (see mark_ready)
        self.rows = rows
        # Layer products not prepacked: measured on 2 AVX2 cores, the drafter's small products gain nothing
        # from it (its lm_head is; models/lean.py).
        self.runner = decoder_runner(model, lean)
        self.cache = self.runner.new_cache(rows)
        self.cache_lens = [0] * rows  # valid cached positions per row
        self.padded_len = 0  # key slots per row in the cache tensors

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
        # Work queued on the default stream before this pass (a weight update, a layer copy, the caller's
        # uploads) must finish before the drafter stream reads it.
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
            layout = block_layout(self.cache_lens[row], len(request.chain), request.blocks, self.block_size)
            ids = list(request.chain)
            for block in request.blocks:
                ids += ([block.guess] if block.guess is not None else []) + [self.mask_id] * self.block_size
            layouts.append(layout)
            inputs.append(ids)
        q_max = max(len(ids) for ids in inputs)
        if q_max == 0:
            return [[] for _ in requests]
        with self._on_stream():
            batched = batch_layouts(layouts, self.padded_len, self.dtype, self.device)
            input_ids = torch.full((len(inputs), q_max), self.mask_id, dtype=torch.long)
            for row, ids in enumerate(inputs):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            hidden = self.runner.forward(input_ids.to(self.device), batched.positions, batched.mask, self.cache,
                                         lengths=[len(ids) for ids in inputs])
            return self._read_blocks(hidden, layouts)

    def _read_blocks(self, hidden: torch.Tensor, layouts) -> list[list[BlockPrediction]]:
        rows = [(r, n) for r, layout in enumerate(layouts) for n in range(len(layout.blocks))]
        if not rows:
            return [[] for _ in layouts]
        index_r = torch.cat([torch.full((self.block_size,), r) for r, _ in rows])
        index_q = torch.cat([layouts[r].slot_rows[n] for r, n in rows])
        slots = hidden[index_r.to(self.device), index_q.to(self.device)]
        logits = masked_logits(self.model, slots, self.runner.logits)
        # The few top probabilities without the full softmax: exp(logit - logsumexp) (blocks * B, F + 1).
        top_l, top_i = logits.topk(self.fan_out + 1, dim=-1)
        top_p = (top_l - logits.logsumexp(dim=-1, keepdim=True)).exp()
        top_p = top_p.view(len(rows), self.block_size, -1).tolist()
        top_i = top_i.view(len(rows), self.block_size, -1).tolist()
        out: list[list[BlockPrediction]] = [[] for _ in layouts]
        for k, (r, _) in enumerate(rows):
            out[r].append(
                BlockPrediction(
                    tokens=[slot[0] for slot in top_i[k]],
                    probs=[slot[0] for slot in top_p[k]],
                    alternatives=[list(zip(ids[1:], ps[1:])) for ids, ps in zip(top_i[k], top_p[k])],
                )
            )
        return out

    @torch.inference_mode()  # the cache buffers are inference tensors, made inside forward
    def keep(self, counts: list[int]) -> None:
        """After a pass, keep the first `counts[r]` chain tokens of each row in its cache."""
        new_lens = [c + k for c, k in zip(self.cache_lens, counts)]
        with self._on_stream():
            if self.rows == 1:
                self.cache.crop(self.padded_len + counts[0])
            else:
                new_padded = max(new_lens)
                keep = torch.zeros(self.rows, new_padded, dtype=torch.long)
                for r, (c, k) in enumerate(zip(self.cache_lens, counts)):
                    keep[r, :c] = torch.arange(c)
                    keep[r, c : c + k] = torch.arange(self.padded_len, self.padded_len + k)
                self.cache.keep_rows(keep)
        self.cache_lens = new_lens
        self.padded_len = max(new_lens) if self.rows > 1 else new_lens[0]

