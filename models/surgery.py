"""Layer surgery: remove (or split) decoder layers and keep config, module indices and provenance in sync.

Three things must agree after a removal (docs/design.md, Layer surgery): `num_hidden_layers`, every per-layer list
in the config (`layer_types`, ...), and the `layer_idx` of every attention module, which selects the
layer's slot in the KV cache. A stale `layer_idx` silently shares a cache slot between layers.

`remove_layers` returns a new drafter (a copy: export, a pruning step, a heal that trains it);
`without_layers` lends a view of the drafter without some layers that shares every tensor (a scoring
round's ablations: one drafter's memory however many layers it scores).
"""

import contextlib
import copy

import torch

from .drafter_config import original_layers, validate_config
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
    keep = _kept(model.config, indices)
    original = original_layers(model.config)
    return _rebuilt(model, [(i, 1.0) for i in keep], [original[i] for i in keep])


@contextlib.contextmanager
def without_layers(model: torch.nn.Module, indices):
    """Within the block, a view of `model` without the decoder layers at `indices` (as `remove_layers`
    numbers them) that shares every tensor and submodule of `model`: no weight is copied.

    The view is a distinct model object (its own config, with the per-layer lists, `num_hidden_layers`
    and `original_layer_indices` of the layers it keeps, and its own layer list), so caches keyed by the
    model (a weights digest, derived forms) never mix it with `model`; what is derived from one kept
    layer's weights is shared with `model` (models.lean caches it per layer). It computes what
    `remove_layers(model, indices)` computes, bit for bit. For the duration the kept layers' `layer_idx`
    are their positions in the view, restored on leaving: run the view, not `model`, inside the block
    (a transformers forward of `model` there would read stale cache slots; its lean forward would not).
    """
    keep = _kept(model.config, indices)
    original = original_layers(model.config)
    config = copy.deepcopy(model.config)
    _renumbered_config(model.config, config, keep, [original[i] for i in keep])
    layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    view = _shallow(model, config, model=_shallow(model.model, config, layers=layers))
    saved = [(module, module.layer_idx) for layer in layers for module in layer.modules()
             if hasattr(module, "layer_idx")]
    try:
        _renumber(layers)
        yield view
    finally:
        for module, index in saved:
            module.layer_idx = index


def _shallow(module: torch.nn.Module, config, **children: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing `module`'s parameters, buffers and submodules but its own tables of
    them (so `children`, set on it, replace submodules of the new object only) and `config`."""
    view = copy.copy(module)  # shares __dict__'s values: the tables are replaced before anything is set
    for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        view.__dict__[table] = copy.copy(module.__dict__[table])
    view.config = config
    for name, child in children.items():
        setattr(view, name, child)
    return view


def _kept(config, indices) -> list[int]:
    """The current indices of the layers left after removing `indices`, checked (ConfigError)."""
    n = config.num_hidden_layers
    remove = sorted(set(int(i) for i in indices))
    bad = [i for i in remove if not 0 <= i < n]
    if bad:
        raise ConfigError(f"layer index {bad[0]} is out of range; this drafter has layers 0..{n - 1}")
    _check_one_remains(n, len(remove))
    return [i for i in range(n) if i not in remove]


def current_indices(config, original) -> list[int]:
    """The current (0-based) indices of the layers that had indices `original` in the unpruned drafter, in
    the order given, for the drafter `config` describes (a transformers config or config.json as a dict, so
    that a command checks them before the weights load). A layer it no longer holds, or all of them, is a
    ConfigError."""
    kept = original_layers(config)
    missing = [i for i in original if i not in kept]
    if missing:
        raise ConfigError(f"original layer {missing[0]} is not in this drafter (already removed or out of range); "
                          f"choose among the original layers it holds: {kept}")
    _check_one_remains(len(kept), len(set(original)))
    return [kept.index(i) for i in original]


def _check_one_remains(layers: int, removed: int) -> None:
    if removed >= layers:
        raise ConfigError(f"cannot remove all {layers} layers; at least one layer must remain")


def split_layers(model: torch.nn.Module, replace, sources) -> torch.nn.Module:
    """Return a copy of `model` without the layers at `replace`, each layer at `sources` followed by a copy
    of itself; a source and its copy each keep half of the source's output projections (o_proj, down_proj).

    Their two residual updates then start near the source's one (net2net-style deepening, exact to first
    order in the update), so the model's function barely moves while every layer starts trained: the way
    to give layers that never learned (identities at initialisation, see prune/training/transplant.py) a
    trained start. With as many sources as replaced layers the depth is unchanged. The copy is a new
    drafter, not a pruned one: `original_layer_indices` restarts at 0..n-1.
    """
    n = model.config.num_hidden_layers
    replace, sources = sorted(set(int(i) for i in replace)), sorted(set(int(i) for i in sources))
    bad = [i for i in replace + sources if not 0 <= i < n]
    if bad or set(replace) & set(sources):
        raise ConfigError(f"layers to split ({sources}) and to replace ({replace}) must be distinct indices in 0..{n - 1}")
    order = []
    for i in range(n):
        if i not in replace:
            order += [(i, 0.5), (i, 0.5)] if i in sources else [(i, 1.0)]
    return _rebuilt(model, order, list(range(len(order))))


def _rebuilt(model: torch.nn.Module, order: list[tuple[int, float]], provenance: list[int]) -> torch.nn.Module:
    """A copy of `model` whose layers are `order`'s (source index, output scale) in turn (a source listed
    twice is copied), with config lists, `layer_idx` and `original_layer_indices` (`provenance`) in sync."""
    new_model = copy.deepcopy(model)
    new_config = new_model.config  # deepcopy keeps every submodule's reference pointing at this object
    _renumbered_config(model.config, new_config, [i for i, _ in order], provenance)

    layers, used, rebuilt = new_model.model.layers, set(), []
    for i, _ in order:  # every copy is taken before any layer is scaled
        rebuilt.append(copy.deepcopy(layers[i]) if i in used else layers[i])
        used.add(i)
    with torch.no_grad():
        for layer, (_, scale) in zip(rebuilt, order):
            if scale != 1.0:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    new_model.model.layers = torch.nn.ModuleList(rebuilt)
    _renumber(new_model.model.layers)
    return new_model


def _renumbered_config(config, new_config, sources: list[int], provenance: list[int]) -> None:
    """Set on `new_config` (a copy of `config`) the per-layer lists of the layers `sources` of `config` in
    turn, their count and their `original_layer_indices` (`provenance`); validated where it is a drafter's."""
    for key in per_layer_config_keys(config):
        values = getattr(config, key)
        setattr(new_config, key, type(values)(values[i] for i in sources))
    setattr(new_config, PROVENANCE_KEY, provenance)
    new_config.num_hidden_layers = len(sources)
    if hasattr(new_config, "block_size"):
        validate_config(new_config)


def _renumber(layers: torch.nn.ModuleList) -> None:
    """Set the `layer_idx` of every submodule of each layer to the layer's position in `layers`."""
    for new_idx, layer in enumerate(layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
