"""`prune distill`: the target's own greedy responses to training prompts, stored as token ids."""

from prune.training.data import DISTILL_DEFAULTS as DEFAULTS
from prune.training.prompts import STYLES

from . import _types
from ._common import DTYPES, add_command, add_debug
from ._help import COMMON


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "distill",
        help="generate distillation data: the target's greedy responses to training prompts",
        description="Generate self-distillation data for drafter training: prompts cut from the CPython "
        "standard library and synthetic math problems (never a prompt of the built-in suites), "
        "answered greedily by the target through its chat template. Written in shards; rerunning the same "
        "command resumes after the last finished shard.\n\nexample:\n  prune distill --out data/distill "
        "--num-prompts 2000 --dtype bfloat16",
        common=(*COMMON, "--num-prompts"),
    )
    parser.add_argument("--out", required=True, type=_types.output_dir,
                        help="output data folder (resumed when it holds a run of the same settings)")
    parser.add_argument("--target", default=None, type=_types.target_path,
                        help="target model folder (default: the demo target)")
    parser.add_argument("--cache-dir", default=None, type=_types.output_dir,
                        help="demo target cache (default: $D3D_PRUNE_CACHE or ~/.cache/d3d-prune)")
    parser.add_argument("--num-prompts", type=_types.positive_int, default=DEFAULTS["num_prompts"],
                        help="training prompts to answer")
    parser.add_argument("--max-new-tokens", type=_types.positive_int, default=DEFAULTS["max_new_tokens"],
                        help="response length cap (EOS ends earlier)")
    parser.add_argument("--batch-size", type=_types.positive_int, default=DEFAULTS["batch_size"],
                        help="prompts per generate call")
    parser.add_argument("--shard-size", type=_types.positive_int, default=DEFAULTS["shard_size"],
                        help="prompts per shard (the unit of resumption)")
    parser.add_argument("--device", default="cpu", type=_types.device, help="torch device")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULTS["dtype"], help="target dtype while generating")
    parser.add_argument("--seed", type=_types.non_negative_int, default=DEFAULTS["seed"], help="selects the prompts")
    parser.add_argument("--style", choices=STYLES, default=DEFAULTS["style"],
                        help="general: varied tasks on standard-library code and arithmetic; suites: the suites' own "
                        "instructions around standard-library function signatures and synthetic competition problems; train: the "
                        "prompts of the suites' training parts (257; never a calibration or evaluation prompt); champ: CHAMP's "
                        "own prompt formats (partial solutions, hints, concepts) around its training-part problems (921); everyday: "
                        "instructions, everyday questions, arithmetic word problems and editing tasks from templates")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write what the folder holds (settings, finished shards, responses, response tokens) "
                        "as JSON ('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    import sys

    from models.demo import resolve_demo_target
    from prune.training.data import distillation_summary, generate_distillation_data

    from ._common import quiet_libraries, resolve_device, show_progress, write_json

    quiet_libraries()
    resolve_device(args.device)  # a device this machine lacks fails before the target loads
    target = args.target or resolve_demo_target(args.cache_dir)
    out = generate_distillation_data(
        target, args.out, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, device=args.device, dtype=args.dtype, seed=args.seed,
        shard_size=args.shard_size, progress=sys.stderr.isatty() and show_progress(args.json), style=args.style,
    )
    write_json(distillation_summary(out), args.json)
    if args.json != "-":
        print(out)
    return 0
