"""Start a narrow drafter from its wide target: one rotation of the residual stream, one KV group, top neurons.

A Llama/Qwen-style target of width D with H query heads in G key/value groups is sliced into a Qwen3
drafter of width d < D with H/G query heads and one key/value head (one group), and a narrower MLP:

- Residual stream: one orthonormal basis Q `(D, d)`, the top-d principal directions of the RMS-normalised
  hidden states entering every layer on calibration text (SliceGPT-style, but one Q shared by all layers
  because the drafter has a plain residual stream). The drafter's stream is x = Q^T h.
- RMSNorm gains are folded into the matrices that read the norm (W diag(g) Q); the drafter's norm weight
  becomes the scalar sqrt(D * f / d) that restores the target's scale (f: fraction of ||h||^2 that Q keeps,
  measured per norm on the calibration text).
- Attention: per layer, the key/value group whose output (through o_proj) is largest on the calibration
  text; its query heads, key and value head; o_proj maps back through Q^T. Qwen3 normalises q and k per
  head, which a Llama target does not; the q/k norm weights are then set to the target's measured RMS of q
  and k so that attention logits start near the target's (a Qwen3 target's own q/k norms are copied).
- MLP: the `intermediate` neurons with the largest mean |activation| times ||down_proj column||.
- Layers past the target's depth start as identities (o_proj and down_proj zero) and learn in training.
- Embedding (tied): E Q; the mask token and padding rows start at the mean embedding.

The result is not a good language model by itself (a third of the width is kept), but it starts training
from the target's features instead of noise; `prune train-drafter --init slice` (the default) uses it.
`--init pca` takes only the embedding from the target, projected onto its own top principal components
(`pca_embedding`); both fix the signs of principal directions the same way (`principal_directions`).
"""

import math

import torch

from models.drafter import create_drafter
from models.errors import ConfigError


class _Recorder:
    """Forward hooks that accumulate the calibration statistics of one target, layer by layer."""

    def __init__(self, target: torch.nn.Module, basis: torch.Tensor | None = None):
        layers = target.model.layers
        config = target.config
        self.heads, self.groups = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.basis = basis
        n, width = len(layers), config.hidden_size
        self.cov = torch.zeros(width, width, dtype=torch.float64)
        self.tokens = 0
        self.kept = {}  # norm name -> [sum of sqrt(f), count]
        self.group_out = torch.zeros(n, self.groups, dtype=torch.float64)
        self.neuron = torch.zeros(n, config.intermediate_size, dtype=torch.float64)
        self.q_rms = torch.zeros(n, self.heads, dtype=torch.float64)
        self.k_rms = torch.zeros(n, self.groups, dtype=torch.float64)
        self.handles = []
        for i, layer in enumerate(layers):
            self._watch_norm(layer.input_layernorm, f"{i}.input")
            self._watch_norm(layer.post_attention_layernorm, f"{i}.post")
            if basis is not None:  # the second pass only measures what the basis keeps at each norm
                continue
            attn = layer.self_attn
            self.handles.append(attn.o_proj.register_forward_pre_hook(self._group_hook(i, attn.o_proj.weight)))
            self.handles.append(attn.q_proj.register_forward_hook(self._rms_hook(self.q_rms, i, self.heads)))
            self.handles.append(attn.k_proj.register_forward_hook(self._rms_hook(self.k_rms, i, self.groups)))
            self.handles.append(layer.mlp.down_proj.register_forward_pre_hook(self._neuron_hook(i, layer.mlp.down_proj.weight)))
        self._watch_norm(target.model.norm, "final")

    def _watch_norm(self, norm, name):
        def hook(module, args):
            h = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            if self.basis is None:
                x = h / h.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
                self.cov += x.T @ x
                self.tokens += x.shape[0]
            else:
                f = (h @ self.basis).pow(2).sum(-1) / h.pow(2).sum(-1).clamp_min(1e-12)
                entry = self.kept.setdefault(name, [0.0, 0])
                entry[0] += float(f.sqrt().sum())
                entry[1] += f.numel()

        self.handles.append(norm.register_forward_pre_hook(hook))

    def _group_hook(self, i, weight):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            per_group = self.heads // self.groups * self.head_dim
            for g in range(self.groups):
                cols = slice(g * per_group, (g + 1) * per_group)
                self.group_out[i, g] += (x[:, cols] @ weight[:, cols].double().T).norm(dim=-1).sum()

        return hook

    def _neuron_hook(self, i, weight):
        column_norm = weight.detach().double().norm(dim=0)

        def hook(module, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            self.neuron[i] += a.abs().sum(0) * column_norm

        return hook

    def _rms_hook(self, table, i, count):
        def hook(module, args, output):
            y = output.detach().reshape(-1, count, self.head_dim).double()
            table[i] += y.pow(2).mean(-1).sqrt().sum(0)

        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def _run(target, calibration: list[torch.Tensor], basis=None) -> _Recorder:
    recorder = _Recorder(target, basis)
    try:
        for ids in calibration:
            target(input_ids=ids.view(1, -1).to(target.device), use_cache=False)
    finally:
        recorder.close()
    return recorder


@torch.no_grad()
def drafter_from_target(
    target: torch.nn.Module,
    calibration: list[torch.Tensor],
    vocab_size: int,
    mask_token_id: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    block_size: int = 16,
    seed: int = 0,
) -> tuple[torch.nn.Module, dict]:
    """Slice `target` (Llama/Qwen architecture, float32) into a drafter; returns (drafter, statistics).

    Args:
        calibration: 1-D LongTensors of token ids (e.g. prompts + target responses), run one by one.
        vocab_size: the drafter's embedding rows (target vocabulary + mask id, padded).
        hidden_size: d, at most the target's width; the drafter's attention keeps one group of
            `heads / kv_heads` query heads of the target's head_dim.
    """
    tc = target.config
    width, heads, groups = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    if hidden_size > width or intermediate_size > tc.intermediate_size:
        raise ConfigError(f"cannot slice a width-{width}/MLP-{tc.intermediate_size} target into "
                          f"{hidden_size}/{intermediate_size}; choose sizes no larger than the target's")
    if not calibration:
        raise ConfigError("drafter_from_target needs calibration sequences")
    target = target.float().eval()

    first = _run(target, calibration)
    basis, kept_variance = principal_directions(first.cov / max(1, first.tokens), hidden_size)  # (D, d)
    second = _run(target, calibration, basis)
    scale = {name: math.sqrt(width / hidden_size) * s / n for name, (s, n) in second.kept.items()}
    Q = basis.float()

    source_layers = len(target.model.layers)
    n_tokens = sum(c.numel() for c in calibration)
    drafter = create_drafter(
        vocab_size=vocab_size, mask_token_id=mask_token_id, block_size=block_size,
        num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_attention_heads=heads // groups, num_key_value_heads=1, head_dim=first.head_dim,
        draft_vocab_size=min(mask_token_id, tc.vocab_size), seed=seed, tie_word_embeddings=True,
        rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=tc.max_position_embeddings,
    )
    chosen_groups = []
    for i, layer in enumerate(drafter.model.layers):
        if i >= source_layers:  # an extra layer: identity at the start
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            continue
        chosen_groups.append(_slice_layer(layer, target.model.layers[i], first, i, Q, scale, n_tokens))
    _slice_ends(drafter, target, Q, scale["final"])
    stats = {"kept_variance": round(kept_variance, 4), "kv_groups": chosen_groups,
             "norm_scales": {k: round(v, 4) for k, v in sorted(scale.items())},
             "source_layers": source_layers, "calibration_sequences": len(calibration),
             "calibration_tokens": int(n_tokens)}
    return drafter.eval(), stats


def _slice_layer(layer: torch.nn.Module, src: torch.nn.Module, stats: _Recorder, i: int, Q: torch.Tensor,
                 scale: dict[str, float], n_tokens: int) -> int:
    """Fill drafter layer `layer` from target layer `src` (number `i`); returns the key/value group kept.

    Q: float32 `(D, d)`, the residual basis; stats: the first calibration pass; scale: per-norm scalar
    gains; n_tokens: calibration tokens (stats sums per-token RMS over them). The group with the largest
    output keeps its query heads, key and value head; the MLP keeps the `intermediate` neurons with the
    largest mean |activation| x ||down_proj column||; norm gains are folded into the matrices reading them.
    """
    attn, mlp, source = layer.self_attn, layer.mlp, src.self_attn
    per_group, head_dim = stats.heads // stats.groups, stats.head_dim
    g = int(stats.group_out[i].argmax())
    q_rows = torch.arange(g * per_group * head_dim, (g + 1) * per_group * head_dim)
    kv_rows = torch.arange(g * head_dim, (g + 1) * head_dim)
    gain_in = src.input_layernorm.weight.float()  # (D,)
    attn.q_proj.weight.copy_(source.q_proj.weight[q_rows] * gain_in @ Q)
    attn.k_proj.weight.copy_(source.k_proj.weight[kv_rows] * gain_in @ Q)
    attn.v_proj.weight.copy_(source.v_proj.weight[kv_rows] * gain_in @ Q)
    attn.o_proj.weight.copy_(Q.T @ source.o_proj.weight[:, q_rows])
    if hasattr(source, "q_norm"):  # a Qwen3 source normalises q and k itself
        attn.q_norm.weight.copy_(source.q_norm.weight)
        attn.k_norm.weight.copy_(source.k_norm.weight)
    else:
        attn.q_norm.weight.fill_(float(stats.q_rms[i, g * per_group : (g + 1) * per_group].mean() / n_tokens))
        attn.k_norm.weight.fill_(float(stats.k_rms[i, g] / n_tokens))
    neurons = stats.neuron[i].topk(mlp.gate_proj.out_features).indices.sort().values
    gain_post = src.post_attention_layernorm.weight.float()  # (D,)
    mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[neurons] * gain_post @ Q)
    mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[neurons] * gain_post @ Q)
    mlp.down_proj.weight.copy_(Q.T @ src.mlp.down_proj.weight[:, neurons])
    layer.input_layernorm.weight.fill_(scale[f"{i}.input"])
    layer.post_attention_layernorm.weight.fill_(scale[f"{i}.post"])
    return g


def _slice_ends(drafter: torch.nn.Module, target: torch.nn.Module, Q: torch.Tensor, final_scale: float) -> None:
    """The final norm (the target's gain seen through Q `(D, d)`, rescaled) and the tied embedding E Q; the
    drafter's rows past the target's vocabulary (the mask id, padding) start at the mean embedding."""
    gain_final = target.model.norm.weight.float()
    drafter.model.norm.weight.copy_(final_scale * ((Q * gain_final[:, None]) * Q).sum(0))
    embed = target.get_input_embeddings().weight.float() @ Q  # (V_target, d)
    table = drafter.get_input_embeddings().weight
    rows = min(embed.shape[0], table.shape[0])
    table[:rows].copy_(embed[:rows])
    table[rows:].copy_(embed.mean(0, keepdim=True).expand(table.shape[0] - rows, -1))


def principal_directions(cov: torch.Tensor, width: int) -> tuple[torch.Tensor, float]:
    """The top-`width` eigenvectors of the symmetric `cov` `(D, D)`, leading first, and the fraction of the
    trace they keep.

    Deterministic: each direction's sign makes its largest entry positive. Returns `(D, width)` in cov's dtype.
    """
    values, vectors = torch.linalg.eigh(cov)  # ascending
    vectors = vectors[:, -width:].flip(-1)
    signs = torch.sign(vectors[vectors.abs().argmax(0), torch.arange(vectors.shape[1])])
    return vectors * signs, float(values[-width:].sum() / values.sum())


def pca_embedding(source: torch.Tensor, width: int, std: float) -> tuple[torch.Tensor, float]:
    """Project `source` `(vocab, d)` onto its top-`width` principal components; rescale to `std` (`--init pca`).

    Returns float32 `(vocab, width)` and the fraction of variance kept.
    """
    x = source.detach().float()
    x = x - x.mean(0, keepdim=True)
    directions, kept = principal_directions(x.T @ x / x.shape[0], width)
    projected = x @ directions
    return projected * (std / projected.std()), kept


def idle_layer_split(model: torch.nn.Module, count: int) -> tuple[list[int], list[int]]:
    """(the `count` layers whose output projections are smallest, `count` layers to split in their place)
    for `models.surgery.split_layers`.

    A layer that began as an identity (o_proj and down_proj zero) and barely moved in training has small
    output projections: its size is ||o_proj||_F + ||down_proj||_F (the demo drafter's layers 30-35 after
    its stage 5: 23, against 84-112 for the others). The layers to split are spread evenly over the rest, so
    depth is added everywhere rather than in one place.
    """
    layers = model.model.layers
    if not 0 < count < len(layers) / 2:
        raise ConfigError(f"--split-idle {count}: choose 1 to {(len(layers) - 1) // 2} (fewer than half the "
                          f"drafter's {len(layers)} layers)")
    size = [float(layer.self_attn.o_proj.weight.detach().norm() + layer.mlp.down_proj.weight.detach().norm())
            for layer in layers]
    idle = sorted(sorted(range(len(layers)), key=lambda i: size[i])[:count])
    rest = [i for i in range(len(layers)) if i not in idle]
    return idle, [rest[int((k + 0.5) * len(rest) / count)] for k in range(count)]
