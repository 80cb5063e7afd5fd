"""Build the demo drafter from scratch: a 36-layer Qwen3 block-diffusion drafter for the demo target.

    python -m prune.train_drafter --data DIR --out DIR [--steps N] [--device cuda] ...

`--data` names one or more folders written by `prune.distill.generate_distillation_data` (the target's greedy
responses to the same target); `--data-weights` repeats a folder's training sequences to weight it.
The drafter shares the target's tokenizer: vocab = target vocab + 1 mask id, padded to a multiple of 64
(`draft_vocab_size` = the target vocab, so the mask id and the padding are never proposed). Its embedding
starts from the target's embedding projected onto its top principal components (see `pca_embedding`).
A held-out slice of the data is scored every `--eval-every` steps (per-slot accuracy and the
leading-run acceptance proxy); `train_demo_drafter(..., eval_fn=...)` adds a real tau. The run is
resumable from `--checkpoint-dir`; the result is saved in bfloat16 with the target's tokenizer files.
"""

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULTS = dict(
    steps=2000, batch_size=16, grad_accum=1, lr=1.5e-3, warmup_steps=100, blocks_per_sequence=16,
    max_length=512, gamma=7.0, ar_weight=1.0, seed=0, layers=36, hidden_size=192, intermediate_size=576,
    heads=3, kv_heads=1, head_dim=64, block_size=16, eval_size=64, eval_every=100, checkpoint_every=100,
)


def padded_vocab(real_vocab: int, multiple: int = 64) -> int:
    """Rows of the drafter's embedding: the real ids, one mask id, rounded up to `multiple`."""
    return -(-(real_vocab + 1) // multiple) * multiple


def parameter_count(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int) -> int:
    """Parameters of a Qwen3 drafter with tied embeddings (what the safetensors file stores)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim  # q, o, k, v; q/k norms
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden


def pca_embedding(source, width: int, std: float):
    """Project `source` `(vocab, d)` onto its top-`width` principal components; rescale to `std`.

    Deterministic (eigh of the d x d covariance, each component's sign fixed so its largest entry is
    positive). Returns float32 `(vocab, width)` and the fraction of variance kept.
    """
    import torch

    x = source.detach().float()
    x = x - x.mean(0, keepdim=True)
    values, vectors = torch.linalg.eigh(x.T @ x / x.shape[0])  # ascending
    vectors = vectors[:, -width:].flip(-1)
    signs = torch.sign(vectors[vectors.abs().argmax(0), torch.arange(vectors.shape[1])])
    projected = x @ (vectors * signs)
    kept = float(values[-width:].sum() / values.sum())
    return projected * (std / projected.std()), kept


def load_examples(folder: str | Path, partial: bool = False):
    """Distillation records as training `Example`s (prompt unsupervised, response supervised)."""
    from prune.training.loss import Example
    from prune.training.data import load_distillation_data

    records = load_distillation_data(folder, partial)
    return [Example.from_prompt_response(r["prompt_ids"], r["response_ids"]) for r in records if r["response_ids"]]


def data_weights(args: argparse.Namespace) -> list[int]:
    """One integer weight per `--data` folder (all 1 unless `--data-weights` says otherwise)."""
    from models.errors import ConfigError

    weights = args.data_weights or [1] * len(args.data)
    if len(weights) != len(args.data) or min(weights) < 1:
        raise ConfigError(f"--data-weights needs one integer >= 1 per --data folder ({len(args.data)} given), "
                          f"got {weights}")
    return weights


def split_examples(folders: list, weights: list[int], eval_size: int, seed: int, partial: bool = False,
                   eval_folder: str | Path | None = None):
    """(held-out, training) `Example` lists from several distillation folders of one target.

    The held-out sequences are drawn (seeded) from all folders together before weighting; a training
    sequence of a folder with weight w appears w times. With `eval_folder` they are drawn from that folder
    instead (e.g. data that an earlier training run never saw, whose held-out draw changes as folders are
    added). Either way every training sequence equal to a held-out one is dropped: folders of one target
    repeat prompts (two seeds of a prompt style share much of their pool), and a repeated prompt has the
    same greedy response, so it would otherwise be trained on.
    """
    import torch

    from models.errors import DataError

    every_folder = [*folders, *([eval_folder] if eval_folder else [])]
    targets = {read_manifest(folder).get("target_weights_sha256") for folder in every_folder}
    if len(targets) > 1:
        raise DataError(f"the --data and --eval-data folders {', '.join(map(str, every_folder))} were generated by "
                        "different targets; train on data of one target")
    tagged = [(ex, w) for folder, w in zip(folders, weights) for ex in load_examples(folder, partial)]
    pool = tagged if eval_folder is None else [(ex, 1) for ex in load_examples(eval_folder, partial)]
    if len(pool) <= eval_size:
        raise DataError(f"{eval_folder or ', '.join(map(str, folders))} hold {len(pool)} usable sequences, not "
                        f"more than --eval-size {eval_size}; generate more data or lower --eval-size")
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    heldout = [pool[i][0] for i in order[:eval_size]]
    held = {tuple(ex.input_ids.tolist()) for ex in heldout}
    rest = [tagged[i] for i in order[eval_size:]] if eval_folder is None else tagged
    return heldout, [ex for ex, w in rest if tuple(ex.input_ids.tolist()) not in held for _ in range(w)]


def heldout_callback(examples, config, eval_fn=None, batch_size: int = 16):
    """A `train` callback: loss, per-slot accuracy and acceptance proxy on `examples` with fixed anchors."""
    import torch

    from prune.training.loss import build_batch, causal_lm, drafter_loss

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
        from prune.training.loss import causal_lm

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

        from prune.training.loss import causal_lm

        if not self.file.is_file():
            return {}
        causal_lm(model).load_state_dict(torch.load(self.file, map_location="cpu", weights_only=True)["state"])
        return {"step": self.step, self.metric: self.score}


def read_manifest(data: str | Path) -> dict:
    """The distillation folder's manifest.json (settings and target path), or {} when it has none."""
    file = Path(data) / "manifest.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def build_initial_drafter(args: argparse.Namespace):
    """A fresh drafter for the target named by `args` (or the data manifest): (model, init note, parameters)."""
    import torch

    from models.drafter import create_drafter
    from models.errors import ConfigError, DataError
    from models.target import load_target, load_tokenizer

    target_dir = Path(args.target or read_manifest(args.data[0]).get("target") or "")
    tokenizer = load_tokenizer(target_dir) if target_dir.is_dir() else None
    if tokenizer is None:
        raise DataError(f"target folder {str(target_dir) or '(none)'} has no tokenizer; pass --target, the folder "
                        "the distillation data was generated with")
    real_vocab = len(tokenizer)
    vocab = padded_vocab(real_vocab)
    sizes = dict(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 head_dim=args.head_dim)
    params = parameter_count(vocab, args.hidden_size, args.intermediate_size, args.layers, args.heads,
                             args.kv_heads, args.head_dim)
    print(f"drafter: {args.layers} layers, hidden {args.hidden_size}, vocab {vocab} (mask id {real_vocab}), "
          f"{params / 1e6:.2f} M parameters = {2 * params / 1e6:.1f} MB in bfloat16", file=sys.stderr)
    if 2 * params > args.max_mb * 1e6:
        raise ConfigError(f"the drafter would take {2 * params / 1e6:.1f} MB in bfloat16, over --max-mb "
                          f"{args.max_mb}; lower --hidden-size or --intermediate-size")
    if args.init == "slice":
        from prune.training.transplant import drafter_from_target

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
                       f"normalised residual variance kept, {stats['calibration_tokens']} calibration tokens)"), params
    model = create_drafter(vocab_size=vocab, mask_token_id=real_vocab, block_size=args.block_size,
                           draft_vocab_size=real_vocab, seed=args.seed, tie_word_embeddings=True, **sizes)
    init_note = "random"
    if args.init == "pca":
        target = load_target(target_dir)
        table, kept = pca_embedding(target.get_input_embeddings().weight, args.hidden_size,
                                    model.config.initializer_range)
        rows = min(table.shape[0], real_vocab)
        with torch.no_grad():
            model.get_input_embeddings().weight[:rows].copy_(table[:rows])
        init_note = f"pca of the target embedding ({kept:.3f} of its variance)"
    return model, init_note, params


def replay_tau(examples, count: int, max_new_tokens: int, stop_ids: tuple[int, ...]):
    """An `eval_fn` measuring real tau: the async decoder replays held-out distillation trajectories.

    Each held-out sequence is a prompt plus the target's greedy response, i.e. a recorded trajectory, so
    a `ReplayVerifier` answers verification exactly as the target did, at drafter cost only.
    """
    from decode.decoders import DecodeConfig, decode_speculative
    from decode.metrics import tau_per_prompt
    from decode.verifiers import ReplayVerifier
    from prune.training.loss import causal_lm

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


def train_demo_drafter(args: argparse.Namespace, eval_fn=None) -> Path:
    """Build, train and save the drafter described by `args` (the parsed CLI flags); return the folder.

    Holds the locks (models.lock) of --out and of the checkpoint folder while it trains: a second run on
    either fails at once. A run killed at any moment and rerun with the same flags resumes from its last
    checkpoint (models.training) and saves the same weights as a run never interrupted.
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
        model, init_note, _ = build_initial_drafter(args)
        target_dir = Path(args.target or read_manifest(args.data[0]).get("target") or "")
        print(f"embedding init: {init_note}", file=sys.stderr)
        return save_drafter(model, args.save_initial, tokenizer_source=target_dir, overwrite=args.overwrite,
                            dtype=torch.bfloat16)
    if not args.out:
        raise DataError("--out is required (the folder the trained drafter is written to)")
    out = ensure_writable_output(args.out, args.overwrite)
    checkpoint_dir = Path(args.checkpoint_dir or f"{out}-checkpoints")
    with output_lock(out), output_lock(checkpoint_dir):
        return _train_and_save(args, out, checkpoint_dir, device, bf16, eval_fn)


def _train_and_save(args: argparse.Namespace, out: Path, checkpoint_dir: Path, device, bf16: bool, eval_fn) -> Path:
    """The body of `train_demo_drafter` once its outputs are locked: build, train, keep the best, save."""
    import shutil

    import torch

    from models.drafter import load_drafter, save_drafter
    from prune.training.loop import TrainConfig, train

    manifests = [read_manifest(folder) for folder in args.data]
    manifest = manifests[0]
    if args.init_from:
        # Start from a saved drafter (e.g. one built here with the PCA embedding, trained on another machine).
        model, init_note, tokenizer_dir = load_drafter(args.init_from), f"from {args.init_from}", Path(args.init_from)
        params = sum(p.numel() for p in model.parameters())
    else:
        model, init_note, params = build_initial_drafter(args)
        tokenizer_dir = Path(args.target or manifest.get("target") or "")
    print(f"embedding init: {init_note}", file=sys.stderr)

    heldout, training = split_examples(args.data, data_weights(args), args.eval_size, args.seed, args.partial_data,
                                       args.eval_data)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        warmup_steps=args.warmup_steps, blocks_per_sequence=args.blocks_per_sequence, max_length=args.max_length,
        gamma=args.gamma, ar_weight=args.ar_weight, seed=args.seed, bf16=bf16, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, checkpoint_dir=str(checkpoint_dir), progress=not args.no_progress,
        max_seconds=args.max_seconds,
    )
    start = time.perf_counter()
    if eval_fn is None and args.eval_tau:
        from models.target import load_tokenizer

        eos = load_tokenizer(tokenizer_dir).eos_token_id
        eval_fn = replay_tau(heldout, args.eval_tau, manifest["max_new_tokens"], (eos,))
    callback = heldout_callback(heldout, config, eval_fn)
    best = None
    if args.keep_best:
        from prune.training.loop import CHECKPOINT_STATE

        best = BestWeights(checkpoint_dir, resuming=(checkpoint_dir / CHECKPOINT_STATE).is_file())
        callback = best.wrap(callback)
    history = train(model, training, config, callback=callback, device=device)
    seconds = time.perf_counter() - start
    kept = best.restore(model) if best else {}
    if kept:
        print(f"kept the weights of step {kept['step']} (held-out accept proxy {kept[best.metric]:.3f})",
              file=sys.stderr)
    final = next((r for r in reversed(history) if "eval_slot_acc" in r), {})
    provenance = {
        "what": "d3d-prune demo drafter, trained from scratch by prune.train_drafter",
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out", "overwrite", "no_progress") and not callable(v)},
        "train_config": {k: v for k, v in vars(config).items()},
        "device": str(device), "torch_version": torch.__version__, "parameters": params,
        "embedding_init": init_note, "data_manifest": manifest, "train_sequences": len(training),
        **({"data_manifests": dict(zip(args.data, manifests))} if len(args.data) > 1 else {}),
        "heldout_sequences": len(heldout), "train_seconds_this_call": round(seconds, 1), "final_eval": final,
        **({"kept_best": kept} if best else {}),
        "history": [r for r in history if r["step"] % max(1, args.steps // 500) == 0 or "eval_slot_acc" in r],
    }
    folder = save_drafter(model.float().cpu(), out, tokenizer_source=tokenizer_dir, overwrite=args.overwrite,
                          dtype=torch.bfloat16,
                          extra_files={"training.json": json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n"})
    if not args.keep_checkpoints:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        if best:
            best.file.unlink(missing_ok=True)
    print(f"saved the drafter to {folder}", file=sys.stderr)
    return folder


DESCRIPTION = "Train a block-diffusion drafter from scratch on distillation data of its target."


def build_parser() -> argparse.ArgumentParser:
    from prune.commands._common import Parser

    parser = Parser(
        prog="python -m prune.train_drafter", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=DESCRIPTION,
    )
    add_arguments(parser)
    return parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `prune train-drafter` (also `python -m prune.train_drafter`)."""
    from prune.commands import _types as t

    d = DEFAULTS
    p.add_argument("--data", type=t.data_dir, required=True, nargs="+",
                   help="distillation data folder(s) (prune distill output)")
    p.add_argument("--data-weights", type=t.positive_int, nargs="+", default=None,
                   help="repeat each --data folder's training sequences this many times (default: 1 each)")
    p.add_argument("--out", type=t.output_dir, default=None,
                   help="output drafter folder (must not exist, or use --overwrite)")
    p.add_argument("--target", type=t.target_path, default=None,
                   help="target model folder (default: the one named in the data manifest)")
    p.add_argument("--steps", type=t.positive_int, default=d["steps"], help="optimizer updates")
    p.add_argument("--batch-size", type=t.positive_int, default=d["batch_size"], help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=t.positive_int, default=d["grad_accum"], help="micro-batches per update")
    p.add_argument("--lr", type=t.positive_float, default=d["lr"], help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=t.non_negative_int, default=d["warmup_steps"], help="linear warmup updates")
    p.add_argument("--blocks-per-sequence", type=t.positive_int, default=d["blocks_per_sequence"],
                   help="mask blocks at random anchors per sequence")
    p.add_argument("--max-length", type=t.positive_int, default=d["max_length"],
                   help="crop sequences to this many tokens")
    p.add_argument("--gamma", type=t.positive_float, default=d["gamma"],
                   help="slot weight decay w_i = exp(-(i-1)/gamma)")
    p.add_argument("--ar-weight", type=t.non_negative_float, default=d["ar_weight"],
                   help="lambda, weight of the AR loss")
    p.add_argument("--seed", type=t.non_negative_int, default=d["seed"],
                   help="seeds weights, data split, batches and anchors")
    p.add_argument("--layers", type=t.positive_int, default=d["layers"], help="decoder layers")
    p.add_argument("--hidden-size", type=t.positive_int, default=d["hidden_size"], help="model width")
    p.add_argument("--intermediate-size", type=t.positive_int, default=d["intermediate_size"], help="MLP width")
    p.add_argument("--heads", type=t.positive_int, default=d["heads"], help="attention heads")
    p.add_argument("--kv-heads", type=t.positive_int, default=d["kv_heads"], help="key/value heads")
    p.add_argument("--head-dim", type=t.positive_int, default=d["head_dim"], help="width of one head")
    p.add_argument("--block-size", type=t.block_size, default=d["block_size"], help="B, mask slots per block")
    p.add_argument("--init", choices=("slice", "pca", "random"), default="slice",
                   help="slice: start every layer from the target (one rotation of its residual stream, one key/value "
                   "group, the strongest MLP neurons; models.transplant); pca: only the embedding from the target's "
                   "(PCA projection); random: nothing from the target")
    p.add_argument("--calibration-sequences", type=t.positive_int, default=48,
                   help="--init slice: data sequences whose target activations choose the rotation, heads and neurons")
    p.add_argument("--init-from", type=t.drafter_dir, default=None,
                   help="start from this drafter folder instead of building one (sizes and --init ignored)")
    p.add_argument("--save-initial", type=t.output_dir, default=None,
                   help="only build the initial drafter (with its embedding init) and save it here, then exit")
    p.add_argument("--eval-tau", type=t.non_negative_int, default=0,
                   help="also measure real tau (async decoder, replayed trajectories) on this many held-out "
                   "sequences at every evaluation (0: off)")
    p.add_argument("--partial-data", action="store_true",
                   help="train on the finished shards of a distillation run that is still going")
    p.add_argument("--max-seconds", type=t.non_negative_float, default=0.0,
                   help="stop training once this call has run this long (0: no limit)")
    p.add_argument("--max-mb", type=t.positive_float, default=60.0, help="refuse drafters larger than this in bfloat16")
    p.add_argument("--eval-size", type=t.non_negative_int, default=d["eval_size"],
                   help="held-out sequences for evaluation")
    p.add_argument("--eval-data", type=t.data_dir, default=None,
                   help="draw the held-out sequences from this distillation folder instead of from --data (any "
                   "training sequence equal to one is dropped); e.g. fresh data when continuing a drafter")
    p.add_argument("--keep-best", action="store_true",
                   help="save the weights of the evaluation with the best held-out accept proxy, not the last")
    p.add_argument("--eval-every", type=t.non_negative_int, default=d["eval_every"],
                   help="evaluate every N updates (0: at the end)")
    p.add_argument("--checkpoint-every", type=t.non_negative_int, default=d["checkpoint_every"],
                   help="checkpoint every N updates (0: at the end)")
    p.add_argument("--checkpoint-dir", type=t.output_dir, default=None,
                   help="checkpoint folder (default: OUT-checkpoints); "
                   "an interrupted run with the same flags resumes from it")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoint folder after saving")
    p.add_argument("--device", type=t.device_or_auto, default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (default: on for CUDA, off for CPU)")
    p.add_argument("--threads", type=t.non_negative_int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from models.errors import D3DError

    try:
        train_demo_drafter(args)
    except D3DError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
