"""Rankings: criteria that score every layer of a round at once, without the decoder (prune.criteria.Ranking).

A ranking reads the drafter on one of two inputs (Ranking.reads). The calibration prompts' target
trajectories, laid out as block-denoising inputs (`denoising_batches`: the clean stream of prompt and output,
then a block of mask slots at every anchor of the output, the sync draft's geometry, as the training loss and
expected acceptance lay them out), feed the similarity rankings: one forward pass per batch, with a hook on
every decoder layer that compares the layer's input and output hidden states there (`layer_similarity`),
gives every layer's score. Held-in distillation examples (ScoreConfig.loss_data: what the drafter was
trained on) feed the loss ranking: the drafter's own training objective without each layer in turn
(`loss_without_each_layer`). `last` and `random` read nothing.

`rank_round` is the round of a ranking criterion; `prescreen` ranks the layers of a measured round first and
leaves only the most removable to be measured (ScoreConfig.prescreen). Their layer scores carry no
decoder measurements (tau, its interval, predicted speedup: None).
"""

import functools
import math
import random
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from models.drafter_config import original_layers
from models.inference import decoder_runner
from models.surgery import without_layers

from .config import ScoreConfig
from .criteria import CRITERIA
from .scoring import LayerScore, ScoreReport
from .training.loss import Example, anchor_positions, build_batch, causal_lm, drafter_loss

BLOCKS_PER_PASS = 32  # anchors laid out per trajectory in one layout: memory stays linear in the output's length
LOSS_BLOCKS = 16  # blocks per held-in sequence (HealConfig.blocks_per_sequence)
LOSS_MAX_LENGTH = 320  # held-in sequences are cropped to this (HealConfig.max_length)
LOSS_BATCH = 8  # held-in sequences per pass


@dataclass
class RankInputs:
    """What a ranking may read.

    Attributes:
        prompts: calibration prompts (token ids); trajectories: their target trajectories (prompt + output).
        examples: held-in training `Example`s (the loss ranking), or None.
        seed: seeds the loss ranking's anchors and the random order.
        batch_size: layouts per forward pass of the similarity rankings.
    """

    prompts: list[list[int]]
    trajectories: list[list[int]] | None
    examples: list | None
    seed: int
    batch_size: int


def rank_inputs(prompts, trajectories, config: ScoreConfig, names) -> RankInputs:
    """The RankInputs of a round by `config` whose rankings are `names` (held-in examples loaded only when one
    of them reads them)."""
    reads = {CRITERIA[name].reads for name in names}
    examples = (held_in_examples(tuple(config.loss_data), config.loss_examples, config.seed)
                if "loss data" in reads else None)
    return RankInputs(prompts, trajectories, examples, config.seed, config.batch_size)


@functools.lru_cache(maxsize=2)
def held_in_examples(folders: tuple[str, ...], count: int, seed: int) -> list:
    """`count` training `Example`s drawn (seeded) from the distillation folders together: the same draw in every
    round of a run, so a loss score moves only with the drafter."""
    from .training.data import load_examples

    examples = [example for folder in folders for example in load_examples(folder, partial=True)]
    pick = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))[:count]
    return [examples[i] for i in pick.tolist()]


def denoising_batches(drafter, inputs: RankInputs) -> Iterator[tuple[object, torch.Tensor]]:
    """The calibration trajectories as the drafter's block-denoising inputs, batch by batch, on its device:
    (prune.training.loss.DiffusionBatch, LongTensor `(R,)` sorted flat query rows that are not padding: the
    clean stream, in a trajectory's first layout only, and every block's mask slots). Each trajectory is its
    prompt and output (supervised) with a block at every anchor of the output, BLOCKS_PER_PASS blocks per
    layout; `inputs.batch_size` layouts per batch."""
    if inputs.trajectories is None:
        raise ValueError("the similarity rankings read the calibration prompts' target trajectories")
    config = drafter.config
    weight = next(drafter.parameters())
    layouts = []  # (Example, anchors, the first of its trajectory's layouts)
    for prompt, trajectory in zip(inputs.prompts, inputs.trajectories):
        example = Example.from_prompt_response(trajectory[:len(prompt)], trajectory[len(prompt):])
        anchors = anchor_positions(example.loss_mask).tolist()
        layouts += [(example, anchors[i:i + BLOCKS_PER_PASS], i == 0)
                    for i in range(0, max(len(anchors), 1), BLOCKS_PER_PASS)]
    for start in range(0, len(layouts), inputs.batch_size):
        chunk = layouts[start:start + inputs.batch_size]
        batch = build_batch([e for e, _, _ in chunk], config.block_size, config.mask_token_id, 0,
                            anchors=[a for _, a, _ in chunk], mask_dtype=weight.dtype)
        width = batch.input_ids.shape[1]
        # A trajectory's clean stream counts once: its later layouts repeat it (the same states, causal).
        rows = torch.cat([r * width + torch.arange(0 if first else len(e), len(e) + len(a) * config.block_size)
                          for r, (e, a, first) in enumerate(chunk)])
        yield batch.to(weight.device), rows.to(weight.device)


@dataclass
class LayerSimilarity:
    """How much each layer changes the hidden states it is given, per layer (current indices).

    Attributes:
        token_cosine: the mean cosine between the layer's input and output over every non-padding token.
        slot_angle: the mean angular distance arccos(cosine) / pi (0: same direction, 1: opposite) over the
            supervised mask slots (the positions whose tokens the drafter predicts).
        passes: forward passes of the drafter it took (one per batch).
    """

    token_cosine: list[float]
    slot_angle: list[float]
    passes: int


@torch.no_grad()
def layer_similarity(drafter, inputs: RankInputs) -> LayerSimilarity:
    """Every layer's LayerSimilarity from one forward pass of the drafter's decoder per batch of
    `denoising_batches`: a hook on each decoder layer reads its input and output hidden states there."""
    layers = causal_lm(drafter).model.layers
    count = drafter.config.num_hidden_layers
    sums = torch.zeros(2, count, dtype=torch.float64)  # [token cosine, slot angle] sums per layer
    seen = torch.zeros(2, dtype=torch.float64)
    current = {}

    def hook(index):
        def compare(module, args, kwargs, output):
            given = args[0] if args else kwargs["hidden_states"]
            output = output[0] if isinstance(output, tuple) else output
            hidden = given.shape[-1]
            cosine = F.cosine_similarity(given.reshape(-1, hidden)[current["rows"]].double(),
                                         output.reshape(-1, hidden)[current["rows"]].double(), dim=-1)
            sums[0, index] += cosine.sum().cpu()
            slots = cosine[current["slots"]].clamp(-1.0, 1.0)
            sums[1, index] += (torch.arccos(slots) / math.pi).sum().cpu()
        return compare

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers[:count])]
    passes = 0
    try:
        for batch, rows in denoising_batches(drafter, inputs):
            # the supervised slots' places among `rows` (both sorted flat indices)
            current.update(rows=rows, slots=torch.searchsorted(rows, batch.slot_rows))
            causal_lm(drafter).model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     position_ids=batch.position_ids, use_cache=False)
            seen += torch.tensor([rows.numel(), batch.slot_rows.numel()], dtype=torch.float64)
            passes += 1
    finally:
        for handle in handles:
            handle.remove()
    means = sums / seen.clamp_min(1)[:, None]
    return LayerSimilarity(means[0].tolist(), means[1].tolist(), passes)


@torch.no_grad()
def loss_without_each_layer(drafter, inputs: RankInputs) -> list[float]:
    """Per layer, the drafter's training loss (prune.training.loss.drafter_loss: block-diffusion cross entropy on
    the target's tokens plus the AR term, its training weights) on the held-in examples without that layer,
    minus the loss with every layer: the same seeded batches (LOSS_BLOCKS anchors per sequence) for all."""
    if not inputs.examples:
        raise ValueError("the loss ranking reads held-in examples")
    config, weight = drafter.config, next(drafter.parameters())
    generator = torch.Generator().manual_seed(inputs.seed)
    batches = [build_batch(inputs.examples[i:i + LOSS_BATCH], config.block_size, config.mask_token_id, LOSS_BLOCKS,
                           generator=generator, max_length=LOSS_MAX_LENGTH, mask_dtype=weight.dtype).to(weight.device)
               for i in range(0, len(inputs.examples), LOSS_BATCH)]

    def mean_loss(model) -> float:
        runner = decoder_runner(model, fused=True)  # the lean forward (training.loss._supervised_hidden)
        return sum(float(drafter_loss(model, batch, runner=runner).total) for batch in batches) / len(batches)

    def without(layer: int) -> float:
        with without_layers(drafter, [layer]) as view:  # shares the drafter's tensors: no copy per layer
            return mean_loss(view)

    base = mean_loss(drafter)
    return [without(layer) - base for layer in range(config.num_hidden_layers)]


def seeded_order(drafter, seed: int) -> list[float]:
    """Per layer, a uniform draw keyed by `seed` and the layer's original index: the layers of any drafter pruned
    from the same one keep their relative order."""
    return [random.Random(f"random criterion {seed} {original}").random()
            for original in original_layers(drafter.config)]


def _unmeasured(layer: int, original: int, score: float, pass_ms: tuple, skipped: bool | None) -> LayerScore:
    """A layer's score from a ranking: no decoder measurement (`pass_ms`: the modelled pass times without it)."""
    return LayerScore(layer, original, None, None, None, None, None, *pass_ms, None, score, skipped=skipped)


def _pass_ms(drafter, layer_costs, layers: int) -> tuple:
    """(sync draft, packed) pass times in ms of the drafter at `layers` layers, modelled; (None, None) without
    the campaign's costs (a ranking times nothing)."""
    return tuple(c.at(layers) for c in layer_costs) if layer_costs is not None else (None, None)


def rank_round(drafter, prompts, config: ScoreConfig, trajectories=None, layer_costs=None, journal=None,
               on_layer=None) -> ScoreReport:
    """The scoring round of a ranking criterion (`config.criterion`): every layer scored at once, no decoder. The
    report has no base evaluation (`base` None)."""
    layers, original = drafter.config.num_hidden_layers, original_layers(drafter.config)
    if journal is not None and len(journal.layers) == layers:
        scores = [journal.layers[layer] for layer in range(layers)]
    else:
        values = CRITERIA[config.criterion].rank(drafter, rank_inputs(prompts, trajectories, config,
                                                                     [config.criterion]))
        without = _pass_ms(drafter, layer_costs, layers - 1)
        scores = [_unmeasured(layer, original[layer], float(values[layer]), without, None) for layer in range(layers)]
        if journal is not None:
            journal.record(None, scores)
    for score in scores:
        if on_layer is not None:
            on_layer(score.layer, score)
    settings = {"criterion": config.criterion, "prompts": len(prompts), "seed": config.seed,
                "loss_data": list(config.loss_data) or None,
                "layers": "0-based; original_layer = index in the unpruned drafter"}
    return ScoreReport(None, *_pass_ms(drafter, layer_costs, layers), None, None, None, scores, settings)


def prescreen(drafter, prompts, config: ScoreConfig, trajectories, journal, layer_costs=None) -> dict[int, LayerScore]:
    """The layers a pre-screened round leaves unmeasured ({layer: its LayerScore, `skipped`}): every layer ranked
    by `config.prescreen`, and all but the `prescreen_keep` most removable (lowest; ties by index) skipped.
    They are recorded in `journal` at once, before any evaluation, so a resumed round measures the same set
    whatever a new ranking would say; {} without a pre-screen or when it keeps every layer."""
    layers = drafter.config.num_hidden_layers
    if not config.prescreen or config.prescreen_keep >= layers:
        return {}
    recorded = {layer: score for layer, score in journal.layers.items() if score.skipped}
    if recorded:
        return recorded
    values = CRITERIA[config.prescreen].rank(drafter, rank_inputs(prompts, trajectories, config, [config.prescreen]))
    order = sorted(range(layers), key=lambda layer: (values[layer], layer))
    original, without = original_layers(drafter.config), _pass_ms(drafter, layer_costs, layers - 1)
    skipped = [_unmeasured(layer, original[layer], float(values[layer]), without, True)
               for layer in sorted(order[config.prescreen_keep:])]
    journal.add_layers(skipped)
    return {score.layer: score for score in skipped}


def skipped_note(report: dict) -> str | None:
    """One line naming the layers a pre-screen left unmeasured in a score report (its JSON form), or None."""
    skipped = [s["original_layer"] for s in report["layers"] if s.get("skipped")]
    if not skipped:
        return None
    settings = report["settings"]
    measured = len(report["layers"]) - len(skipped)
    return (f"pre-screen by {settings.get('prescreen')}: {settings.get('criterion')} measured for {measured} layers; "
            f"skipped original layers {', '.join(map(str, skipped))}")
