"""`prune dashboard`: save the W&B workspace with the key pruning and sweep panels to a project."""

import json

from . import _types
from ._common import add_command, add_debug

EXAMPLES = """
examples:
  prune dashboard --entity my-team --project d3d-prune
  prune dashboard --print                                           (list the panels offline; no W&B needed)
"""


def add_parser(subparsers) -> None:
    parser = add_command(
        subparsers,
        "dashboard",
        help="save a W&B workspace with the pruning and sweep panels",
        description="Create a saved W&B workspace in ENTITY/PROJECT with the key panels: tau, retention and "
        "predicted speedup vs layers removed, heal losses, the layer-score heatmap and tables, sweep parallel "
        "coordinates and the Pareto scatter (eval retention vs layers left). It reads the metric names that "
        "prune run, prune score and prune sweep log. Saving needs a logged-in W&B (`wandb login`)." + EXAMPLES,
        common=("--entity", "--project", "--name", "--print"),
    )
    parser.add_argument("--entity", default=None, type=_types.name,
                        help="W&B entity (user or team); needed unless --print")
    parser.add_argument("--project", default=None, type=_types.name,
                        help="W&B project holding the runs; needed unless --print")
    parser.add_argument("--name", default=None, type=_types.name,
                        help="workspace name (default: 'd3d-prune: pruning and sweeps')")
    parser.add_argument("--print", action="store_true",
                        help="print the panels as JSON instead of saving (offline; --entity/--project optional)")
    add_debug(parser)
    parser.set_defaults(run=run)


def panel_listing(workspace) -> dict:
    """Sections and their panels (type and title), a readable view of the workspace."""
    return {"entity": workspace.entity, "project": workspace.project, "name": workspace.name,
            "sections": [{"name": s.name, "panels": [{"type": type(p).__name__, "title": getattr(p, "title", None)}
                                                    for p in s.panels]} for s in workspace.sections]}


def run(args) -> int:
    import os
    import sys

    from models.errors import ConfigError
    from prune.dashboard import DEFAULT_NAME, build_workspace
    from prune.tracking import has_credentials, resolve_mode

    if args.print:
        # The panels do not depend on where they would be saved; the workspace model just needs names.
        workspace = build_workspace(args.entity or "ENTITY", args.project or "PROJECT", args.name or DEFAULT_NAME)
        print(json.dumps({**panel_listing(workspace), "entity": args.entity, "project": args.project}, indent=2))
        return 0
    missing = [flag for flag, value in (("--entity", args.entity), ("--project", args.project)) if not value]
    if missing:
        raise ConfigError(f"saving a workspace needs {' and '.join(missing)} (the W&B place to save it to); "
                          "--print lists the panels without them")
    workspace = build_workspace(args.entity, args.project, args.name or DEFAULT_NAME)
    mode = resolve_mode(os.environ)
    if mode != "online" or not has_credentials(os.environ):
        raise ConfigError(f"saving a workspace needs W&B online and logged in (mode {mode}"
                          f"{'' if has_credentials(os.environ) else ', no API key'}): run `wandb login` or set "
                          "WANDB_API_KEY, unset WANDB_MODE=offline, then rerun prune dashboard (--print shows the "
                          "panels offline)")
    try:
        saved = workspace.save()
    except Exception as exc:  # noqa: BLE001 - network, permissions, unknown entity: one line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"W&B did not save the workspace to {args.entity}/{args.project}: {first}") from None
    print(saved.url)
    print(f"saved the workspace to {args.entity}/{args.project}", file=sys.stderr)
    return 0
