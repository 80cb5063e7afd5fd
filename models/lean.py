"""A lean forward pass for Llama-family decoders, run directly on a transformers model's weights.

transformers' modules pay a fixed price per layer (kwargs plumbing, mask preparation, cache objects that
concatenate on every update) that dominates small models on a CPU: on 2 cores the demo drafter's 36
layers spent about half of each pass outside matrix products. `LeanDecoder` runs the layers as a plain
loop over a preallocated `StaticKV` cache, on matrices derived once from the model's weights (q/k/v and
gate/up stacked; `(in, out)` or oneDNN-prepacked, whichever the pass's rows run faster: `stacked`).

Supported: Llama, Mistral (no sliding window), Qwen2 and Qwen3 (q/k norms) with plain `nn.Linear`
projections and the default or scaled RoPE of the model's own rotary module. `LeanDecoder.supports`
says whether a model qualifies; callers fall back to the transformers forward otherwise (adapters
attached, other architectures). Numerics follow transformers' order of operations (norms in float32,
RoPE after the q/k norms); results match the transformers forward to float rounding, not bit for bit.

A drafter's passes may run the layers in a `fused` form instead (docs/speed.md, The drafter's fused form):
the same function in fewer operations, for a model whose outputs need not follow transformers' order of
operations (a drafter proposes; the target's verification alone decides the output).
"""

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cache import StaticKV
from .draft_vocab import head_selection
from .transfer import upload

_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# module -> {kind: (key, derived tensors)}, kept between decoders: a target's stacked layer matrices (`stacked`,
# plain or packed) under the model, the lm_head's under the lm_head, a drafter layer's fused form under that layer
# (so a view of the drafter without some layers, models.surgery.without_layers, reuses its kept layers' and
# head's forms instead of deriving a second set). Outside the modules, so that copies of them (layer surgery
# deep-copies) neither carry nor share them, and dropped with the module.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN can hold weights prepacked for this CPU: float32, and bfloat16 where the CPU has
    the instructions oneDNN's bfloat16 path needs (without them the reorder raises)."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(supported is not None and supported())
    return dtype == torch.float32


def stacked(owner: torch.nn.Module, role: str, groups: list[tuple[torch.Tensor, ...]], packed: bool,
            rows: torch.Tensor | int | None = None) -> list[torch.Tensor]:
    """One matrix per group of `groups` (`(out, in)` weights stacked along the output dimension), made once
    per `owner` (the module holding the weights: the model for "layers", the lm_head for "head") and `role`,
    and reused while the weights are unchanged: oneDNN-prepacked where `packed`, else `(in, out)` contiguous
    for `torch.mm`. `rows`: keep only those output rows of every matrix, int64 `(R,)` ids or an int R for the
    first R (a drafter's head over its draft vocabulary or its proposable ids, models.draft_vocab.head_selection).

    Stacking saves where each product's fixed cost is most of it: q, k and v (and gate and up) read the same
    input, so one product of the stacked matrix replaces three (two). Of the two forms, which is faster
    depends on the rows and the CPU (measured on 2 AVX-512 cores, the demo target's 30 layers of products):
    `torch.mm` on `(in, out)` takes MKL's matrix-vector path at one row, 22.8 ms against 35.3 ms prepacked,
    and is slower from two rows on (35.6 / 38.8 / 44.8 ms at 2 / 4 / 8 rows against 35.7 / 36.7 / 38.3 ms
    prepacked; the whole pass did not bear that out, see models.inference.target_runner); on 2 AVX2 EPYC
    cores prepacked products ran 1, 4 and 16 rows in 0.6x, 0.45x and 0.55x the time of `F.linear`. So the
    lean forward holds the forms it uses and picks one per product by its rows (`LeanDecoder`,
    `packed_from`).

    The copies are keyed by data pointer, version counter and a sample of the values (peft merges adapters
    through `.data`, which moves neither of the first two; a merge changes nearly every value, so the sample
    sees it) and rebuilt when any weight changes; they double the weights' memory per form.
    """
    flat = [w for group in groups for w in group] + ([rows] if isinstance(rows, torch.Tensor) else [])

    def build():
        matrices = [_rows_of(torch.cat(group) if len(group) > 1 else group[0], rows) for group in groups]
        if packed:
            return [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in matrices]
        return [w.t().contiguous() for w in matrices]

    if isinstance(rows, int):  # a prefix is part of the kind: the weights alone do not say it
        role = f"{role}[:{rows}]"
    return _derived(owner, (role, packed), flat, build)


def _rows_of(weight: torch.Tensor, rows: torch.Tensor | int | None) -> torch.Tensor:
    """The output rows `rows` of `weight` `(out, in)`: gathered ids, a prefix (a view), or every row."""
    if rows is None:
        return weight
    return weight[:rows] if isinstance(rows, int) else weight.index_select(0, rows)


def forget_unused(model: torch.nn.Module, packed_from: int | None) -> None:
    """Drop the layer matrices of `model` in the form that decoders with `packed_from` never read (a measurement
    of both forms made them; each is as large as the weights)."""
    derived = _PACKED.get(model, {})
    if packed_from == 1:  # every product prepacked: no plain matrix is read
        derived.pop(("layers", False), None)
    if packed_from is None:  # none prepacked
        derived.pop(("layers", True), None)


def head_product(model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor | int | None) -> torch.Tensor:
    """`model.lm_head(hidden)` `(..., hidden_size)` -> `(..., R)` on the head rows `rows` (ids, the first R, or
    None: every row; models.draft_vocab.head_selection), the weights read in place: a prefix is a view, ids
    are gathered once per model while the weights are unchanged."""
    if rows is None:
        return model.lm_head(hidden)
    weight, bias = model.lm_head.weight, getattr(model.lm_head, "bias", None)
    if isinstance(rows, torch.Tensor):
        weight = _derived(model.lm_head, ("head rows",), [weight, rows], lambda: weight.detach().index_select(0, rows))
    else:
        weight = weight[:rows]
    return F.linear(hidden, weight, None if bias is None else _rows_of(bias, rows))


def _derived(owner: torch.nn.Module, kind: tuple, weights: list[torch.Tensor], build):
    """`build()` (tensors derived from `weights`), cached per (owner, kind) while `weights` are unchanged."""
    key = tuple((w.data_ptr(), -1 if w.is_inference() else w._version, _sample_sum(w)) for w in weights)
    cached = _PACKED.setdefault(owner, {}).get(kind)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.inference_mode():
        derived = build()
    _PACKED[owner][kind] = (key, derived)
    return derived


def _sample_sum(weight: torch.Tensor) -> float:
    """The sum of about 64 evenly spaced values of `weight` (a cheap witness of in-place changes)."""
    flat = weight.detach().reshape(-1)
    return float(flat[:: max(1, flat.numel() // 64)].sum())


class _Matrix(NamedTuple):
    """One product's weights in the forms the lean forward runs it (see `stacked`): `plain` `(in, out)` for
    `torch.mm`, `packed` oneDNN-prepacked, each None where unused; `bias` `(out,)` or None. Without either
    form, `parts` holds the stacked members' own `(out, in)` weights and biases, read in place."""

    plain: torch.Tensor | None
    packed: torch.Tensor | None
    bias: torch.Tensor | None = None
    parts: tuple = ()

    def __call__(self, x: torch.Tensor, packed_from: int | None) -> torch.Tensor:
        """`x @ W.T + bias` for tokens `x` `(*tokens, in)` -> `(*tokens, out)`: prepacked from `packed_from`
        rows on (None: never), plain below."""
        if self.parts:
            outs = [F.linear(x, weight, bias) for weight, bias in self.parts]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        rows = x.reshape(-1, x.shape[-1])
        if self.packed is not None and packed_from is not None and rows.shape[0] >= packed_from:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        elif self.bias is None:
            out = torch.mm(rows, self.plain)
        else:
            out = torch.addmm(self.bias, rows, self.plain)
        return out.view(*x.shape[:-1], out.shape[-1])


class _Layer(NamedTuple):
    """One decoder layer's tensors as the lean forward runs them."""

    input_norm: torch.Tensor  # (hidden,)
    qkv: _Matrix  # q, k and v stacked: hidden -> (heads + 2 kv_heads) * head_dim
    qk_norm: torch.Tensor | None  # (heads + kv_heads, head_dim): q_norm per q head, then k_norm per k head
    o: _Matrix
    post_norm: torch.Tensor
    gate_up: _Matrix  # gate and up stacked: hidden -> 2 * intermediate
    down: _Matrix


def _products(module: torch.nn.Module) -> list[tuple[tuple[torch.Tensor, ...], tuple]]:
    """The layer's products as (weights stacked into one matrix, their biases), in `_Layer` order: qkv, o,
    gate_up, down."""
    attn, mlp = module.self_attn, module.mlp
    return [((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
             (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
            ((attn.o_proj.weight,), (None,)),
            ((mlp.gate_proj.weight, mlp.up_proj.weight), (None, None)),
            ((mlp.down_proj.weight,), (None,))]


# Passes of up to this many tokens take RoPE's rotated halves from the q/k/v product (`_fused_layer`): it
# saves two small operations a layer, and costs 2 * (heads + kv_heads) * head_dim * hidden multiply-adds a
# token, which from here on cost more than the operations (demo drafter on 2 AVX-512 cores: 17-token draft
# passes gain, 16 rows x 34 tokens lose about 4 %).
ROTATION_IN_PRODUCT_TOKENS = 64


class _FusedLayer(NamedTuple):
    """One decoder layer in the fused form (`LeanDecoder`, `fused`): plain `(in, out)` matrices for
    `torch.mm` / `torch.addmm`, norm weights folded in."""

    qkv: torch.Tensor  # (hidden, (heads + 2 kv_heads) * head_dim + (heads + kv_heads) * head_dim): q, k, v, then
    #                    rotate_half(q) and rotate_half(k); the input norm's weight folded in (`_fused_layer`)
    qkv_bias: torch.Tensor | None  # (same width,) or None
    o: torch.Tensor  # (heads * head_dim, hidden)
    gate_up: torch.Tensor  # (hidden, 2 * intermediate), the post-attention norm's weight folded in
    down: torch.Tensor  # (intermediate, hidden)
    rope_weights: torch.Tensor | None  # (2, heads + kv_heads, head_dim): q/k norm weights, plain and rotated


def _rotate_half_index(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's rotate-half as a signed permutation: `rotate_half(x)[..., i] == sign[i] * x[..., source[i]]`."""
    half = head_dim // 2
    source = torch.cat([torch.arange(half, head_dim), torch.arange(half)])
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return source, sign


def _fused_layer(module: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> _FusedLayer:
    """`module`'s weights in the fused form.

    The q/k/v matrix can also yield the rotated halves RoPE needs: `rotate_half` is a signed permutation of
    each head's dimensions, so permuted (and negated) q and k rows give `rotate_half(q)` and
    `rotate_half(k)`; short passes read them from the product (`ROTATION_IN_PRODUCT_TOKENS`), longer ones
    multiply the first columns only and rotate. The per-head q/k RMS norm commutes with the permutation up
    to its weight (a head's norm is unchanged by it), so the weights stay apart, permuted alike for the sine
    term (`rope_weights`). An RMS norm's weight folds into the rows of the product that reads the norm's
    output: `(x * s * w) @ W.T == (x * s) @ (W * w).T`."""
    attn, mlp = module.self_attn, module.mlp
    hidden = attn.q_proj.weight.shape[1]
    source, sign = _rotate_half_index(head_dim)
    qk = torch.cat([attn.q_proj.weight, attn.k_proj.weight]).view(heads + kv_heads, head_dim, hidden)
    rotated = qk[:, source] * sign[:, None].to(qk.dtype)
    qkv = torch.cat([qk.flatten(0, 1), attn.v_proj.weight, rotated.flatten(0, 1)])
    qkv = (qkv * module.input_layernorm.weight).t().contiguous()
    bias = None
    if attn.q_proj.bias is not None:
        bias_qk = torch.cat([attn.q_proj.bias, attn.k_proj.bias]).view(heads + kv_heads, head_dim)
        bias = torch.cat([bias_qk.flatten(), attn.v_proj.bias, (bias_qk[:, source] * sign.to(bias_qk.dtype)).flatten()])
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * module.post_attention_layernorm.weight
    rope_weights = None
    if hasattr(attn, "q_norm"):
        norms = torch.cat([attn.q_norm.weight.expand(heads, head_dim), attn.k_norm.weight.expand(kv_heads, head_dim)])
        rope_weights = torch.stack([norms, norms[:, source]])
    return _FusedLayer(qkv, bias, attn.o_proj.weight.t().contiguous(), gate_up.t().contiguous(),
                       mlp.down_proj.weight.t().contiguous(), rope_weights)


def _inverse_rms(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """`1 / sqrt(mean(x**2) + eps)` over the last dimension, `(..., 1)` in `x`'s dtype: a vector norm and two
    small operations (torch's RMS norm is about seven operations on a CPU); `eps` a float32 0-dim tensor.
    Computed in float32, as transformers' norms are: in float16 a mean square overflows from an RMS of 256 on."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    scale = torch.rsqrt(torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1]))
    return scale if x.dtype == torch.float32 else scale.to(x.dtype)  # even a no-op `to` costs 2.4 us


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of `x` over its last dimension, scaled by `weight` `(width,)`, or `(..., width)` where rows of
    `x` have weights of their own (stacked q and k heads)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: bit-identical to the steps below in float32 (checked on every shape the
        # lean forward uses), one operation instead of seven.
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate-half over the last dimension: `(x1, x2) -> (-x2, x1)`."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class LeanDecoder:
    """The decoder stack of a Llama-family causal LM as a plain loop over its weight tensors.

    Args:
        model: a `*ForCausalLM` whose `model_type` is llama, mistral, qwen2 or qwen3 (see `supports`).
        packed_from: the products of a pass of at least this many rows (tokens of all rows together) run
            on oneDNN-prepacked matrices, smaller ones on plain `(in, out)` matrices (see `stacked`): 1
            prepacks every product, 2 all but one-token steps, None none. CPU only (ignored where
            `can_prepack` is false), and only for frozen models such as the target
            (models.inference.target_runner chooses it). The lm_head is prepacked from two rows on whatever
            `packed_from` says where the device allows: it is the one large matrix of a small drafter,
            read at 17 rows and more per pass (the demo drafter's 49216 x 192 head: 13.0 -> 7.6 ms on one
            AVX2 core), while the drafter's small layer products gain nothing from packing.
        copies: run the products on derived matrices (`stacked`); default: on a CPU only. A GPU's matrix
            library reads the weights in place at any shape, and stacked copies of a large target's q/k/v
            and gate/up would add over half of its weights to device memory; there the products read the
            model's own weights (no copy; weight changes are seen).
        fused: run the layers in the fused form (`_fused_layer`; docs/speed.md, The drafter's fused form):
            norm weights folded into the products, RoPE's rotated halves made by the q/k/v product, RMS
            norms as vector norms, residual additions inside the products (`addmm`). About half the
            operations of a layer, on derived copies of its weights (`packed_from` then applies to the
            lm_head only); so only where the decoder keeps copies (`copies`): without them (a GPU) the
            layers read the model's own weights in transformers' order, and device memory holds one
            drafter (a fused copy of an 8B drafter's layers, 15 GB in bfloat16, would not fit beside a 32B
            target on an 80 GB card). The same function to float rounding, in another order of
            operations: for drafters, never for a target whose outputs are checked against ar.

    The matrices are derived from the model's weights when the decoder is built (`stacked`, `_fused_layers`;
    cached per module that holds the weights): weights changed afterwards are not seen; build a new LeanDecoder.
    """

    def __init__(self, model: torch.nn.Module, packed_from: int | None = None, copies: bool | None = None,
                 fused: bool = False):
        if not self.supports(model):
            raise ValueError(f"{type(model).__name__} is not supported by the lean forward")
        self.model = model
        config = model.config
        self.eps = config.rms_norm_eps
        self.num_layers = len(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.group = self.num_heads // self.num_kv_heads
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.rotary = model.model.rotary_emb
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.copies = self.device.type == "cpu" if copies is None else copies
        can_pack = self.copies and can_prepack(self.device, self.dtype)
        self.packed_from = packed_from if can_pack else None
        self.fused = fused and self.copies
        self.layers = self._fused_layers(model) if self.fused else self._layers(model)
        self._eps = torch.tensor(self.eps, dtype=torch.float32, device=self.device)  # as `_inverse_rms` takes it
        # A drafter computes its head on the rows it may propose alone: its draft vocabulary, or the ids below
        # draft_vocab_size (models.draft_vocab.head_selection); `head_ids` maps columns to ids (None: column = id).
        self.head_rows = head_selection(model)
        self.head_ids = self.head_rows if isinstance(self.head_rows, torch.Tensor) else None
        head = model.lm_head.weight
        self.head = _Matrix(None, stacked(model.lm_head, "head", [(head,)], packed=True, rows=self.head_rows)[0]
                            if can_pack else None)
        self.head_packed_from = (1 if self.packed_from == 1 else 2) if can_pack else None

    def _layers(self, model: torch.nn.Module) -> list[_Layer]:
        """The model's layers with their products in the forms `packed_from` uses (`stacked`) and the q/k
        norms stacked per head."""
        products = [product for layer in model.model.layers for product in _products(layer)]
        if self.copies:
            groups = [weights for weights, _ in products]
            unused = [None] * len(groups)
            plain = stacked(model, "layers", groups, packed=False) if self.packed_from != 1 else unused
            packed = stacked(model, "layers", groups, packed=True) if self.packed_from is not None else unused
            matrices = iter(_Matrix(p, q, None if any(b is None for b in biases) else torch.cat(biases).detach())
                            for p, q, (_, biases) in zip(plain, packed, products))
        else:
            matrices = iter(_Matrix(None, None, parts=tuple(zip(weights, biases))) for weights, biases in products)
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        layers = []
        for module in model.model.layers:
            attn = module.self_attn
            qk_norm = None
            if hasattr(attn, "q_norm"):
                qk_norm = torch.cat([attn.q_norm.weight.detach().expand(heads, head_dim),
                                     attn.k_norm.weight.detach().expand(kv_heads, head_dim)])
            layers.append(_Layer(module.input_layernorm.weight, next(matrices), qk_norm, next(matrices),
                                 module.post_attention_layernorm.weight, next(matrices), next(matrices)))
        return layers

    def _fused_layers(self, model: torch.nn.Module) -> list[_FusedLayer]:
        """The model's layers in the fused form, each derived once per layer module while its weights are
        unchanged: models sharing a layer (a view without some layers, models.surgery.without_layers) share
        its fused form."""
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        return [_derived(module, ("fused", *shape), [w.detach() for w in module.parameters()],  # every tensor
                         lambda module=module: _fused_layer(module, *shape))                # folded in: the key
                for module in model.model.layers]

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """True when `model` is a Llama-family causal LM with plain linear layers (no adapters, no window)."""
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if config is None or getattr(config, "model_type", None) not in _ARCHITECTURES or inner is None:
            return False
        windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        if windowed or getattr(config, "hidden_act", "silu") != "silu" or getattr(model, "peft_config", None):
            return False
        for layer in getattr(inner, "layers", []):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                if type(getattr(layer.self_attn, name, None)) is not torch.nn.Linear:
                    return False
            for name in ("gate_proj", "up_proj", "down_proj"):
                if type(getattr(layer.mlp, name, None)) is not torch.nn.Linear:
                    return False
        return hasattr(inner, "rotary_emb") and hasattr(inner, "norm")

    def new_cache(self, rows: int, capacity: int = 256) -> StaticKV:
        """An empty cache for `rows` sequences (grows on demand)."""
        return StaticKV(self.num_layers, rows, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for `hidden` `(..., hidden_size)` -> `(..., R)` over its head's rows (`head_rows`):
        every row, a drafter's proposable prefix (column r is token r), or its draft vocabulary (column r is
        token `head_ids[r]`)."""
        rows = hidden.numel() // hidden.shape[-1]
        if self.head.packed is not None and rows >= self.head_packed_from:
            return self.head(hidden.contiguous(), self.head_packed_from)
        if not self.copies:
            return head_product(self.model, hidden, self.head_rows)
        if self.head.plain is None:  # made on first use: a target's one-token steps, or no prepacking here
            plain = stacked(self.model.lm_head, "head", [(self.model.lm_head.weight,)], packed=False,
                            rows=self.head_rows)[0]
            self.head = self.head._replace(plain=plain)
        return self.head(hidden, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: StaticKV, lengths: list[int] | None = None,
                packed_index: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: LongTensor `(batch, Q)`.
            positions: LongTensor `(batch, Q)`, RoPE positions.
            mask: additive float mask `(batch, 1, Q, cache.length + Q)` (0 visible, -inf hidden), or None
                for plain causal attention over the whole cache.
            cache: appended to in place (Q new key slots per row).
            lengths: real (left-aligned) tokens per row when rows are padded to Q; the products then run
                on the real tokens only (a batch of rows of unequal length wastes no arithmetic on its
                padding), and the padded positions' outputs are zeros. None: every position is real.
            packed_index: `packed_index(lengths, Q)` already on the device (the draft engine sends it with
                the pass's other inputs in one copy); None builds and copies it here.

        Returns:
            Tensor `(batch, Q, hidden_size)`.
        """
        batch, q_len = input_ids.shape
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden, positions)
        ragged = _Ragged.of(lengths, batch, q_len, hidden.device, packed_index)
        hidden, cos, sin = ragged.pack(hidden), ragged.pack(cos)[..., None, :], ragged.pack(sin)[..., None, :]
        start = cache.length
        cache.reserve(q_len)
        causal = mask is None and q_len > 1
        if causal and start > 0:
            mask = _causal_mask(q_len, start, hidden.dtype, hidden.device)
            causal = False
        # Grouped-query heads folded onto their key/value head (see `_attend`) see the mask once per head.
        folded = self.group if self.group > 1 and not causal else 1
        attend_mask = mask.repeat(1, 1, folded, 1) if folded > 1 and mask is not None else mask
        attend = (ragged, attend_mask, causal, folded, cache)
        if self.fused:
            hidden = self._fused_stack(hidden, cos, sin, attend)
        else:
            packed_from = self.packed_from
            for index, w in enumerate(self.layers):
                attn = self._attention(index, w, _rms_norm(hidden, w.input_norm, self.eps), cos, sin, attend)
                hidden = hidden + w.o(attn, packed_from)
                x = _rms_norm(hidden, w.post_norm, self.eps)
                gate, up = w.gate_up(x, packed_from).chunk(2, dim=-1)  # SwiGLU
                hidden = hidden + w.down(F.silu(gate) * up, packed_from)
        cache.advance(q_len)
        return ragged.unpack(_rms_norm(hidden, self.final_norm, self.eps))

    def _fused_stack(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: tuple) -> torch.Tensor:
        """The layers in the fused form (`_fused_layer`) for tokens `hidden` `(*tokens, hidden_size)`, RoPE
        tables `cos`/`sin` `(*tokens, 1, head_dim)`; `attend` as `_attend_cached` takes it."""
        tokens, width = hidden.shape[:-1], hidden.shape[-1]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_width, qkv_width = (heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim
        rotate_in_product = tokens.numel() <= ROTATION_IN_PRODUCT_TOKENS
        # (*tokens, 2, 1, head_dim), scaled per layer by the q/k norm weights where the model has them (Qwen3)
        per_head_norms = bool(self.layers) and self.layers[0].rope_weights is not None
        cos_sin = torch.stack([cos, sin], dim=-3) if per_head_norms else None
        hidden = hidden.reshape(-1, width)
        for index, w in enumerate(self.layers):
            x = hidden * _inverse_rms(hidden, self._eps)
            matrix, bias = w.qkv, w.qkv_bias
            if not rotate_in_product:
                matrix, bias = matrix[:, :qkv_width], None if bias is None else bias[:qkv_width]
            qkv = torch.mm(x, matrix) if bias is None else torch.addmm(bias, x, matrix)
            qk = qkv[:, :qk_width].view(*tokens, heads + kv_heads, head_dim)
            if rotate_in_product:
                rotated = qkv[:, qkv_width:].view(*tokens, heads + kv_heads, head_dim)
            else:
                rotated = _rotate_half(qk)
            if w.rope_weights is None:
                qk = torch.addcmul(qk * cos, rotated, sin)
            else:  # RMS norm per head: its weight rides with the RoPE tables, its scale applies after
                cos_w, sin_w = (cos_sin * w.rope_weights).unbind(-3)
                qk = torch.addcmul(qk * cos_w, rotated, sin_w).mul_(_inverse_rms(qk, self._eps))
            q, k = qk.split([heads, kv_heads], dim=-2)
            v = qkv[:, qk_width:qkv_width].view(*tokens, kv_heads, head_dim)
            attn = self._attend_cached(index, q, k, v, *attend).reshape(-1, heads * head_dim)
            hidden = torch.addmm(hidden, attn, w.o)
            x = hidden * _inverse_rms(hidden, self._eps)
            gate, up = torch.mm(x, w.gate_up).chunk(2, dim=-1)  # SwiGLU
            hidden = torch.addmm(hidden, F.silu(gate) * up, w.down)
        return hidden.view(*tokens, width)

    def _attention(self, index: int, w: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend: tuple) -> torch.Tensor:
        """Self-attention of layer `index` for tokens `x` `(*tokens, hidden_size)` (packed or padded as
        `attend`'s ragged says); returns `(*tokens, heads * head_dim)`, before the output projection."""
        tokens = x.shape[:-1]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = w.qkv(x, self.packed_from).split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
        qk = qk.reshape(*tokens, heads + kv_heads, head_dim)
        # q and k normalised (each head by its own weights) and rotated together: one operation each
        # instead of one per tensor
        if w.qk_norm is not None:
            qk = _rms_norm(qk, w.qk_norm, self.eps)
        q, k = _rotate(qk, cos, sin).split([heads, kv_heads], dim=-2)
        v = v.reshape(*tokens, kv_heads, head_dim)
        return self._attend_cached(index, q, k, v, *attend)

    def _attend_cached(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ragged: "_Ragged",
                       mask: torch.Tensor | None, causal: bool, folded: int, cache: StaticKV) -> torch.Tensor:
        """Attention of layer `index`: queries `q` `(*tokens, heads, head_dim)` over the cache after this
        pass's keys and values `k`/`v` `(*tokens, kv_heads, head_dim)` are written to it; returns `(*tokens,
        heads * head_dim)`. `mask` is the pass's mask repeated `folded` times along the query dimension
        (see `_attend`)."""
        # Attention needs the rows' (batch, heads, Q, head_dim) layout; the cache stores every slot.
        q, k, v = (ragged.unpack(t).transpose(1, 2) for t in (q, k, v))
        keys, values = cache.write(index, k, v)
        return ragged.pack(self._attend(q, keys, values, mask, causal, folded).transpose(1, 2)).flatten(-2)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, folded: int) -> torch.Tensor:
        """Attention of queries `q` `(batch, heads, Q, head_dim)` over the cached `keys`/`values`
        `(batch, kv_heads, length, head_dim)` -> `(batch, heads, Q, head_dim)`.

        With `folded` > 1 (grouped-query attention, `folded` = heads per key/value head) the queries of the
        heads that share a key/value head run as one head of `folded * Q` queries, under the mask repeated
        to match: one attention problem per key/value head instead of one per query head, the same
        arithmetic (measured at 19 queries over 320 keys, 3 heads on 1: 54 against 76 us per call).
        """
        if folded == 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
        batch, _, q_len, head_dim = q.shape
        grouped = q.reshape(batch, self.num_kv_heads, folded * q_len, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, q_len, head_dim)


class _Ragged:
    """Moves per-token tensors between the padded `(batch, Q, ...)` layout and a packed `(tokens, ...)`
    one holding only each row's first `lengths[r]` positions. With no padding to skip, both are identity
    (the packed layout is the padded one)."""

    def __init__(self, index: torch.Tensor | None, batch: int, q_len: int):
        self.index, self.batch, self.q_len = index, batch, q_len

    @classmethod
    def of(cls, lengths: list[int] | None, batch: int, q_len: int, device,
           index: torch.Tensor | None = None) -> "_Ragged":
        if lengths is None or sum(lengths) == batch * q_len:
            return cls(None, batch, q_len)
        if index is None:
            index = upload(torch.cat([torch.arange(r * q_len, r * q_len + n) for r, n in enumerate(lengths)]), device)
        return cls(index, batch, q_len)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """`(batch, Q, ...)` -> `(tokens, ...)`."""
        if self.index is None:
            return padded
        return padded.reshape(self.batch * self.q_len, *padded.shape[2:])[self.index]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`(tokens, ...)` -> `(batch, Q, ...)`, zeros at the padding."""
        if self.index is None:
            return packed
        padded = packed.new_zeros(self.batch * self.q_len, *packed.shape[1:])
        padded[self.index] = packed
        return padded.view(self.batch, self.q_len, *packed.shape[1:])


def packed_index(lengths: list[int] | None, q_len: int) -> list[int]:
    """The flat `(batch * Q)` positions of each row's first `lengths[r]` tokens, the padded layout's real
    tokens in order; [] when there is no padding to skip (every row holds Q tokens, or lengths is None)."""
    if lengths is None or sum(lengths) == len(lengths) * q_len:
        return []
    return [r * q_len + j for r, n in enumerate(lengths) for j in range(n)]


def _causal_mask(q_len: int, cached: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask `(1, 1, Q, cached + Q)`: every cached key visible, causal among the new ones."""
    visible = torch.ones(q_len, cached + q_len, dtype=torch.bool, device=device).tril(cached)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))[None, None]
