"""A lean forward pass for Llama-family decoders, run directly on a transformers model's weights.

transformers' modules pay a fixed price per layer (kwargs plumbing, mask preparation, cache objects that
concatenate on every update) that dominates small models on a CPU: on 2 cores the demo drafter's 36
layers spent about half of each pass outside matrix products. `LeanDecoder` reads the same weight
tensors (no copy, so weight updates, merges and removed layers are seen as long as the module objects
stay) and runs the layers as a plain loop over a preallocated `StaticKV` cache.

Supported: Llama, Mistral (no sliding window), Qwen2 and Qwen3 (q/k norms) with plain `nn.Linear`
projections and the default or scaled RoPE of the model's own rotary module. `LeanDecoder.supports`
says whether a model qualifies; callers fall back to the transformers forward otherwise (adapters
attached, other architectures). Numerics follow transformers' order of operations (norms in float32,
RoPE after the q/k norms); results match the transformers forward to float rounding, not bit for bit.
"""

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cache import StaticKV
from .transfer import upload

_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# model -> {kind: (key, derived weights)} (prepacked, fused), kept between decoders; outside the model so that copies of it (layer
# surgery deep-copies) neither carry nor share the packs, and dropped with the model.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    if not packed:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


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


def prepacked(model: torch.nn.Module, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """oneDNN-prepacked copies of `weights`, made once per model and reused while the weights are unchanged.

    A frozen model's matrices (the target's) are read many times a second at 1-16 rows, where a plain
    GEMM re-packs its operand on every call: measured on 2 AVX2 cores, prepacked products of 1, 4 and 16
    rows take 0.6x, 0.45x and 0.55x the time of F.linear. The copies double the weights' memory and are
    rebuilt when any weight is replaced or modified in place: keyed by data pointer, version counter and a
    sample of its values, because peft merges adapters through `.data`, which moves neither of the first
    two (a merge changes nearly every value, so the sample sees it).
    """
    return _derived(model, "packed", weights, lambda: [torch.ops.mkldnn._reorder_linear_weight(w, None)
                                                        for w in weights])


def fused(model: torch.nn.Module, groups: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """One matrix per group of `groups`, its members stacked along the output dimension, made once per
    model and reused like `prepacked`: q, k and v (and gate and up) read the same input, and one product
    of the stacked matrix costs less than three (two) small ones where each product's fixed cost is most of
    it (the demo drafter's 192-wide layers on a CPU). None where a group holds None (no biases)."""
    flat = [w for group in groups for w in group if w is not None]

    def build():
        return [None if any(w is None for w in group) else torch.cat(group) for group in groups]

    return _derived(model, "fused", flat, build)


def _derived(model: torch.nn.Module, kind: str, weights: list[torch.Tensor], build) -> list:
    """`build()` (tensors derived from `weights`), cached per (model, kind) while `weights` are unchanged."""
    key = tuple((w.data_ptr(), -1 if w.is_inference() else w._version, _sample_sum(w)) for w in weights)
    cached = _PACKED.setdefault(model, {}).get(kind)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.inference_mode():
        derived = build()
    _PACKED[model][kind] = (key, derived)
    return derived


def _sample_sum(weight: torch.Tensor) -> float:
    """The sum of about 64 evenly spaced values of `weight` (a cheap witness of in-place changes)."""
    flat = weight.detach().reshape(-1)
    return float(flat[:: max(1, flat.numel() // 64)].sum())


class _Layer(NamedTuple):
    """One decoder layer's tensors (biases and q/k norms None where the architecture has none)."""

    input_norm: torch.Tensor
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    # Stacked copies (see `fused`): q, k, v rows then gate, up rows; None when the layer runs them apart.
    w_qkv: torch.Tensor | None = None
    b_qkv: torch.Tensor | None = None
    w_gate_up: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> "_Layer":
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            layer.input_layernorm.weight,
            attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
            attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight,
            attn.q_norm.weight if hasattr(attn, "q_norm") else None,
            attn.k_norm.weight if hasattr(attn, "k_norm") else None,
            layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
        )


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the _Layer fields that prepacking replaces


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: bit-identical to the steps below in float32 (checked on every shape the
        # lean forward uses), one operation instead of seven.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanDecoder:
    """The decoder stack of a Llama-family causal LM as a plain loop over its weight tensors.

    Args:
        model: a `*ForCausalLM` whose `model_type` is llama, mistral, qwen2 or qwen3 (see `supports`).
        prepack: run the products on oneDNN-prepacked copies of the weights (`prepacked`; CPU only, and
            only for frozen models such as the target). The lm_head is prepacked either way where the
            device allows: it is the one large matrix of a small drafter, read at a few rows per pass
            (17 rows of the demo drafter's 49216 x 192 head: 13.0 -> 7.6 ms on one AVX2 core), while
            its small layer products gain nothing from packing.
    """

    def __init__(self, model: torch.nn.Module, prepack: bool = False):
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
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.rotary = model.model.rotary_emb
        self.layers = [_Layer.of(layer) for layer in model.model.layers]
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.head_packed = can_prepack(self.device, self.dtype)
        self.packed = prepack and self.head_packed
        self.head_weight = model.lm_head.weight
        flat = [getattr(layer, name) for layer in self.layers for name in MATRICES] if self.packed else []
        if not self.packed:
            self.layers = self._fuse(model, self.layers)
        if self.head_packed:
            packed = iter(prepacked(model, flat + [self.head_weight]))
            self.layers = [layer._replace(**{name: next(packed) for name in MATRICES}) for layer in self.layers
                           ] if self.packed else self.layers
            self.head_weight = next(packed)

    @staticmethod
    def _fuse(model: torch.nn.Module, layers: list[_Layer]) -> list[_Layer]:
        """`layers` with stacked q/k/v and gate/up matrices (`fused`). Like the lm_head pack, they are made
        when the decoder is built: weights changed afterwards are not seen (build a new LeanDecoder)."""
        groups = [group for w in layers for group in ((w.wq, w.wk, w.wv), (w.bq, w.bk, w.bv), (w.w_gate, w.w_up))]
        stacked = iter(fused(model, groups))
        return [w._replace(w_qkv=next(stacked), b_qkv=next(stacked), w_gate_up=next(stacked)) for w in layers]

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
        """The model's logits for `hidden` `(..., hidden_size)`."""
        if self.head_packed:
            return _linear(hidden.contiguous(), self.head_weight, None, True)
        return self.model.lm_head(hidden)

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
        for index, w in enumerate(self.layers):
            attn = self._attention(index, w, _rms_norm(hidden, w.input_norm, self.eps), cos, sin, ragged,
                                   mask, causal, cache)
            hidden = hidden + _linear(attn, w.wo, None, self.packed)
            hidden = hidden + self._mlp(w, _rms_norm(hidden, w.post_norm, self.eps))
        cache.advance(q_len)
        return ragged.unpack(_rms_norm(hidden, self.final_norm, self.eps))

    def _mlp(self, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP of tokens `x` `(*tokens, hidden_size)` -> `(*tokens, hidden_size)`."""
        if w.w_gate_up is not None:
            gate, up = _linear(x, w.w_gate_up, None, False).chunk(2, dim=-1)
        else:
            gate, up = _linear(x, w.w_gate, None, self.packed), _linear(x, w.w_up, None, self.packed)
        return _linear(F.silu(gate) * up, w.w_down, None, self.packed)

    def _attention(self, index: int, w: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ragged: "_Ragged", mask: torch.Tensor | None, causal: bool, cache: StaticKV) -> torch.Tensor:
        """Self-attention of layer `index` for tokens `x` `(*tokens, hidden_size)` (packed or padded as
        `ragged` says); returns `(*tokens, heads * head_dim)`, before the output projection."""
        tokens = x.shape[:-1]
        if w.w_qkv is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = _linear(x, w.w_qkv, w.b_qkv, False).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = (_linear(x, weight, bias, self.packed) for weight, bias in ((w.wq, w.bq), (w.wk, w.bk),
                                                                                (w.wv, w.bv)))
        q = q.reshape(*tokens, self.num_heads, self.head_dim)
        k = k.reshape(*tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(*tokens, self.num_kv_heads, self.head_dim)
        if w.q_norm is not None:
            q, k = _rms_norm(q, w.q_norm, self.eps), _rms_norm(k, w.k_norm, self.eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Attention needs the rows' (batch, heads, Q, head_dim) layout; the cache stores every slot.
        q, k, v = (ragged.unpack(t).transpose(1, 2) for t in (q, k, v))
        keys, values = cache.write(index, k, v)
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return ragged.pack(attn.transpose(1, 2)).flatten(-2)


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
