"""Cache keys and the JSON cache: one key function per cached thing, used by every command that caches it.

The cache folder (`--cache-dir`, models._wheels.resolve_cache_dir) holds, each under its own subfolder:

    trajectories/KEY.json   the target's greedy trajectories of a prompt set (replayed verification)
    pass-times/KEY.json     the pair's pass times (decode.cost.PassTimes; adaptive width, cost model)
    timing/KEY.json         a campaign's timing: those pass times and the drafter's cost per layer
    scores/KEY.json         a scoring round's ScoreReport

A key fingerprints everything its value depends on, models by their weights, dtype and device (near-tie
argmaxes and pass times differ across them). The target enters a key as its trajectory source's identity
(prune.trajectories): a loaded target by its weights, dtype and device as any model; a recorded file of its
outputs, whose target's weights are never loaded, by the file's content and the target's config. `prune
score`, `prune run` and every sweep trial build keys with these functions from the same settings, so they
share entries: a `prune run` after a `prune score` of
the same drafter, prompts and settings takes its first scoring round from the cache. Scores are written by
`prune score` only; a campaign reads them (its own rounds are kept by its journal, prune.journal, so that a
resumed run continues its own round rather than another run's).
"""

import hashlib
import json
import platform
from pathlib import Path

import torch

from models.checkpoint import atomic_write_text
from models.draft_vocab import BUFFER as DRAFT_VOCAB_BUFFER


_WEIGHTS_DIGEST = "_d3d_weights_digest"  # where a module keeps the digest of its weights


def fingerprint(*parts) -> str:
    """A stable sha256 over JSON-able parts and modules' weights (for cache keys). A module alone gives the
    sha256 of its weights' names and bytes (the drafter hash that reports carry)."""
    if len(parts) == 1 and isinstance(parts[0], torch.nn.Module):
        return _weights_digest(parts[0])
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.nn.Module):
            digest.update(_weights_digest(part).encode())
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _weights_digest(module: torch.nn.Module) -> str:
    """sha256 of a module's state (names and bytes) and of its draft vocabulary (models/draft_vocab.py: a
    drafter proposing from fewer ids is another drafter), kept on the module while no tensor moves or changes
    in place: one command keys several caches by the same target and drafter, and hashing a target's
    weights takes seconds. A change made through `.data` moves neither and is not seen: hash a model
    after such a change (a merged heal) only as a fresh copy."""
    state = sorted(module.state_dict().items())
    ids = getattr(module, DRAFT_VOCAB_BUFFER, None)
    if ids is not None:  # a non-persistent buffer: not in the state dict
        state.append((DRAFT_VOCAB_BUFFER, ids))
    key = tuple((tensor.data_ptr(), tensor._version) for _, tensor in state)
    cached = getattr(module, _WEIGHTS_DIGEST, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    digest = hashlib.sha256()
    for name, tensor in state:
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    object.__setattr__(module, _WEIGHTS_DIGEST, (key, digest.hexdigest()))
    return getattr(module, _WEIGHTS_DIGEST)[1]


def model_identity(model: torch.nn.Module) -> list[str]:
    """[weights sha256, dtype, device] of a model: what a key holds of it."""
    weight = next(model.parameters())
    return [fingerprint(model), str(weight.dtype), str(weight.device)]


def target_identity(target) -> list[str]:
    """What a key holds of the target side: a loaded target's `model_identity`, or a trajectory source's own
    identity (prune.trajectories.TrajectorySource; a live target's is its model's)."""
    return model_identity(target) if isinstance(target, torch.nn.Module) else list(target.identity())


def loaded_target(target) -> torch.nn.Module | None:
    """The loaded target model of `target` (a model, or a trajectory source that may hold one)."""
    return target if isinstance(target, torch.nn.Module) else target.target


def trajectory_key(target, prompts: list[list[int]], decode) -> str:
    """The key of recorded target trajectories: the target side (`target_identity`: a loaded target's
    weights, dtype and device), the prompts and the stop rule (decode: a decode.config.DecodeConfig)."""
    return fingerprint("trajectories", *target_identity(target), prompts, decode.max_new_tokens,
                       sorted(decode.stop_ids))


def pass_times_key(drafter, target, decode) -> str:
    """The key of the pair's measured pass times: both models with their dtypes and devices, the threads, the
    decoder settings that shape the passes and the machine (its GPU's name where the target is on one). v4:
    the ar step is read off the verify line (decode.timing.verify_line); v5: the lean forward's stacked
    products (models.lean.stacked) and the target's measured choice of them changed every pass time, and
    the target's one-token step is measured apart from wider passes (PassTimes.step_ms); v6: the drafter's
    fused form (models.lean.LeanDecoder, `fused`) and grouped top-k (decode.engine.top_k) changed its pass
    times. Older records are measured again. Pinned pass times (decode.timing.pinned_times) are part of the
    key, so a pinned record never stands in for a measured one or the reverse. `target`: a loaded target, or a
    trajectory source (a recorded file's, without a loaded target: the drafter's device stands in for the
    target's)."""
    from decode.timing import pinned_times

    loaded = loaded_target(target)
    device = next((loaded if loaded is not None else drafter).parameters()).device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    pinned = pinned_times()
    return fingerprint("pass-times v6", *model_identity(drafter), *target_identity(target), torch.get_num_threads(),
                       decode.packed_budget, decode.draft_threads, decode.block_size, platform.machine(),
                       platform.processor(), gpu, torch.__version__,
                       *(["pinned", pinned.to_dict()] if pinned else []))


def timing_key(drafter, target, decode, repeats: int, times: dict | None) -> str:
    """The key of a campaign's timing (prune.state.Timing) of `drafter` with `target`: the pass-times key,
    the timed repeats and the pair's pass times it starts from (`times`: a PassTimes as a dict, or None). v4:
    the timing holds the head term (decode.cost.LayerCost); older entries are measured again."""
    return fingerprint("campaign-timing v4", pass_times_key(drafter, target, decode), repeats, times)


def score_key(drafter, target, prompts: list[list[int]], config, timing: dict) -> str:
    """The key of a scoring round's report: the drafter (weights, dtype, device), the target and prompts
    (`trajectory_key`: the target side, prompts, stop rule), every setting of `config` (a
    prune.config.ScoreConfig; its decoder where it is not the default, which keys as before that setting
    existed) and the campaign timing the scores' pass times come from (as a dict).
    The same in `prune score`, `prune run` and every sweep trial."""
    return fingerprint("scores v2", *model_identity(drafter), trajectory_key(target, prompts, config.decode), prompts,
                       config.key_record(), timing)


def cached_json(folder: Path | None, key: str, compute, store: bool = True):
    """`compute()` once per key: the JSON result is kept in `folder/key.json` (written atomically; with
    `store` False an entry is read but none is written)."""
    if folder is None:
        return compute()
    file = Path(folder) / f"{key}.json"
    if file.is_file():
        return json.loads(file.read_text())
    result = compute()
    if store:
        atomic_write_text(file, json.dumps(result, sort_keys=True))
    return result
