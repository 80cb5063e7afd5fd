"""Distillation data folders: the target's own greedy answers to training prompts, written and read back.

The prompts come from `prune.training.prompts` (real text that no evaluation suite uses, the suites'
training parts, or templates of our own). Responses are the target's greedy continuations of the
chat-templated prompt (templated exactly as the decoders do it, through `decode.prompts.tokenize_records`), batched with left
padding, cut after the first EOS or at `max_new_tokens`. Output folder:

    manifest.json        settings; a restart with other settings is refused
    shard-00000.jsonl    one record per prompt: id, source, prompt, prompt_ids, response_ids, stopped
    ...                  each shard is written atomically; a restarted run skips finished shards

Read back, a folder's records become training `Example`s (`load_examples`), and several folders of one
target a held-out and a training list (`split_examples`).
"""

import hashlib
import json
import os
from pathlib import Path

from decode.prompts import read_jsonl

from .prompts import STYLES, select_training_prompts

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# The defaults of `generate_distillation_data`, which `prune distill` shows and uses.
DISTILL_DEFAULTS = dict(num_prompts=2000, max_new_tokens=128, batch_size=16, shard_size=64, dtype="bfloat16", seed=0,
                        style=STYLES[0])


def shard_file(folder: str | os.PathLike, n: int) -> Path:
    """Shard `n` of a distillation folder (`shard-00000.jsonl`, ...)."""
    return Path(folder) / f"shard-{n:05d}.jsonl"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def generate_distillation_data(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    num_prompts: int = DISTILL_DEFAULTS["num_prompts"],
    max_new_tokens: int = DISTILL_DEFAULTS["max_new_tokens"],
    batch_size: int = DISTILL_DEFAULTS["batch_size"],
    device: str = "cpu",
    dtype: str = DISTILL_DEFAULTS["dtype"],
    seed: int = DISTILL_DEFAULTS["seed"],
    shard_size: int = DISTILL_DEFAULTS["shard_size"],
    progress: bool = True,
    stdlib_dir: str | os.PathLike | None = None,
    style: str = DISTILL_DEFAULTS["style"],
) -> Path:
    """Generate (or finish) a distillation data folder; returns `out_dir`.

    Args:
        target_dir: a target model folder with tokenizer files (e.g. `models.demo.resolve_demo_target()`).
        num_prompts: training prompts; max_new_tokens: response cap (responses stop earlier at EOS).
        batch_size: prompts per `generate` call; device, dtype ("float32" / "bfloat16"): where it runs.
        seed, style: select the prompts (see `prune.training.prompts.collect_training_prompts`).
        shard_size: prompts per shard file (the unit of resumption).

    Holds the lock of `out_dir` (models.lock) while it runs: a second generation into the same folder fails
    at once. Responses are greedy and shards are written atomically, so a generation killed at any moment
    and rerun ends with the same files as one never interrupted.
    """
    import torch

    from decode.prompts import tokenize_records
    from models.checkpoint import atomic_write_text
    from models.shards import weights_sha256
    from models.errors import ConfigError, DataError
    from models.lock import output_lock
    from models.target import load_tokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {', '.join(dtypes)} (--dtype)")
    if min(num_prompts, max_new_tokens, batch_size, shard_size) < 1:
        raise ConfigError("num_prompts, max_new_tokens, batch_size and shard_size must all be >= 1")
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    with output_lock(out_dir):
        tokenizer = load_tokenizer(target_dir)
        if tokenizer is None:
            raise DataError(f"target {target_dir} has no tokenizer files; distillation needs the target's tokenizer")
        prompts, eval_texts = select_training_prompts(num_prompts, seed, stdlib_dir, style)
        settings = {
            "format": FORMAT_VERSION,
            "target_weights_sha256": weights_sha256(target_dir),  # one file's, or the shards' together
            "num_prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "dtype": dtype,
            "seed": seed,
            "style": style,
            "shard_size": shard_size,
            "prompts_sha256": _digest([p["prompt"] for p in prompts]),
        }
        _check_manifest(out_dir, settings)
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {**settings, "target": str(target_dir), "eval_filter": eval_texts is not None,
                  "eval_prompts_checked": len(eval_texts or []), "shards": -(-len(prompts) // shard_size)}
        atomic_write_text(out_dir / MANIFEST, json.dumps(record, indent=2, sort_keys=True) + "\n")
        records = [{**p, "prompt_ids": ids.input_ids}
                   for p, ids in zip(prompts, tokenize_records([{"id": p["id"], "prompt": p["prompt"]} for p in prompts],
                                                               tokenizer))]
        shards = [records[i : i + shard_size] for i in range(0, len(records), shard_size)]
        _answer_shards(target_dir, out_dir, shards, tokenizer, dtypes[dtype], device, max_new_tokens, batch_size,
                       progress)
    return out_dir


def _check_manifest(out_dir: Path, settings: dict) -> None:
    """Refuse a folder whose manifest records other settings (a restart must finish the same data)."""
    from models.errors import CheckpointError

    old = read_manifest(out_dir)
    if not old:
        return
    changed = sorted(k for k in settings if old.get(k, "general" if k == "style" else None) != settings[k])
    if changed:
        raise CheckpointError(f"{out_dir} holds distillation data made with other settings ({', '.join(changed)});"
                              " rerun with the same settings to finish it, or choose another output folder")


def _answer_shards(target_dir: Path, out_dir: Path, shards: list[list[dict]], tokenizer, dtype, device,
                   max_new_tokens: int, batch_size: int, progress: bool) -> None:
    """Answer the prompt records of every shard not yet on disk with the target and write each shard file."""
    from models.checkpoint import atomic_write_text
    from models.pair import stop_ids_of
    from models.target import load_target
    from prune.progress import progress_bar

    todo = [n for n in range(len(shards)) if not shard_file(out_dir, n).is_file()]
    if not todo:
        return
    model = load_target(target_dir, dtype=dtype, device=device)
    eos = list(stop_ids_of(model, tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    done = sum(len(shards[n]) for n in range(len(shards)) if n not in todo)
    with progress_bar("distill", sum(map(len, shards)), progress) as advance:
        advance(done)
        for n in todo:
            shard = shards[n]
            order = sorted(range(len(shard)), key=lambda i: len(shard[i]["prompt_ids"]))
            for start in range(0, len(order), batch_size):
                rows = [shard[i] for i in order[start : start + batch_size]]
                responses = _generate(model, [r["prompt_ids"] for r in rows], max_new_tokens, eos, pad_id, device)
                for row, (ids, stopped) in zip(rows, responses):
                    row["response_ids"], row["stopped"] = ids, stopped
                advance(len(rows))
            atomic_write_text(shard_file(out_dir, n), "".join(json.dumps(r) + "\n" for r in shard))


def _generate(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad_id: int, device):
    """Greedy responses `[(ids, stopped_at_eos)]` for a left-padded batch of prompt id lists."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, ids in enumerate(prompts):
        input_ids[r, width - len(ids) :] = torch.tensor(ids)
        attention[r, width - len(ids) :] = 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad_id)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             generation_config=config)
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, tok in enumerate(row) if tok in eos), None)
        results.append((row[: cut + 1], True) if cut is not None else (row, False))
    return results


def load_distillation_data(folder: str | os.PathLike, partial: bool = False) -> list[dict]:
    """All records of a finished distillation folder, in prompt order.

    Args:
        partial: accept an unfinished folder and return the leading run of finished shards.
    """
    from models.errors import DataError

    folder = Path(folder)
    manifest = read_manifest(folder)
    if not manifest:
        raise DataError(f"{folder} has no {MANIFEST}; generate distillation data there first")
    records = []
    for n in range(manifest["shards"]):
        shard = shard_file(folder, n)
        if not shard.is_file():
            if partial and records:
                break
            raise DataError(f"{folder} is incomplete ({shard.name} is missing); rerun the generation to finish it")
        records += [record for _, record in read_jsonl(shard)]
    return records


def training_prompt_set(folder: str | os.PathLike, partial: bool = False) -> dict:
    """The prompts of a distillation folder as one set of a drafter's training record (models/provenance.py),
    named after the folder; `partial` as in `load_distillation_data` (what a `--partial-data` run read)."""
    from models.provenance import prompt_set

    return prompt_set(Path(folder).name, [record.get("prompt") or "" for record in load_distillation_data(folder, partial)])


def distillation_summary(folder: str | os.PathLike) -> dict:
    """What a distillation folder holds: its manifest's settings, finished shards (of `shards`), responses,
    response tokens and the share of responses that ended at EOS (the rest hit `max_new_tokens`)."""
    records = load_distillation_data(folder, partial=True)  # refuses a folder without a manifest
    manifest = read_manifest(folder)
    done = sum(shard_file(folder, n).is_file() for n in range(manifest["shards"]))
    tokens = sum(len(r["response_ids"]) for r in records)
    return {**manifest, "folder": str(folder), "shards_finished": done, "responses": len(records),
            "response_tokens": tokens, "stopped_at_eos": round(sum(bool(r.get("stopped")) for r in records)
                                                               / max(len(records), 1), 4)}


def read_manifest(folder: str | os.PathLike) -> dict:
    """The distillation folder's manifest.json (settings and target path), or {} when it has none."""
    file = Path(folder) / MANIFEST
    return json.loads(file.read_text()) if file.is_file() else {}


def load_examples(folder: str | os.PathLike, partial: bool = False):
    """Distillation records as training `Example`s (prompt unsupervised, response supervised)."""
    from .loss import Example

    records = load_distillation_data(folder, partial)
    return [Example.from_prompt_response(r["prompt_ids"], r["response_ids"]) for r in records if r["response_ids"]]


def split_examples(folders: list, weights: list[int], eval_size: int, seed: int, partial: bool = False,
                   eval_folder: str | Path | None = None):
    """(held-out, training) `Example` lists from several distillation folders of one target.

    The held-out sequences are drawn (seeded) from all folders together before weighting; a training
    sequence of a folder with weight w appears w times. With `eval_folder` they are drawn from that folder
    instead (e.g. data that an earlier training run never saw, whose held-out draw changes as folders are
    added). Either way every training sequence whose prompt is a held-out one's is dropped: folders of one
    target repeat prompts (two seeds of a prompt style share much of their pool), and a repeated prompt's
    response is the same greedy answer or, made in another dtype or on another CPU, one that differs only
    after a near-tie, so it would otherwise be trained on (the drafter card counts such a leak).
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
    held = {_prompt_key(ex) for ex in heldout}
    rest = [tagged[i] for i in order[eval_size:]] if eval_folder is None else tagged
    return heldout, [ex for ex, w in rest if _prompt_key(ex) not in held for _ in range(w)]


def _prompt_key(example) -> tuple[int, ...]:
    """The prompt ids of an `Example` (its unsupervised tokens), as a hashable key."""
    return tuple(example.input_ids[~example.loss_mask].tolist())
