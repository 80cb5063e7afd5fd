"""Cache keys and the JSON cache: one key function per cached thing, used by every command that caches it.

The cache folder (`--cache-dir`, models._wheels.resolve_cache_dir) holds, each under its own subfolder:

    trajectories/KEY.json   the target's greedy trajectories of a prompt set (replayed verification)
    pass-times/KEY.json     the pair's pass times (decode.cost.PassTimes; adaptive width, cost model)
    timing/KEY.json         a campaign's timing: those pass times and the drafter's cost per layer
    scores/KEY.json         a scoring round's ScoreReport

A key fingerprints everything its value depends on, models by their weights, dtype and device (near-tie
argmaxes and pass times differ across them). `prune score`, `prune run` and every sweep trial build keys
with these functions from the same settings, so they share entries: a `prune run` after a `prune score` of
the same drafter, prompts and settings takes its first scoring round from the cache. Scores are written by
`prune score` only; a campaign reads them (its own rounds are kept by its journal, prune.journal, so that a
resumed run continues its own round rather than another run's).
"""

import hashlib
import json
import platform
from dataclasses import asdict
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


def trajectory_key(target, prompts: list[list[int]], decode) -> str:
    """The key of recorded target trajectories: the target's weights, dtype and device, the prompts and the
    stop rule (decode: a decode.config.DecodeConfig)."""
    return fingerprint("trajectories", *model_identity(target), prompts, decode.max_new_tokens,
                       sorted(decode.stop_ids))


def pass_times_key(drafter, target, decode) -> str:
    """The key of the pair's measured pass times: both models with their dtypes and devices, the threads, the
    decoder settings that shape the passes and the machine (its GPU's name where the target is on one). v4:
    the ar step is read off the verify line (decode.timing.verify_line); v5: the lean forward's stacked
    products (models.lean.stacked) and the target's measured choice of them changed every pass time, and
    the target's one-token step is measured apart from wider passes (PassTimes.step_ms); v6: the drafter's
    fused form (models.lean.LeanDecoder, `fused`) and grouped top-k (decode.engine.top_k) changed its pass
    times. Older records are measured again."""
    device = next(target.parameters()).device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return fingerprint("pass-times v6", *model_identity(drafter), *model_identity(target), torch.get_num_threads(),
                       decode.packed_budget, decode.draft_threads, decode.block_size, platform.machine(),
                       platform.processor(), gpu, torch.__version__)


def timing_key(drafter, target, decode, repeats: int, times: dict | None) -> str:
    """The key of a campaign's timing (prune.state.Timing) of `drafter` with `target`: the pass-times key,
    the timed repeats and the pair's pass times it starts from (`times`: a PassTimes as a dict, or None). v4:
    the timing holds the head term (decode.cost.LayerCost); older entries are measured again."""
    return fingerprint("campaign-timing v4", pass_times_key(drafter, target, decode), repeats, times)


def score_key(drafter, target, prompts: list[list[int]], config, timing: dict) -> str:
    """The key of a scoring round's report: the drafter (weights, dtype, device), the target and prompts
    (`trajectory_key`: weights, dtype, device, prompts, stop rule), every setting of `config` (a
    prune.config.ScoreConfig) and the campaign timing the scores' pass times come from (as a dict).
    The same in `prune score`, `prune run` and every sweep trial."""
    return fingerprint("scores v2", *model_identity(drafter), trajectory_key(target, prompts, config.decode), prompts,
                       asdict(config), timing)


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
