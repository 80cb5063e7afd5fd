"""Arguments and helpers shared by several commands (one place for their defaults and help)."""

import argparse
import json
import sys

DTYPES = ("float32", "bfloat16", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default and keeps the examples' line breaks."""


def add_command(subparsers, name: str, help: str, description: str):
    return subparsers.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)


def add_debug(parser) -> None:
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def add_model_args(parser, target: bool = True) -> None:
    parser.add_argument("--drafter", required=True, help="drafter checkpoint folder")
    if target:
        parser.add_argument("--target", required=True, help="target model folder or .gguf file")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and compute dtype")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")


def quiet_libraries() -> None:
    """Silence transformers' own progress bars and info logs; our progress goes to stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def resolve_device(name: str):
    import torch

    from models.errors import ConfigError

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for CUDA but torch sees no GPU; use --device cpu")
    return device


def write_json(document: dict, destination: str | None) -> None:
    """Write one JSON document to a file, or to stdout when destination is '-'."""
    text = json.dumps(document, indent=2, sort_keys=True, default=str)
    if destination == "-":
        sys.stdout.write(text + "\n")
    elif destination:
        with open(destination, "w") as handle:
            handle.write(text + "\n")


def interactive(json_destination: str | None) -> bool:
    """Progress bars only when a person watches: stderr is a terminal and JSON does not go to stdout."""
    return sys.stderr.isatty() and json_destination != "-"
