"""`prune export`: re-export a pruning step (or any drafter folder), by default in the dtype it is stored in,
optionally without named layers (a run's choice applied to another copy of the drafter, or a hand-picked set)."""

from . import _types
from ._checkpoint_args import add_drafter_key_args, add_max_shard_size_arg, drafter_keys
from ._common import DTYPES, add_command, add_debug


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "export",
        help="re-export a pruned step in another dtype (e.g. bfloat16 for serving), or remove named layers",
        description="Write a copy of a drafter folder (e.g. OUT/step-03 of `prune run`) with its weights cast to "
        "--dtype (default: the dtype SOURCE is stored in), atomically, keeping the tokenizer files, generation "
        "config, model card (naming the dtype) and pruning report (with fresh file hashes). With --remove-layers the "
        "copy lacks those layers (named by their index in the unpruned drafter, as a run's report names them) and "
        "its history gains an 'export' row saying so; nothing is measured."
        "\n\nexamples:\n  prune export pruned/final pruned-bf16 --dtype bfloat16"
        "\n  prune export models/demo_drafter minus5 --remove-layers 3,2,8,9,26",
        common=("--remove-layers", "--dtype", "--overwrite", "--json"),
    )
    parser.add_argument("source", type=_types.drafter_dir,
                        help="drafter folder to export (a `prune run` step or any drafter)")
    parser.add_argument("destination", type=_types.output_dir,
                        help="new folder (must not exist or be empty unless --overwrite)")
    parser.add_argument("--dtype", choices=("source", *DTYPES), default="source",
                        help="dtype of the exported weights; source: the dtype SOURCE's weights are stored in")
    parser.add_argument("--remove-layers", type=_types.layer_indices, default=None, metavar="I,J,...",
                        help="remove these layers, by their index in the unpruned drafter (the report's 'removed "
                        "(original index)')")
    add_max_shard_size_arg(parser)
    add_drafter_key_args(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    parser.add_argument("--json", metavar="OUT", default=None, type=_types.output_file,
                        help="write the export's record (source, destination, dtype, layers, weight files, bytes) "
                        "as JSON "
                        "('-' = stdout)")
    add_debug(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from models.checkpoint import ensure_writable_output, read_config_json
    from models.drafter import load_drafter
    from models.shards import weight_files, weights_bytes
    from models.precision import dtype_name
    from models.surgery import current_indices, remove_layers
    from prune.export import export_step, read_report, resolve_export_dtype

    from ._common import quiet_libraries, write_json

    quiet_libraries()
    ensure_writable_output(args.destination, args.overwrite)  # before the weights load
    source = Path(args.source).resolve()
    # The layers to remove are checked against config.json before the weights load.
    removed = current_indices(read_config_json(source), args.remove_layers) if args.remove_layers else None
    model = load_drafter(source, drafter_keys=drafter_keys(args, source))
    report, history = read_report(source)
    report["exported_from"] = str(source)
    if args.remove_layers:
        report.setdefault("source", str(source))  # the unpruned drafter, which `prune heal` distils from
        model = remove_layers(model, removed)
        history = [*history, {"step": "export", "removed_original": list(args.remove_layers),
                              "layers": model.config.num_hidden_layers}]
    dtype = resolve_export_dtype(args.dtype, source)
    export_step(model, args.destination, source, report, history, dtype=dtype, overwrite=args.overwrite,
                max_shard_size=args.max_shard_size)
    write_json({"source": str(source), "destination": args.destination, "dtype": dtype_name(dtype),
                "layers": model.config.num_hidden_layers,
                "weight_files": [file.name for file in weight_files(args.destination)],
                "weights_bytes": weights_bytes(args.destination)}, args.json)
    if args.json != "-":
        print(args.destination)
    return 0
