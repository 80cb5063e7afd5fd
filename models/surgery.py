"""Layer surgery: remove decoder layers and keep config, module indices and provenance in sync.

Three things must agree after a removal (docs/design.md, Layer surgery): `num_hidden_layers`, every per-layer list
in the config (`layer_types`, ...), and the `layer_idx` of every attention module, which selects the
layer's slot in the KV cache. A stale `layer_idx` silently shares a cache slot between layers.
"""

import copy

import torch

from .drafter_config import validate_config
from .errors import ConfigError

PROVENANCE_KEY = "original_layer_indices"


def per_layer_config_keys(config) -> list[str]:
    """Names of config attributes that hold one entry per decoder layer.

    transformers names such lists after layers (`layer_types`, `no_rope_layers`, ...). Matching on the
    name as well as the length keeps lists that merely happen to have n entries (`eos_token_id` with
    three end tokens on a three-layer model) untouched.
    """
    n = config.num_hidden_layers
    return [
        key
        for key, value in config.to_dict().items()
        if key != PROVENANCE_KEY and "layer" in key and isinstance(value, (list, tuple)) and len(value) == n
    ]


def remove_layers(model: torch.nn.Module, indices) -> torch.nn.Module:
    """Return a copy of `model` without the decoder layers at `indices` (0-based, current numbering).

    The copy's layers are renumbered 0..n-1, `num_hidden_layers` and every per-layer config list are
    updated, and `original_layer_indices` keeps the indices the surviving layers had in the unpruned
    model, so pruning a pruned model still reports original indices. The input model is not modified.
    """
    config = model.config
    n = config.num_hidden_layers
    remove = sorted(set(int(i) for i in indices))
    bad = [i for i in remove if not 0 <= i < n]
    if bad:
        raise ConfigError(f"layer index {bad[0]} is out of range; this drafter has layers 0..{n - 1}")
    if len(remove) >= n:
        raise ConfigError(f"cannot remove all {n} layers; at least one layer must remain")
    keep = [i for i in range(n) if i not in remove]

    new_model = copy.deepcopy(model)
    new_config = new_model.config  # deepcopy keeps every submodule's reference pointing at this object
    original = list(getattr(config, PROVENANCE_KEY, None) or range(n))
    for key in per_layer_config_keys(config):
        values = getattr(config, key)
        setattr(new_config, key, type(values)(values[i] for i in keep))
    setattr(new_config, PROVENANCE_KEY, [original[i] for i in keep])
    new_config.num_hidden_layers = len(keep)

    layers = new_model.model.layers
    new_model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new_idx, layer in enumerate(new_model.model.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    if hasattr(new_config, "block_size"):
        validate_config(new_config)
    return new_model
