"""The memory plan: the estimated peak memory of `prune score`, `prune run` and `prune heal --train full`, from
the drafter's and the target's configs alone (no weights read), and the memory the device has free.

Sizes, from config.json (models.sizes.Shapes): L layers, H hidden, I intermediate, q = heads x head_dim, kv =
kv_heads x head_dim, V vocabulary, B the drafter's block size, P parameters (models/sizes.py counts them); b a
dtype's bytes.

Each phase is a sum of parts at its fullest moment (`MemoryPlan.parts`), in bytes:

  runtime             the process before any weights load: on a CPU the resident memory of this process, which
                      imported the same libraries (torch, transformers); on a GPU 0, since free GPU memory is read
                      after this process made its CUDA context.
  drafter_weights     P_d b_d per drafter copy, in the drafter's compute dtype (models.precision.drafter_dtype:
                      float32 on a CPU, the target's dtype elsewhere).
  drafter_fast_path   on a CPU only (a GPU's lean forward runs the drafter's own weights: models/lean.py, `copies`):
                      the fused form (`_fused_layer`), per copy, each layer's products again plus the rotated q/k
                      rows, H (q + kv) more; where oneDNN prepacks the dtype (`can_prepack`) the lm_head's rows that
                      the passes compute prepacked, R H more (R: the proposable ids, or the draft vocabulary's K).
  target_weights      P_t b_t.
  target_fast_path    on a CPU only (a GPU's products read the weights in place): `target_runner` times its products
                      stacked in both forms, plain and prepacked, so 2 x the layer products, and the lm_head in both
                      forms, 2 V H (one form each where oneDNN cannot prepack the dtype).
  kv_caches           L x 2 x kv x tokens x b per row: the target one row, the drafter one row per prompt a replayed
                      pass decodes (ScoreConfig.batch_size); tokens = prompt + max_new_tokens + B.
  activations         the widest pass in inference: the drafter's first pass over the batch's prompts (rows x
                      (prompt + DecodeConfig.packed_budget + B) tokens) and the target's prefill of one prompt, each
                      tokens x (3 H + 3 I + 4 q + 3 kv) x b, and the drafter's mask, rows x tokens x context x b, with
                      its copy repeated per grouped query head (attention keeps no scores: flash kernels).
  logits              the drafter's block reads: rows x (1 + candidates) x B slots x R x 4 bytes, twice (the float32
                      logits and the logsumexp's temporary; plus b for the head's own output when b is not 4);
                      candidates = packed_budget // (B + 1), the blocks the packed pass fits; the target's verify
                      pass B x V_t x 4.

A heal (prune.heal) adds, on top:

  adapters            LoRA: rank x (in + out) per adapted projection (HealConfig.target_modules), float32 (peft keeps
                      adapters in float32), with its gradient and AdamW's two states: 4 x 4 bytes each.
  teacher_states      a run's heals distil from the unpruned drafter, whose final hidden states at the supervised rows
                      are remembered per batch (prune.training.loss.Teacher): min(steps, its `most`) batches x
                      batch_size x (blocks_per_sequence x B + max_length) rows x H x b.
  training_activations  what autograd keeps for backward through transformers' forward, per token and layer (measured
                      with saved-tensor hooks on Qwen3, tests/test_memory_plan.py): LoRA 4 H + 4 I + 6 q + 2 kv in b,
                      and where b is not 4 also 5 H + I + q in float32 (peft casts each adapter's input to float32);
                      full 6 H + 4 I + 7 q + 3 kv (and 2 H float32: the norms); plus 3 H per token outside the layers
                      and the batch's attention mask. Tokens: batch_size x (max_length + blocks_per_sequence x B,
                      padded to pad_multiple).
  head_loss           `head_losses` holds the head's proposable rows in float32 for the drafter and the teacher, 2 V H
                      x 4, and five (HEAD_CHUNK_ROWS x V) float32 tables of a chunk.
  optimizer, gradients  full: every decoder weight and the final norm in float32, its gradient and AdamW's two states.

Phases:

  score       runtime, one drafter and its fast-path form (ablations share the surviving layers' tensors), the
              target and its fast-path form, caches, activations, logits.
  run         the default heal (LoRA) from the second step on: the unpruned drafter (the teacher), the step's drafter
              and the heal's copy, each with its fast-path form once judged, the target, the teacher's states; the
              larger of the heal's moment (LoRA, training activations, head_loss; two fast-path forms) and the
              moment its result is judged (three fast-path forms, caches, activations, logits).
  heal_full   `prune heal --train full`: it loads the source and the teacher in float32 and trains a float32 copy
              (three drafters; no target), AdamW's states, and the larger of the forward's end (training
              activations, head_loss) and the backward's (the gradients). `prune heal` trains on the CPU; for
              another device the plan says what the same heal would hold there.
"""

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path

from decode.config import DecodeConfig
from models.sizes import Shapes

from .config import FINISHING_HEAL, HealConfig, ScoreConfig
from .training.config import TrainConfig

GIB = 1 << 30
PHASES = ("score", "run", "heal_full")
PHASE_COMMANDS = {"score": "prune score", "run": "prune run", "heal_full": "prune heal --train full"}
FLOAT32 = 4
ADAMW_STATES = 2


# LoRA's adapted projections by name: (in, out) features.
_PROJECTIONS = {
    "q_proj": lambda s: (s.hidden, s.q), "k_proj": lambda s: (s.hidden, s.kv), "v_proj": lambda s: (s.hidden, s.kv),
    "o_proj": lambda s: (s.q, s.hidden), "gate_proj": lambda s: (s.hidden, s.intermediate),
    "up_proj": lambda s: (s.hidden, s.intermediate), "down_proj": lambda s: (s.intermediate, s.hidden),
}


def lora_parameters(shapes: Shapes, heal: HealConfig) -> int:
    """The adapters' parameters: rank x (in + out) per adapted projection of every layer."""
    per_layer = sum(heal.rank * sum(_PROJECTIONS[name](shapes)) for name in heal.target_modules if name in _PROJECTIONS)
    return shapes.layers * per_layer


def training_activations(shapes: Shapes, tokens: int, nbytes: int, train: str) -> int:
    """What autograd keeps for backward of a heal's forward over `tokens` tokens (module docstring)."""
    h, i, q, kv = shapes.hidden, shapes.intermediate, shapes.q, shapes.kv
    if train == "full":
        per_layer = (6 * h + 4 * i + 7 * q + 3 * kv) * nbytes
        if nbytes != FLOAT32:
            per_layer += 2 * h * FLOAT32  # the two norms square their input in float32
    else:
        per_layer = (4 * h + 4 * i + 6 * q + 2 * kv) * nbytes
        if nbytes != FLOAT32:
            per_layer += (5 * h + i + q) * FLOAT32  # peft casts each adapter's input to its float32 weights
    return tokens * (shapes.layers * per_layer + 3 * h * nbytes)


def _remember_most() -> int:
    """Teacher states a run's teacher keeps at most (prune.training.loss.Teacher's own default)."""
    from .training.loss import Teacher

    return inspect.signature(Teacher).parameters["most"].default


@dataclass
class Workload:
    """What the plan assumes a command decodes and trains on, the tool's defaults unless given.

    Attributes:
        prompt_tokens: the longest prompt; nothing in the configs says, so a heal's crop (HealConfig.max_length).
        max_new_tokens, packed_budget: as in decode.config.DecodeConfig.
        batch_size: prompts a replayed drafter pass decodes at once (ScoreConfig.batch_size).
        heal: the run's heal (HealConfig: LoRA, its batch and sequence length); pad_multiple, grad_accum as the
            heal's training loop takes them (TrainConfig).
    """

    prompt_tokens: int = HealConfig.max_length  # a heal's sequence length, taken as a prompt's
    max_new_tokens: int = DecodeConfig.max_new_tokens
    batch_size: int = ScoreConfig.batch_size
    packed_budget: int = DecodeConfig.packed_budget
    heal: HealConfig = field(default_factory=HealConfig)
    pad_multiple: int = TrainConfig.pad_multiple
    grad_accum: int = TrainConfig.grad_accum


@dataclass
class MemoryPlan:
    """The plan of one drafter (and target) on one device: parameters, weight bytes and each phase's parts at its
    fullest moment (`moments`), in bytes."""

    device: str
    dtype: str
    drafter_dtype: str
    parameters: dict[str, int | None]
    weight_bytes: dict[str, int | None]
    parts: dict[str, dict[str, int]]
    moments: dict[str, str]

    @property
    def peaks(self) -> dict[str, int]:
        return {phase: sum(parts.values()) for phase, parts in self.parts.items()}

    def to_dict(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "drafter_dtype": self.drafter_dtype,
                "parameters": self.parameters, "bytes": self.weight_bytes, "estimated_peak_bytes": self.peaks,
                "peak_parts": self.parts, "peak_moments": self.moments}


def plan_memory(drafter_config, target_config=None, device: str = "cpu", dtype: str = "float32",
                drafter_dtype: str | None = None, workload: Workload | None = None, runtime: int | None = None,
                drafter_copies: int = 1) -> MemoryPlan:
    """The memory plan (module docstring) of a drafter config and, where given, a target config.

    Args:
        device: where the commands run ("cpu", "cuda", "cuda:1"); the fast-path forms depend on it.
        dtype: the target's compute dtype name; `drafter_dtype` the drafter's (None: the tool's auto rule).
        workload: what is decoded and trained (default: the tool's defaults, `Workload`).
        runtime: bytes of the process before weights load (None: measured, `runtime_bytes`).
        drafter_copies: drafters that scoring holds at once (1 where ablations share the layers' tensors).
    """
    import torch

    from models.draft_vocab import head_rows as draft_head_rows
    from models.lean import can_prepack
    from models.precision import drafter_dtype as auto_drafter_dtype

    work = workload or Workload()
    kind = torch.device(device).type
    target_dtype = getattr(torch, dtype)
    d_dtype = auto_drafter_dtype(drafter_dtype, target_dtype, torch.device(device))
    d_bytes, t_bytes = d_dtype.itemsize, target_dtype.itemsize
    drafter = Shapes.of(drafter_config)
    target = Shapes.of(target_config) if target_config is not None else None
    block = drafter_config.block_size
    on_cpu = kind == "cpu"

    head_rows = draft_head_rows(drafter_config)  # the rows its passes compute: proposable, or a draft vocabulary
    head = head_rows * drafter.hidden if can_prepack(torch.device("cpu"), d_dtype) else 0
    fast = drafter.layers * drafter.fused_layer + head if on_cpu else 0
    drafter_weights, drafter_fast = drafter.parameters * d_bytes, fast * d_bytes
    context = work.prompt_tokens + work.max_new_tokens + block
    rows = work.batch_size
    widest = rows * (work.prompt_tokens + work.packed_budget + block)
    candidates = work.packed_budget // (block + 1)
    slots = rows * (1 + candidates) * block
    decoding = {
        "drafter_kv_cache": rows * context * drafter.kv_per_token(d_bytes),
        "activations": drafter.pass_activations(widest, d_bytes) + _pass_mask(drafter, rows, widest // rows, context,
                                                                              d_bytes),
        "logits": slots * head_rows * (2 * FLOAT32 + (0 if d_bytes == FLOAT32 else d_bytes)),
    }
    held = {"runtime": runtime_bytes(kind) if runtime is None else runtime}
    if target is not None:
        forms = 2 if can_prepack(torch.device("cpu"), target_dtype) else 1  # plain and prepacked, or plain
        target_fast = forms * (target.layers * target.products + target.embedding) if on_cpu else 0
        held.update(target_weights=target.parameters * t_bytes, target_fast_path=target_fast * t_bytes,
                    target_kv_cache=context * target.kv_per_token(t_bytes))
        decoding["activations"] += target.pass_activations(work.prompt_tokens, t_bytes)  # a causal prefill: no mask
        decoding["logits"] += block * target.vocab * (FLOAT32 + t_bytes)

    score = {**held, "drafter_weights": drafter_copies * drafter_weights,
             "drafter_fast_path": drafter_copies * drafter_fast, **decoding}

    heal = work.heal
    heal_tokens = _heal_tokens(heal, work.pad_multiple, block)
    rows_per_batch = heal.batch_size * (heal.blocks_per_sequence * block + heal.max_length)
    batches = min(heal.steps * work.grad_accum, _remember_most())
    run_held = {**held, "drafter_weights": 3 * drafter_weights,
                "teacher_states": batches * rows_per_batch * drafter.hidden * d_bytes}
    lora = lora_parameters(drafter, heal)
    run_heal = {**run_held, "drafter_fast_path": 2 * drafter_fast,
                "adapters": lora * FLOAT32 * (2 + ADAMW_STATES),
                "training_activations": training_activations(drafter, heal_tokens, d_bytes, heal.train)
                + _mask(heal, heal_tokens, d_bytes),
                "head_loss": _head_loss(drafter)}
    run_judge = {**run_held, "drafter_fast_path": 3 * drafter_fast, **decoding}

    trainable = drafter.layers * drafter.layer_parameters + drafter.hidden
    full_held = {"runtime": held["runtime"], "drafter_weights": 3 * drafter.parameters * FLOAT32,
                 "optimizer_states": ADAMW_STATES * trainable * FLOAT32}
    full_tokens = _heal_tokens(FINISHING_HEAL, work.pad_multiple, block)
    full_forward = {**full_held, "training_activations": training_activations(drafter, full_tokens, FLOAT32, "full")
                    + _mask(FINISHING_HEAL, full_tokens, FLOAT32), "head_loss": _head_loss(drafter)}
    full_backward = {**full_held, "gradients": trainable * FLOAT32}

    run_moment, run_parts = _fullest({"heal": run_heal, "judge": run_judge})
    full_moment, full_parts = _fullest({"forward": full_forward, "backward": full_backward})
    return MemoryPlan(
        device=device, dtype=dtype, drafter_dtype=str(d_dtype).removeprefix("torch."),
        parameters={"drafter": drafter.parameters, "target": target and target.parameters},
        weight_bytes={"drafter": drafter_weights, "target": target and target.parameters * t_bytes},
        parts={"score": score, "run": run_parts, "heal_full": full_parts},
        moments={"score": "decode", "run": run_moment, "heal_full": full_moment})


def _pass_mask(shapes: Shapes, rows: int, queries: int, keys: int, nbytes: int) -> int:
    """A drafter pass's additive mask, rows x queries x keys, and its copy repeated once per query head of a
    key/value head (models.lean folds grouped heads); attention itself keeps no scores (flash kernels)."""
    return (1 + shapes.heads // shapes.kv_heads) * rows * queries * keys * nbytes


def _heal_tokens(heal: HealConfig, pad_multiple: int, block: int) -> int:
    """Query tokens of one heal micro-batch: sequences cropped to max_length, their mask blocks after them."""
    length = heal.max_length + heal.blocks_per_sequence * block
    return heal.batch_size * math.ceil(length / pad_multiple) * pad_multiple


def _mask(heal: HealConfig, tokens: int, nbytes: int) -> int:
    """The heal batch's attention mask: batch x Q x Q."""
    return tokens * (tokens // heal.batch_size) * nbytes


def _head_loss(shapes: Shapes) -> int:
    from .training.loss import HEAD_CHUNK_ROWS

    return (2 * shapes.embedding + 5 * HEAD_CHUNK_ROWS * shapes.vocab) * FLOAT32


def _fullest(moments: dict[str, dict[str, int]]) -> tuple[str, dict[str, int]]:
    """The name and parts of the moment that holds the most."""
    name = max(moments, key=lambda key: sum(moments[key].values()))
    return name, moments[name]


def runtime_bytes(kind: str) -> int:
    """The process's own footprint before weights load: this process's resident memory on a CPU (it imported the
    libraries a command imports), 0 on a GPU (its CUDA context is outside the free memory already)."""
    if kind != "cpu":
        return 0
    return _status_kib("/proc/self/status", "VmRSS:") * 1024


def _status_kib(path: str, field_name: str) -> int:
    """The kB value of `field_name` in a /proc file; 0 where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def device_memory(device: str, meminfo: str = "/proc/meminfo") -> tuple[int | None, str]:
    """(bytes a command may use on `device`, where that number comes from): free GPU memory
    (torch.cuda.mem_get_info), or on a CPU MemAvailable plus this process's resident memory (a command's
    process holds its own libraries in place of this one's); (None, why) where it cannot be read."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return None, "no GPU is visible here"
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free memory of {device}"
    available = _status_kib(meminfo, "MemAvailable:")
    if kind != "cpu" or not available:
        return None, f"{meminfo} says nothing"
    return available * 1024 + runtime_bytes(kind), "MemAvailable"


def warnings_for(plan: MemoryPlan, available: int | None, source: str) -> list[str]:
    """One line per phase whose estimated peak exceeds `available` bytes (none when it is unknown)."""
    if available is None:
        return []
    lines = []
    for phase, peak in plan.peaks.items():
        if peak > available:
            largest = max(plan.parts[phase], key=plan.parts[phase].get)
            lines.append(f"warning: {PHASE_COMMANDS[phase]} is estimated to peak at {gib(peak)} on {plan.device}, "
                         f"over the {gib(available)} available ({source}); its largest part is {largest} "
                         f"({gib(plan.parts[phase][largest])}): use a device with more memory or a narrower --dtype")
    return lines


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def describe(plan: MemoryPlan, available: int | None, source: str) -> str:
    """The plan as two lines of text."""
    params = ", ".join(f"{role} {n:,} parameters ({gib(plan.weight_bytes[role])})"
                       for role, n in plan.parameters.items() if n is not None)
    peaks = ", ".join(f"{PHASE_COMMANDS[phase]} {gib(peak)}" for phase, peak in plan.peaks.items())
    where = f"{gib(available)} available" if available is not None else "available memory unknown"
    return (f"memory plan on {plan.device} (target {plan.dtype}, drafter {plan.drafter_dtype}): {params}\n"
            f"estimated peak: {peaks}; {where} ({source})")
