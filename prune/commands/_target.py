"""The target side of `prune score`, `prune run` and `prune sweep`: where the target's trajectories and pass
times come from (`--ar-outputs`, `--pass-times`), the decoder that measures the drafter (`--decoder`), and
loading the target's weights only for what needs them (prune.trajectories)."""

import json
import sys

from prune.config import DEFAULT_DECODER, SCORING_DECODERS

from . import _types

PASS_TIMES_FIX = ("give the pair's pass times as `prune bench --json` reports them (settings.pass_times), or a "
                  "PassTimes record {\"ar_ms\", \"per_token_ms\", \"draft_ms\", \"packed_ms\", ...}")


def add_target_args(parser) -> None:
    """--decoder, --ar-outputs and --pass-times."""
    parser.add_argument("--decoder", choices=SCORING_DECODERS, default=DEFAULT_DECODER,
                        help="the speculative decoder whose tau (and predicted speedup) scores layers: async is "
                        "D3D's; sync drafts and verifies in turn, as engines that serve drafters one round after "
                        "the other (vLLM, SGLang) do")
    parser.add_argument("--ar-outputs", metavar="FILE.jsonl", default=None, type=_types.text_file,
                        help="take the target's greedy outputs from FILE instead of decoding them: one JSON record "
                        "per prompt with output_ids, and prompt_ids and/or id (prune bench --decoder ar "
                        "--save-outputs writes one; so can another engine); replayed scoring then reads the "
                        "target's tokenizer and config only, never its weights")
    parser.add_argument("--pass-times", metavar="FILE.json", default=None, type=_types.text_file,
                        help="the pair's pass times from FILE (the settings.pass_times of `prune bench --json`, "
                        "measured with the target on the decoding machine) instead of measuring them: where "
                        "--ar-outputs leaves the target unloaded, the adaptive width, the speedup criterion and "
                        "predicted speedups need them (without: fixed widths, tau only)")


def target_weights_needed(args) -> bool:
    """Whether a command's target weights load at the start: always, unless its outputs are recorded
    (--ar-outputs) and nothing measures with the live target (--verify replay)."""
    return not getattr(args, "ar_outputs", None) or getattr(args, "verify", "replay") == "live"


def note_target_weights(args, loaded: bool) -> None:
    """Say on stderr what --ar-outputs does to the target's weights."""
    if not getattr(args, "ar_outputs", None):
        return
    if loaded:
        _log(f"--verify live runs the target in every evaluation: loading its weights ({args.ar_outputs} supplies "
             "the recorded trajectories)")
    else:
        _log(f"the target's outputs come from {args.ar_outputs}: its weights are not loaded (tokenizer and config "
             "only)")


def trajectory_source(args, pair, prompts):
    """Where the command's trajectories come from (prune.trajectories): the file of --ar-outputs, matched to
    `prompts` (every decode.prompts.Prompt the command decodes, in order), or the pair's live target."""
    from prune.trajectories import LiveTarget, RecordedFile

    if getattr(args, "ar_outputs", None):
        return RecordedFile.open(args.ar_outputs, prompts, pair.target_config, pair.target)
    return LiveTarget(pair.target)


def given_pass_times(args, pair, drafters: list, log=None) -> list | None:
    """The pass times of each of `drafters` where the command does not measure them with the target: read from
    --pass-times, else, where the target is not loaded, the pinned ones (decode.timing.pinned_times), else None
    each, with a note; None where they are measured with the loaded target."""
    from decode.timing import pinned_times

    from ._common import drafter_path

    if getattr(args, "pass_times", None):
        return [read_pass_times(args.pass_times, drafter_path(args))] * len(drafters)
    if pair.target is not None:
        return None
    pinned = pinned_times()
    if pinned is not None:
        return [pinned.for_drafter(drafter, args.packed_budget) for drafter in drafters]
    fixed = "every round verifies the full block and drafts every candidate (as --width fixed --candidates all)"
    (log or _log)(f"note: no pass times (the target's weights are not loaded): {fixed}, and no speedup is "
                  "predicted; --pass-times FILE.json gives them")
    return [None] * len(drafters)


def read_pass_times(path: str, drafter_dir: str | None = None):
    """The decode.cost.PassTimes in the JSON file `path`: a PassTimes record, a `prune bench --json` report, or
    its settings.pass_times ({drafter folder: record}; with several, `drafter_dir`'s). DataError otherwise."""
    from pathlib import Path

    from decode.cost import PassTimes
    from models.errors import DataError

    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read pass times from {path} ({exc}); {PASS_TIMES_FIX}") from None
    if isinstance(document, dict) and isinstance(document.get("settings"), dict):
        document = document["settings"].get("pass_times")  # a whole bench report
    if isinstance(document, dict) and "ar_ms" not in document and document:
        records = {name: value for name, value in document.items() if isinstance(value, dict)}
        if len(records) > 1 and drafter_dir not in records:
            raise DataError(f"{path} holds the pass times of {', '.join(sorted(records))}, none of {drafter_dir}; "
                            "pass a file of this drafter's")
        document = records.get(drafter_dir) if len(records) > 1 else next(iter(records.values()), None)
    try:
        return PassTimes(**document)
    except TypeError as exc:
        raise DataError(f"{path} is not a pass-times record ({exc}); {PASS_TIMES_FIX}") from None


def check_pass_times(criterion: str, times) -> None:
    """A ConfigError, before anything runs, where the criterion needs pass times that the command has none of."""
    from models.errors import ConfigError
    from prune.criteria import CRITERIA

    if times is None and CRITERIA[criterion].needs_speedup:
        raise ConfigError(f"the {criterion} criterion needs the target's pass times, and with --ar-outputs the "
                          "target is not loaded to measure them; give --pass-times FILE.json or another --criterion")


def target_for(args, pair, target_path: str, why: str):
    """The pair's loaded target, or, where --ar-outputs left it unloaded, the target loaded now for `why` (said on
    stderr), in the command's dtype on its device."""
    from models.target import load_target

    from ._common import resolve_device, torch_dtype

    if pair.target is not None:
        return pair.target
    _log(f"loading the target's weights for {why} (--ar-outputs served scoring without them)")
    device = resolve_device(args.device)
    return load_target(target_path, torch_dtype(args.dtype, device), device)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
