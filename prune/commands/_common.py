"""Arguments and helpers shared by several commands (one place for their defaults and help)."""

import argparse
import contextlib
import json
import os
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from decode.config import CANDIDATE_MODES, GATE_MODES, WIDTH_MODES, DecodeConfig
from prune.config import ScoreConfig
from prune.tracking import TrackingConfig, default_dir, drafter_tag, resolve_mode, tracker_for

from . import _help, _settings, _types
from ._checkpoint_args import add_drafter_key_args, drafter_keys

DTYPES = ("float32", "bfloat16", "float16")


def defaults(config_class) -> dict:
    """The default of every field of a settings dataclass that has a plain one: the flags show the
    defaults the library uses (decode.config, prune.config, sweeps.config; none of them imports torch)."""
    return {f.name: f.default for f in fields(config_class) if f.default is not MISSING}


DECODE, TRACKING, SCORE = defaults(DecodeConfig), defaults(TrackingConfig), defaults(ScoreConfig)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default (`none` for an optional value left unset) unless the help already states it,
    keeps the examples' line breaks (wrapping only lines wider than the terminal), and lists the expert flags
    of a usage line as one `[expert options]` (prune/commands/_help.py)."""

    def _fill_text(self, text, width, indent):
        return _help.fill_lines(text, width, indent)

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.required or not action.option_strings:
            return action.help
        if action.default is None:
            return action.help if action.nargs == 0 else f"{action.help} (default: none)"
        return super()._get_help_string(action)

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, _help.usage_actions(list(actions)), groups, prefix)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr that points at --help (exit 2).

    Once every flag is read, each drafter folder flag (type _types.drafter_dir) is checked to name a drafter:
    its config.json has the drafter keys, or the command's --block-size / --mask-token-id give the missing
    ones (add_drafter_key_args), which a type reading one value cannot see. A command with settings reads its
    --config file here too (prune/commands/_settings.py), so that the flags given override it. Its --help lists
    the command's first flags, then the expert ones (prune/commands/_help.py)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")

    def format_help(self):
        _help.group_options(self, getattr(self, "common", _help.COMMON))
        return super().format_help()

    def format_usage(self):
        _help.group_options(self, getattr(self, "common", _help.COMMON))
        return super().format_usage()

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "config", None) and getattr(self, "settings", None):
            _settings.read_config(self, self.settings, namespace, sys.argv[1:] if args is None else list(args))
        for action in self._actions:
            if action.type is not _types.drafter_dir:
                continue
            value = getattr(namespace, action.dest, None)
            for folder in value if isinstance(value, list) else [value]:
                problem = folder and _types.drafter_key_problem(folder, drafter_keys(namespace, folder),
                                                                getattr(namespace, "drafter_key_flags", {}))
                if problem:
                    self.error(f"argument {argparse._get_action_name(action)}: {problem}")
        return namespace, extras


def add_command(subparsers, name: str, help: str, description: str, common: tuple[str, ...] = _help.COMMON):
    """The parser of command `name`: its --help lists the flags of `common` first (prune/commands/_help.py) and
    the others as expert options; a command with settings (_settings.BINDINGS) reads --config FILE.toml."""
    parser = subparsers.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)
    parser.common = common
    if name in _settings.BINDINGS:
        parser.settings = name
        _settings.add_config_arg(parser, name)
    return parser


def add_debug(parser) -> None:
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def add_model_args(parser, target: bool = True, several_drafters: bool = False, block_size: bool = True) -> None:
    """--drafter (with the drafter key flags, add_drafter_key_args; `block_size` as there), --target, dtypes, device."""
    add_drafter_key_args(parser, block_size)
    if several_drafters:
        parser.add_argument("--drafter", action="append", default=None, metavar="DIR", type=_types.drafter_dir,
                            help="drafter checkpoint folder; repeat to compare several drafters against one ar "
                            "run (default: the demo drafter)")
    else:
        parser.add_argument("--drafter", default=None, metavar="DIR", type=_types.drafter_dir,
                            help="drafter checkpoint folder (default: the demo drafter)")
    if target:
        parser.add_argument("--target", default=None, type=_types.target_path,
                            help="target model folder or .gguf file (default: the demo target, SmolLM2-135M-Instruct)")
        parser.add_argument("--cache-dir", default=None, type=_types.output_dir,
                            help="where the demo target and suite data are cached "
                            "(default: $D3D_PRUNE_CACHE or $XDG_CACHE_HOME/d3d-prune)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="weights and compute dtype; auto: bfloat16 where the device computes it natively "
                        "(AMX / AVX512-BF16 CPUs, GPUs), float32 elsewhere")
    parser.add_argument("--drafter-dtype", choices=("auto", *DTYPES), default="auto",
                        help="the drafter's compute dtype (the output is the target's whatever it is); auto: "
                        "float32 on a CPU, where a small drafter's many small operations run slower in bfloat16, "
                        "--dtype elsewhere")
    parser.add_argument("--device", default="cpu", type=_types.device, help="torch device: cpu, cuda, cuda:1, ...")


def add_export_dtype_arg(parser) -> None:
    parser.add_argument("--export-dtype", choices=("source", *DTYPES), default="source",
                        help="dtype of the exported steps; source: the dtype the --drafter weights are stored in "
                        "(--dtype is the compute dtype)")


def add_decode_args(parser) -> None:
    """Flags of the speculative decoders (bench, score, run, sweep)."""
    parser.add_argument("--packed-budget", type=_types.non_negative_int, default=DECODE["packed_budget"],
                        help="async: query tokens the packed pass spends on candidate blocks")
    parser.add_argument("--width", choices=WIDTH_MODES, default=WIDTH_MODES[0],
                        help="tokens verified per round: adaptive chooses 2..block size each round from the "
                        "drafter's confidences and the measured pass times (decode/cost.py); fixed verifies "
                        "the block size every round")
    parser.add_argument("--candidates", choices=CANDIDATE_MODES, default=CANDIDATE_MODES[0],
                        help="async: candidate blocks per packed pass; adaptive drafts as many as the cost model "
                        "says pay for themselves, none where the two passes cannot overlap (the round then runs "
                        "as sync; decode/cost.py CandidatePolicy); all drafts every candidate that fits "
                        "--packed-budget")
    parser.add_argument("--draft-threads", type=_types.positive_int, default=None, metavar="N",
                        help="async on CPU: threads of the packed pass; the verify pass gets the rest "
                        "(default: a quarter of the threads, at least 1)")
    parser.add_argument("--no-context-vocab", action="store_true",
                        help="a drafter with a draft vocabulary proposes from it alone, as a serving stack with a "
                        "fixed token map does (default: each sequence also proposes the ids of its own prompt and "
                        "output that the vocabulary lacks; decode/engine.py ContextIds)")


def add_gate_arg(parser, default: str | None) -> None:
    """--gate, the speculation gate of decoders that serve (bench, generate); `default` None: adaptive under
    live verification, off under replay (`gate_mode`). Scoring and pruning measure drafters with it off."""
    when = "adaptive with --verify live, off with --verify replay" if default is None else default
    parser.add_argument("--gate", choices=GATE_MODES, default=default,
                        help="sync and async: adaptive runs plain target steps for a while where a sequence's recent "
                        "rounds commit fewer tokens than their cost buys on one-token steps (decode/gate.py), so "
                        "prompts the drafter guesses poorly run near the target's own speed; tau is then reported "
                        f"over the drafting rounds and the share of target steps as gated; off drafts every round "
                        f"(default: {when})")


def gate_mode(args) -> str:
    """The --gate of `args` (off where the command has none; see `add_gate_arg` for its default)."""
    mode = getattr(args, "gate", GATE_MODES[-1])
    if mode is None:
        return GATE_MODES[0] if getattr(args, "verify", "live") == "live" else GATE_MODES[-1]
    return mode


def add_tree_arg(parser) -> None:
    """--tree-branches, the draft trees of decoders that serve (bench, generate)."""
    default = DECODE["tree_branches"]
    parser.add_argument("--tree-branches", type=_types.non_negative_int, default=default, metavar="K",
                        help="sync and async, greedy: a round may verify up to K next-best ids per slot beside the "
                        "drafts, as a tree in the same target pass, as many nodes as the cost model says pay "
                        "(decode/tree.py; the verify width then counts every node); pays where verifying more "
                        "tokens costs little (a GPU); 0 verifies a chain, the default because trees measured "
                        f"no faster on 2 CPU cores (default: {default})")


def tree_branches(args) -> int:
    """The --tree-branches of `args` (chains, 0, where the command has none)."""
    return getattr(args, "tree_branches", 0)


def add_screen_args(parser) -> None:
    """The scoring round's screening flags (prune.config.ScoreConfig.screen_prompts)."""
    parser.add_argument("--screen-prompts", type=_types.non_negative_int, default=SCORE["screen_prompts"],
                        metavar="N", help="score every layer on the first N calibration prompts, then only the "
                        "--screen-keep lowest-scoring ones on the rest (0, or N at least the prompts: every layer on "
                        "every prompt)")
    parser.add_argument("--screen-keep", type=_types.positive_int, default=SCORE["screen_keep"], metavar="K",
                        help="layers scored on every prompt after the first pass (at least --per-step)")


def add_prescreen_args(parser) -> None:
    """The scoring round's pre-screen flags (prune.config.ScoreConfig.prescreen)."""
    from prune.criteria import rankings

    parser.add_argument("--prescreen", choices=rankings(), default=SCORE["prescreen"], metavar="CRITERION",
                        help=f"rank every layer by this criterion first ({', '.join(rankings())}; no decoder) and "
                        "measure --criterion only for the --prescreen-keep most removable; the others are recorded "
                        "as skipped (default: none, every layer measured)")
    parser.add_argument("--prescreen-keep", type=_types.positive_int, default=SCORE["prescreen_keep"], metavar="K",
                        help="layers a --prescreen leaves to be measured (at least --per-step)")


def decode_config(args, pair, drafter=None, log=None, **fields):
    """The DecodeConfig of `add_decode_args` flags for `pair` (and `drafter`, default the pair's), and the
    pair's pass times (decode.cost.PassTimes; the adaptive width policy is derived from them): the one
    entry of `decode_configs`."""
    return decode_configs(args, pair, [drafter or pair.drafter], log, **fields)[0]


def decode_configs(args, pair, drafters, log=None, **fields) -> list:
    """[(DecodeConfig, PassTimes)] for each of `drafters` with `pair`'s target, from the `add_decode_args`
    flags; `fields` set other DecodeConfig attributes.

    The drafters' pass times come from one interleaved measurement with one measurement of the target
    (decode.timing.measure_drafters), so drafters compared in one run are timed under the same load. They
    are measured once per set of drafters, target, device (and GPU model), dtype, thread count and packed
    budget and kept in the cache folder (unless --no-cache), so that repeated runs choose the same widths:
    decisions, tau and the score cache stay reproducible on one machine. A command with --pass-times reads
    them from its file instead, and one whose target is not loaded (--ar-outputs) without it takes pinned
    times (decode.timing.pinned_times) or has none: its decoders then run with the fixed settings (PassTimes
    None).
    """
    from decode.cost import PassTimes
    from decode.timing import measure_drafters, pinned_times
    from prune.cache import cached_json

    from ._target import given_pass_times

    base = DecodeConfig(**{"packed_budget": args.packed_budget, "draft_threads": args.draft_threads,
                           "tree_branches": tree_branches(args),
                           "context_vocab": not getattr(args, "no_context_vocab", False),
                           **_settings.section_values(args, "decode"),
                           "stop_ids": pair.stop_ids, **fields})
    for drafter in drafters:
        base.verify_block(drafter.config.block_size)
    cache = cache_dir(args)

    def measure():
        if pinned_times() is None:  # pinned times ($D3D_PRUNE_PASS_TIMES) time nothing
            (log or _stderr)("measuring the pass times for the cost model (once; cached) ...")
            warn_if_busy(cache, log or _stderr)
        measured = [times.to_dict() for times in measure_drafters(pair.target, drafters, base)]
        return measured[0] if len(measured) == 1 else measured  # one drafter: the record as before

    given = given_pass_times(args, pair, drafters, log)
    if given is None:
        record = pass_times_record(cache, pair.target, drafters, base)
        stored = cached_json(record and record.parent, record and record.stem, measure)
        given = [PassTimes(**record) for record in ([stored] if isinstance(stored, dict) else stored)]
    adaptive_width = args.width == "adaptive"
    adaptive_candidates = getattr(args, "candidates", "adaptive") == "adaptive"
    gate = gate_mode(args) == "adaptive"
    return [(base.tuned_to(times, width=adaptive_width, candidates=adaptive_candidates, gate=gate)
             if times is not None else base, times) for times in given]


def pass_times_record(cache, target, drafters, decode: DecodeConfig) -> Path | None:
    """The file `decode_configs` keeps the pass times of `drafters` with `target` in (one drafter's own
    record, or one for drafters measured together): `CACHE/pass-times/KEY.json`; None without a cache."""
    from prune.cache import fingerprint, pass_times_key

    if cache is None:
        return None
    keys = [pass_times_key(drafter, target, decode) for drafter in drafters]
    key = keys[0] if len(keys) == 1 else fingerprint("pass-times of drafters together", *keys)
    return Path(cache) / "pass-times" / f"{key}.json"


def warn_if_busy(cache, log) -> bool:
    """Warn when other work kept the machine's cores busy just before pass times are measured: they are
    cached and steer every later decision (widths, candidates, predictions) until deleted. Returns True
    when it warned. (Seen here: pass times cached under a training job's load later made a quiet
    benchmark draft a packed pass every round and predict 1.30x where it ran 1.01x.)"""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores:
        return False
    where = f"{cache}/pass-times" if cache else "nowhere (--no-cache)"
    log(f"warning: the machine is busy (load average {load:.1f} on {cores} cores): these pass times will be slow "
        f"and uneven, and they are kept in {where}; measure on a quiet machine, or delete that folder afterwards")
    return True


def cache_dir(args):
    """The cache folder of --cache-dir (prune.cache), or None with --no-cache."""
    from models._wheels import resolve_cache_dir

    return None if getattr(args, "no_cache", False) else resolve_cache_dir(getattr(args, "cache_dir", None))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_prompt_args(parser, default_suite: str = "humaneval:eval", max_new_tokens: int = 128,
                    limit: int | None = None) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--suite", default=None, metavar="NAME[:train|:calib|:eval]", type=_types.suite,
                        help=f"built-in prompt suite: humaneval, mtbench or champ, or one part (humaneval:calib); "
                        f"several joined by + are interleaved (default when --prompts is not given: {default_suite})")
    source.add_argument("--prompts", default=None, metavar="FILE.jsonl", type=_types.text_file,
                        help="JSONL prompts: records with prompt, messages or input_ids (optional id)")
    parser.set_defaults(default_suite=default_suite)
    parser.add_argument("--limit", type=_types.positive_int, default=limit, metavar="N",
                        help="use the first N prompts" + (" (default: all)" if limit is None else ""))
    parser.add_argument("--max-new-tokens", type=_types.positive_int, default=max_new_tokens, metavar="N",
                        help="tokens generated per prompt at most")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="feed prompt text as is instead of through the tokenizer's chat template")


def add_tracking_args(parser) -> None:
    parser.add_argument("--no-wandb", action="store_true",
                        help="do not log to W&B (otherwise offline unless logged in; WANDB_MODE is respected)")
    parser.add_argument("--wandb-project", default=TRACKING["project"], type=_types.name,
                        help="W&B project (entity: WANDB_ENTITY)")


def make_tracker(args, job_type: str, run_config: dict, drafter_hash: str, out=None, group=None, name=None,
                 extra_tags=()):
    """The W&B tracker of a command (prune.tracking); its mode comes from --no-wandb and the environment."""
    return tracker_for(resolve_mode(os.environ, enabled=not args.no_wandb), args.wandb_project, run_config,
                       entity=os.environ.get("WANDB_ENTITY") or None, group=group, job_type=job_type, name=name,
                       tags=(drafter_tag(drafter_hash), *extra_tags), dir=default_dir(out, os.environ),
                       init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT") or TRACKING["init_timeout"]))


def model_paths(args) -> tuple[str, str]:
    """The drafter and target paths of `args`, falling back to the demo pair."""
    from models.demo import resolve_demo_target

    target = args.target or resolve_demo_target(getattr(args, "cache_dir", None))
    return drafter_path(args), str(target)


def drafter_path(args) -> str:
    """The folder of --drafter (its first, when repeated), or of the demo drafter."""
    from models.demo import demo_drafter_dir
    from models.errors import CheckpointError

    drafter = args.drafter[0] if isinstance(args.drafter, list) else args.drafter
    if drafter is None:
        drafter = demo_drafter_dir()
        if not (drafter / "config.json").is_file():
            raise CheckpointError(f"the demo drafter is missing from {drafter}; pass --drafter DIR")
    return str(drafter)


def drafter_layers(args) -> int:
    """The layer count of the drafter a command will load, from its config.json alone: what checks of a
    layer budget read, so that a budget the drafter cannot meet fails before any model loads."""
    from models.checkpoint import read_config_json

    return int(read_config_json(drafter_path(args))["num_hidden_layers"])


def prompt_records(args) -> tuple[list[dict], str]:
    """The prompt records selected by --suite/--prompts and --limit, and a label naming their source."""
    from decode.prompts import read_prompt_file, select_records
    from decode.suites import load_suite

    if args.prompts:
        return select_records(read_prompt_file(args.prompts), args.limit), args.prompts
    spec = args.suite or args.default_suite
    return select_records(load_suite(spec, getattr(args, "cache_dir", None)), args.limit), f"suite:{spec}"


def quiet_libraries() -> None:
    """Silence transformers' own progress bars and info logs; our progress goes to stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def torch_dtype(name: str, device=None):
    """The torch dtype of a --dtype value ("auto" resolves for `device`, see models/precision.py)."""
    import torch

    from models.precision import resolve_dtype

    return resolve_dtype(name, device if device is not None else torch.device("cpu"))


def resolve_device(name: str):
    import torch

    from models.errors import ConfigError

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for CUDA but torch sees no GPU; use --device cpu")
    return device


def write_json(document: dict, destination: str | None) -> None:
    """Write one JSON document to a file, or to stdout when destination is '-'."""
    text = json.dumps(document, indent=2, sort_keys=True, default=str)
    if destination == "-":
        sys.stdout.write(text + "\n")
    elif destination:
        with output_file(destination) as handle:
            handle.write(text + "\n")


@contextlib.contextmanager
def output_file(path: str):
    """Open `path` for writing text, creating its folder; an OSError becomes a one-line ConfigError."""
    from models.errors import ConfigError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            yield handle
    except OSError as exc:
        raise ConfigError(f"cannot write {path} ({exc.strerror or exc}); give another path") from None


def stdout_console():
    """A rich console on stdout; 140 columns when stdout is not a terminal (files, pipes, CI logs)."""
    from rich.console import Console

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 140)


def show_progress(json_destination: str | None) -> bool:
    """Progress on stderr (a bar on a terminal, periodic lines in a log) unless JSON goes to stdout."""
    return json_destination != "-"


def load_pair_and_prompts(args, target_weights: bool | None = None):
    """Everything a measuring command starts from: (pair, tokenized prompts, drafter dir, target path, source).

    Prompts are read before any model loads, so a bad prompt file fails at once; the context check runs
    after tokenization. `target_weights`: load the target's weights (None: unless the command's target outputs
    are recorded and replayed, prune.commands._target.target_weights_needed; pair.target is then None).
    """
    from decode.prompts import check_context, tokenize_records
    from models.pair import load_pair
    from models.precision import dtype_name

    from ._target import note_target_weights, target_weights_needed

    quiet_libraries()
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype, device)
    args.dtype = dtype_name(dtype)  # later readers (cache keys, reports) see the resolved name
    records, source = prompt_records(args)
    drafter_dir, target_path = model_paths(args)
    warn_training_overlap(drafter_dir, records, source)
    if target_weights is None:
        target_weights = target_weights_needed(args)
        note_target_weights(args, target_weights)
    pair = load_pair(drafter_dir, target_path, dtype, device, args.drafter_dtype, drafter_keys(args, drafter_dir),
                     target_weights=target_weights)
    prompts = tokenize_records(records, pair.tokenizer, not args.no_chat_template)
    check_context(prompts, args.max_new_tokens, pair.drafter.config.block_size, pair.max_positions)
    return pair, prompts, drafter_dir, target_path, source


def warn_training_overlap(drafter_dir, records: list[dict], source: str) -> int:
    """Warn on stderr when prompts of `records` are in the drafter's recorded training prompts
    (models/provenance.py); returns how many are. Silent when the drafter records none."""
    from models.provenance import overlap, read_training_prompts, record_text

    sets = read_training_prompts(drafter_dir)
    if not sets:
        return 0
    found, per_set = overlap(sets, [record_text(record) for record in records])
    if found:
        where = ", ".join(f"{name} {count}" for name, count in per_set.items())
        print(f"warning: {found} of {len(records)} prompts ({source}) are in the drafter's training data ({where}); "
              "tau on them overstates its tau on new prompts: calibrate and evaluate on prompts it was not "
              "trained on (the suites' calib and eval parts, e.g. --suite humaneval:calib)", file=sys.stderr)
    return found
