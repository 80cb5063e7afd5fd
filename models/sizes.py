"""The sizes of a decoder-only LM that its memory depends on, read from its config alone (no weights).

Parameters are counted exactly for the Llama family of the lean forward (models/lean.py), by the rules in
`ARCHITECTURES` (which projections carry biases, whether q/k norms exist): with L layers, H hidden, I intermediate,
q = heads x head_dim, kv = kv_heads x head_dim and V ids, the embedding V H, an untied head V H (a tied head is the
embedding's tensor), per layer the seven projections H (q + 2 kv) + q H + 3 H I and their biases, two norms 2 H
and Qwen3's q/k norms 2 head_dim, and the final norm H. Other architectures are counted on the meta device.
`Shapes.fused_layer` and `Shapes.products` are the sizes of the derived forms models/lean.py keeps (the drafter's
fused form, a target's stacked matrices); prune/memory_plan.py turns them into bytes.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Biases:
    """Which projections of an architecture carry biases: True, False, or the name of the config flag that says."""

    qkv: bool | str = False
    o: bool | str = False
    mlp: bool | str = False
    qk_norm: bool = False


# The Llama family the lean forward runs (models.lean._ARCHITECTURES), as transformers builds each.
ARCHITECTURES: dict[str, Biases] = {
    "llama": Biases(qkv="attention_bias", o="attention_bias", mlp="mlp_bias"),
    "mistral": Biases(),
    "qwen2": Biases(qkv=True),
    "qwen3": Biases(qkv="attention_bias", o="attention_bias", qk_norm=True),
}


def _flag(config, value: bool | str) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


@dataclass(frozen=True)
class Shapes:
    """The sizes of a decoder-only LM that its memory depends on (see the module docstring)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    biases: Biases = field(default_factory=Biases)
    counted: int | None = None  # parameters counted on the meta device (an architecture outside ARCHITECTURES)

    @classmethod
    def of(cls, config) -> "Shapes":
        """The shapes of a transformers config (text config of a multimodal one)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        biases = ARCHITECTURES.get(getattr(config, "model_type", None))
        resolved = Biases(_flag(config, biases.qkv), _flag(config, biases.o), _flag(config, biases.mlp),
                          biases.qk_norm) if biases else Biases()
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size,
                   intermediate=config.intermediate_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                   biases=resolved, counted=None if biases else _meta_parameters(config))

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def products(self) -> int:
        """One layer's projection weights and biases."""
        h, b = self.hidden, self.biases
        weights = h * (self.q + 2 * self.kv) + self.q * h + 3 * h * self.intermediate
        return (weights + b.qkv * (self.q + 2 * self.kv) + b.o * h
                + b.mlp * (2 * self.intermediate + h))

    @property
    def layer_parameters(self) -> int:
        return self.products + 2 * self.hidden + self.biases.qk_norm * 2 * self.head_dim

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter, a tied head counted once (it is one tensor)."""
        if self.counted is not None:
            return self.counted
        return self.embedding * (1 if self.tied else 2) + self.layers * self.layer_parameters + self.hidden

    @property
    def fused_layer(self) -> int:
        """One layer's fused form (models.lean._FusedLayer): the products, the rotated q/k rows (with their biases)
        and the q/k norm weights plain and rotated."""
        rotated = (self.q + self.kv) * (self.hidden + self.biases.qkv)
        return self.products - self.biases.o * self.hidden + rotated + self.biases.qk_norm * 2 * (self.q + self.kv)

    def kv_per_token(self, nbytes: int) -> int:
        return self.layers * 2 * self.kv * nbytes

    def pass_activations(self, tokens: int, nbytes: int) -> int:
        """The tensors of one inference pass of `tokens` tokens that are alive within a layer."""
        h, i = self.hidden, self.intermediate
        return tokens * (3 * h + 3 * i + 4 * self.q + 3 * self.kv) * nbytes


def _meta_parameters(config) -> int:
    """Parameters of a model of `config` built on the meta device (no memory), a tied head counted once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
