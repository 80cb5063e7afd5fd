"""`prune export`: re-export a pruning step (or any drafter folder), by default in the dtype it is stored in."""

from . import _types
from ._common import DTYPES, add_command, add_debug


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "export",
        help="re-export a pruned step in another dtype (e.g. bfloat16 for serving)",
        description="Write a copy of a drafter folder (e.g. OUT/step-03 of `prune run`) with its weights cast to "
        "--dtype (default: the dtype SOURCE is stored in), atomically, keeping the tokenizer files, generation "
        "config, model card (naming the dtype) and pruning report (with fresh file hashes)."
        "\n\nexample:\n  prune export pruned/final pruned-bf16 --dtype bfloat16",
    )
    parser.add_argument("source", type=_types.drafter_dir,
                        help="drafter folder to export (a `prune run` step or any drafter)")
    parser.add_argument("destination", type=_types.output_dir,
                        help="new folder (must not exist or be empty unless --overwrite)")
    parser.add_argument("--dtype", choices=("source", *DTYPES), default="source",
                        help="dtype of the exported weights; source: the dtype SOURCE's weights are stored in")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the export's record (source, destination, dtype, layers, bytes) as JSON "
                        "('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from models.checkpoint import WEIGHTS_NAME, ensure_writable_output
    from models.drafter import load_drafter
    from models.precision import dtype_name
    from prune.export import export_step, read_report, resolve_export_dtype

    from ._common import quiet_libraries, write_json

    quiet_libraries()
    ensure_writable_output(args.destination, args.overwrite)  # before the weights load
    source = Path(args.source).resolve()
    model = load_drafter(source)
    report, history = read_report(source)
    report["exported_from"] = str(source)
    dtype = resolve_export_dtype(args.dtype, source)
    export_step(model, args.destination, source, report, history, dtype=dtype, overwrite=args.overwrite)
    write_json({"source": str(source), "destination": args.destination, "dtype": dtype_name(dtype),
                "layers": model.config.num_hidden_layers,
                "weights_bytes": (Path(args.destination) / WEIGHTS_NAME).stat().st_size}, args.json)
    if args.json != "-":
        print(args.destination)
    return 0
