"""`prune train-drafter` as a library function: build a block-diffusion drafter for a target, train it, save it.

`train_demo_drafter(args)` takes the command's parsed flags (prune/commands/train_drafter.py; their
defaults are `prune.training.config.TRAIN_DRAFTER_DEFAULTS`). `--data` names one or more folders written by
`prune distill` (`prune.training.data`: the target's greedy responses to training prompts, all of the same
target); `--data-weights` repeats a folder's training sequences to weight it. The drafter shares the
target's tokenizer: vocab = target vocab + 1 mask id, padded to a multiple of 64 (`draft_vocab_size` = the
target vocab, so the mask id and the padding are never proposed). It starts sliced from the target
(`--init slice`, `prune.training.transplant.drafter_from_target`), with only the target's embedding
projected onto its top principal components (`--init pca`, `pca_embedding`), from noise (`--init random`)
or from a saved drafter (`--init-from`). A held-out slice of the data is scored every `--eval-every` steps
(per-slot accuracy and the leading-run acceptance proxy; `--eval-tau` adds a real tau from replayed
trajectories). The run is resumable from `--checkpoint-dir`; the result is saved in bfloat16 with the
target's tokenizer files and its provenance (`training.json`).
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from models.provenance import FILE as PROMPTS_FILE, summary as prompt_summary, training_prompts_text

TRAINING_RECORD = "training.json"  # a trained drafter's provenance, beside its weights

from .data import load_examples, read_manifest, split_examples


def padded_vocab(real_vocab: int, multiple: int = 64) -> int:
    """Rows of the drafter's embedding: the real ids, one mask id, rounded up to `multiple`."""
    return -(-(real_vocab + 1) // multiple) * multiple


def parameter_count(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int) -> int:
    """Parameters of a Qwen3 drafter with tied embeddings (what the safetensors file stores)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim  # q, o, k, v; q/k norms
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden


def data_weights(args: argparse.Namespace) -> list[int]:
    """One integer weight per `--data` folder (all 1 unless `--data-weights` says otherwise)."""
    return folder_weights(args.data, args.data_weights)


def folder_weights(folders: list[str], weights: list[int] | None, flag: str = "--data") -> list[int]:
    """One integer weight per data folder given with `flag` (all 1 when `weights` is None); `flag` + "-weights"
    is the flag that gave `weights`."""
    from models.errors import ConfigError

    weights = weights or [1] * len(folders)
    if len(weights) != len(folders) or min(weights) < 1:
        raise ConfigError(f"{flag}-weights needs one integer >= 1 per {flag} folder ({len(folders)} given), "
                          f"got {weights}")
    return list(weights)


def heldout_callback(examples, config, eval_fn=None, batch_size: int = 16):
    """A `train` callback: loss, per-slot accuracy and acceptance proxy on `examples` with fixed anchors."""
    import torch

    from .loss import build_batch, causal_lm, drafter_loss

    def callback(step, model):
        if not examples:
            return (eval_fn(model, step) or {}) if eval_fn is not None else {}
        lm = causal_lm(model)
        device = next(lm.parameters()).device
        generator = torch.Generator().manual_seed(config.seed + 12345)  # same anchors at every evaluation
        correct = count = 0
        totals = {"diff": 0.0, "ar": 0.0, "accept_sum": 0.0, "accept_blocks": 0}
        for start in range(0, len(examples), batch_size):
            batch = build_batch(examples[start : start + batch_size], lm.config.block_size, lm.config.mask_token_id,
                                config.blocks_per_sequence, generator, max_length=config.max_length,
                                mask_dtype=torch.bfloat16 if config.bf16 else torch.float32)
            out = drafter_loss(model, batch.to(device), config.gamma, config.ar_weight)
            n = len(examples[start : start + batch_size])
            totals["diff"] += out.diff.item() * n / len(examples)
            totals["ar"] += out.ar.item() * n / len(examples)
            totals["accept_sum"] += float(out.accept_sum)
            totals["accept_blocks"] += int(out.accept_blocks)
            correct, count = correct + out.slot_correct.cpu(), count + out.slot_count.cpu()
        accuracy = (correct.float() / count.clamp_min(1).float()).tolist()
        metrics = {
            "eval_diff": totals["diff"], "eval_ar": totals["ar"], "eval_slot_acc": [round(a, 4) for a in accuracy],
            "eval_accept_proxy": totals["accept_sum"] / max(1, totals["accept_blocks"]),
        }
        print(f"step {step}: held-out diff {metrics['eval_diff']:.3f} ar {metrics['eval_ar']:.3f} "
              f"acc1 {accuracy[0]:.3f} acc4 {accuracy[min(3, len(accuracy) - 1)]:.3f} "
              f"accept proxy {metrics['eval_accept_proxy']:.3f}", file=sys.stderr)
        if eval_fn is not None:
            metrics.update(eval_fn(model, step) or {})
        return metrics

    return callback


class BestWeights:
    """Keeps the weights of the evaluation with the highest held-out acceptance proxy (`--keep-best`).

    Late in a many-epoch run the held-out proxy can fall while the training loss still drops; this
    returns the drafter of the best evaluation instead of the last. The copy lives beside the checkpoint
    folder (`<folder>.best.pt`, written atomically; a checkpoint replaces its folder whole), so a resumed
    run still knows the best before the interruption.
    """

    metric = "eval_accept_proxy"

    def __init__(self, checkpoint_dir: Path, resuming: bool):
        import torch

        from models.checkpoint import remove_partials

        self.file = Path(checkpoint_dir).with_name(Path(checkpoint_dir).name + ".best.pt")
        remove_partials(self.file)  # left by a killed save (the caller holds the checkpoint folder's lock)
        self.step, self.score = None, float("-inf")
        if not resuming:
            self.file.unlink(missing_ok=True)  # left by another run: not this run's best
        elif self.file.is_file():
            saved = torch.load(self.file, map_location="cpu", weights_only=True)
            self.step, self.score = saved["step"], saved["score"]

    def wrap(self, callback):
        """`callback` (a `train` callback returning the held-out metrics), recording a new best on the way."""
        import torch

        from models.checkpoint import atomic_file

        from .loss import causal_lm

        def recording(step, model):
            metrics = callback(step, model)
            score = metrics.get(self.metric)
            if score is not None and score > self.score:
                state = {k: v.detach().to("cpu", copy=True) for k, v in causal_lm(model).state_dict().items()}
                with atomic_file(self.file) as partial:
                    torch.save({"step": step, "score": score, "state": state}, partial)
                self.step, self.score = step, score
            return metrics

        return recording

    def restore(self, model) -> dict:
        """Load the best weights into `model`; return {step, metric: score} for the provenance ({} if none)."""
        import torch

        from .loss import causal_lm

        if not self.file.is_file():
            return {}
        causal_lm(model).load_state_dict(torch.load(self.file, map_location="cpu", weights_only=True)["state"])
        return {"step": self.step, self.metric: self.score}


def build_initial_drafter(args: argparse.Namespace):
    """A fresh drafter for the target named by `args` (or the data manifest): (model, init note, parameters)."""
    from models.errors import ConfigError, DataError
    from models.target import load_tokenizer

    target_dir = _target_dir(args)
    tokenizer = load_tokenizer(target_dir) if target_dir.is_dir() else None
    if tokenizer is None:
        raise DataError(f"target folder {str(target_dir) or '(none)'} has no tokenizer; pass --target, the folder "
                        "the distillation data was generated with")
    real_vocab = len(tokenizer)
    vocab = padded_vocab(real_vocab)
    params = parameter_count(vocab, args.hidden_size, args.intermediate_size, args.layers, args.heads,
                             args.kv_heads, args.head_dim)
    print(f"drafter: {args.layers} layers, hidden {args.hidden_size}, vocab {vocab} (mask id {real_vocab}), "
          f"{params / 1e6:.2f} M parameters = {2 * params / 1e6:.1f} MB in bfloat16", file=sys.stderr)
    if 2 * params > args.max_mb * 1e6:
        raise ConfigError(f"the drafter would take {2 * params / 1e6:.1f} MB in bfloat16, over --max-mb "
                          f"{args.max_mb}; lower --hidden-size or --intermediate-size")
    if args.init == "slice":
        return (*_sliced_drafter(args, target_dir, vocab, real_vocab), params)
    return (*_fresh_drafter(args, target_dir, vocab, real_vocab), params)


def saved_drafter(args: argparse.Namespace):
    """`--init-from`: (the saved drafter, with `--split-idle` layers split; init note; its folder)."""
    from models.drafter import load_drafter
    from models.surgery import split_layers

    from .transplant import idle_layer_split

    model, note = load_drafter(args.init_from), f"from {args.init_from}"
    if args.split_idle:
        idle, sources = idle_layer_split(model, args.split_idle)
        model = split_layers(model, idle, sources)
        note += f", layers {idle} replaced by halves of layers {sources}"
    return model, note, Path(args.init_from)


def _target_dir(args: argparse.Namespace) -> Path:
    """The target folder: --target, or the one named in the first --data folder's manifest."""
    return Path(args.target or read_manifest(args.data[0]).get("target") or "")


def _sliced_drafter(args: argparse.Namespace, target_dir: Path, vocab: int, real_vocab: int):
    """`--init slice`: (drafter sliced from the target at `target_dir`, init note); `vocab` embedding rows,
    mask id `real_vocab`."""
    from models.errors import ConfigError
    from models.target import load_target

    from .transplant import drafter_from_target

    # Calibration: the first training sequences of the data (deterministic), cropped like training.
    calibration = [ex.input_ids[: args.max_length] for ex in load_examples(args.data[0], args.partial_data)
                   [: args.calibration_sequences]]
    model, stats = drafter_from_target(
        load_target(target_dir), calibration, vocab_size=vocab, mask_token_id=real_vocab,
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        block_size=args.block_size, seed=args.seed)
    if (model.config.num_attention_heads, model.config.head_dim) != (args.heads, args.head_dim):
        raise ConfigError(f"--init slice keeps one key/value group of the target: "
                          f"{model.config.num_attention_heads} heads of width {model.config.head_dim}; pass "
                          f"--heads {model.config.num_attention_heads} --head-dim {model.config.head_dim} --kv-heads 1")
    return model, (f"sliced from the target ({stats['source_layers']} layers, {stats['kept_variance']:.3f} of the "
                   f"normalised residual variance kept, {stats['calibration_tokens']} calibration tokens)")


def _fresh_drafter(args: argparse.Namespace, target_dir: Path, vocab: int, real_vocab: int):
    """`--init random` or `--init pca`: (a seeded random drafter, with pca the target's embedding projected
    into its embedding rows, init note)."""
    import torch

    from models.drafter import create_drafter
    from models.target import load_target

    from .transplant import pca_embedding

    model = create_drafter(vocab_size=vocab, mask_token_id=real_vocab, block_size=args.block_size,
                           draft_vocab_size=real_vocab, seed=args.seed, tie_word_embeddings=True,
                           hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    if args.init != "pca":
        return model, "random"
    target = load_target(target_dir)
    table, kept = pca_embedding(target.get_input_embeddings().weight, args.hidden_size, model.config.initializer_range)
    rows = min(table.shape[0], real_vocab)
    with torch.no_grad():
        model.get_input_embeddings().weight[:rows].copy_(table[:rows])
    return model, f"pca of the target embedding ({kept:.3f} of its variance)"


def replay_tau(examples, count: int, max_new_tokens: int, stop_ids: tuple[int, ...]):
    """An `eval_fn` measuring real tau: the async decoder replays held-out distillation trajectories.

    Each held-out sequence is a prompt plus the target's greedy response, i.e. a recorded trajectory, so
    a `ReplayVerifier` answers verification exactly as the target did, at drafter cost only.
    """
    from decode.decoders import DecodeConfig, decode_speculative
    from decode.metrics import tau_per_prompt
    from decode.verifiers import ReplayVerifier

    from .loss import causal_lm

    chosen = [ex for ex in examples if ex.loss_mask.any()][:count]

    def evaluate(model, step):
        lm = causal_lm(model)
        prompts, verifiers = [], []
        for ex in chosen:
            ids = ex.input_ids.tolist()
            prompts.append(ids[: int((~ex.loss_mask).sum())])
            verifiers.append(ReplayVerifier(ids))
        # The generation's own stop rule, so that every trajectory ends where decoding stops.
        config = DecodeConfig(max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        results = decode_speculative("async", lm, verifiers, prompts, config)
        taus = tau_per_prompt(results)
        return {"eval_replay_tau": sum(taus) / len(taus) if taus else None}

    return evaluate


def train_demo_drafter(args: argparse.Namespace, config, eval_fn=None) -> Path:
    """Build, train and save the drafter described by `args` (the parsed CLI flags) with the loop settings
    `config` (a TrainConfig; its device-dependent bf16 and its checkpoint folder are filled in here); return
    the folder.

    Holds the locks (models.lock) of --out and of the checkpoint folder while it trains: a second run on
    either fails at once. A run killed at any moment and rerun with the same flags resumes from its last
    checkpoint (prune.training.loop) and saves the same weights as a run never interrupted.
    """
    import torch

    from models.checkpoint import ensure_writable_output
    from models.drafter import save_drafter
    from models.errors import DataError
    from models.lock import output_lock

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    if args.save_initial:
        if args.init_from:
            model, init_note, tokenizer_dir = saved_drafter(args)
        else:
            (model, init_note, _), tokenizer_dir = build_initial_drafter(args), _target_dir(args)
        print(f"embedding init: {init_note}", file=sys.stderr)
        return save_drafter(model, args.save_initial, tokenizer_source=tokenizer_dir, overwrite=args.overwrite,
                            dtype=torch.bfloat16)
    if not args.out:
        raise DataError("--out is required (the folder the trained drafter is written to)")
    out = ensure_writable_output(args.out, args.overwrite)
    checkpoint_dir = Path(args.checkpoint_dir or f"{out}-checkpoints")
    config = replace(config, bf16=bf16, checkpoint_dir=str(checkpoint_dir))
    with output_lock(out), output_lock(checkpoint_dir):
        return _train_and_save(args, out, config, device, eval_fn)


def _train_and_save(args: argparse.Namespace, out: Path, config, device, eval_fn) -> Path:
    """The body of `train_demo_drafter` once its outputs are locked: build, train, keep the best, save."""
    import shutil

    import torch

    from models.drafter import save_drafter

    from .loop import CHECKPOINT_STATE, train

    manifests = [read_manifest(folder) for folder in args.data]
    if args.init_from:
        # Start from a saved drafter (e.g. one built here with the PCA embedding, trained on another machine).
        model, init_note, tokenizer_dir = saved_drafter(args)
        params = sum(p.numel() for p in model.parameters())
    else:
        model, init_note, params = build_initial_drafter(args)
        tokenizer_dir = _target_dir(args)
    print(f"embedding init: {init_note}", file=sys.stderr)

    heldout, training = split_examples(args.data, data_weights(args), args.eval_size, args.seed, args.partial_data,
                                       args.eval_data)
    checkpoint_dir = Path(config.checkpoint_dir)
    start = time.perf_counter()
    if eval_fn is None and args.eval_tau:
        from models.pair import stop_ids_of
        from models.target import load_tokenizer

        stop_ids = stop_ids_of(tokenizer=load_tokenizer(tokenizer_dir))
        eval_fn = replay_tau(heldout, args.eval_tau, manifests[0]["max_new_tokens"], stop_ids)
    callback = heldout_callback(heldout, config, eval_fn)
    best = None
    if args.keep_best:
        best = BestWeights(checkpoint_dir, resuming=(checkpoint_dir / CHECKPOINT_STATE).is_file())
        callback = best.wrap(callback)
    history = train(model, training, config, callback=callback, device=device)
    seconds = time.perf_counter() - start
    kept = best.restore(model) if best else {}
    if kept:
        print(f"kept the weights of step {kept['step']} (held-out accept proxy {kept[best.metric]:.3f})",
              file=sys.stderr)
    provenance = _provenance(args, config, history, manifests, {
        "device": str(device), "torch_version": torch.__version__, "parameters": params, "embedding_init": init_note,
        "train_sequences": len(training), "heldout_sequences": len(heldout),
        "train_seconds_this_call": round(seconds, 1), **({"kept_best": kept} if best else {})})
    sets = training_prompt_sets(args)
    model.config.training_prompt_sets = prompt_summary(sets)
    folder = save_drafter(model.float().cpu(), out, tokenizer_source=tokenizer_dir, overwrite=args.overwrite,
                          dtype=torch.bfloat16,
                          extra_files={TRAINING_RECORD: json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n",
                                       PROMPTS_FILE: training_prompts_text(sets)})
    if not args.keep_checkpoints:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        if best:
            best.file.unlink(missing_ok=True)
    print(f"saved the drafter to {folder}", file=sys.stderr)
    return folder


def training_prompt_sets(args: argparse.Namespace) -> list[dict]:
    """The trained drafter's record of training prompts (models/provenance.py): every prompt of each --data
    folder (held-out sequences included: they are one draw away from being trained on), after the record
    of the --init-from drafter (sets already there are not repeated)."""
    from models.provenance import read_training_prompts

    from .data import training_prompt_set

    new = [training_prompt_set(folder, args.partial_data) for folder in args.data]
    inherited = (read_training_prompts(args.init_from) or []) if args.init_from else []
    known = {entry["sha256"] for entry in new}
    return [entry for entry in inherited if entry["sha256"] not in known] + new


def training_summary(folder: str | Path) -> dict:
    """A trained drafter folder's record in brief (from its training.json; only the folder for a drafter saved
    by --save-initial): updates run, seconds of this call, parameters, sequences, last evaluation, kept best."""
    record_file = Path(folder) / TRAINING_RECORD
    if not record_file.is_file():
        return {"out": str(folder)}
    record = json.loads(record_file.read_text())
    history = record.get("history") or [{}]
    return {"out": str(folder), "steps": history[-1].get("step"),
            **{key: record.get(key) for key in ("train_seconds_this_call", "parameters", "train_sequences",
                                                 "heldout_sequences", "final_eval", "kept_best", "device")}}


def _provenance(args: argparse.Namespace, config, history: list[dict], manifests: list[dict], facts: dict) -> dict:
    """The trained drafter's training.json: the flags, the loop's settings (`config`, a TrainConfig), the data
    manifests, the last evaluation's metrics and the history (about 500 records, every evaluation kept),
    with `facts` of the run (device, parameters, init, sequence counts, seconds, the kept best)."""
    return {
        "what": "d3d-prune demo drafter, trained from scratch by prune.train_drafter",
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out", "overwrite", "no_progress", "json") and not callable(v)},
        "train_config": {k: v for k, v in vars(config).items()},
        "data_manifest": manifests[0],
        **({"data_manifests": dict(zip(args.data, manifests))} if len(args.data) > 1 else {}),
        "final_eval": next((r for r in reversed(history) if "eval_slot_acc" in r), {}),
        "history": [r for r in history if r["step"] % max(1, args.steps // 500) == 0 or "eval_slot_acc" in r],
        **facts,
    }
