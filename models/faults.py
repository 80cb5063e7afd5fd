"""Test-only fault injection: a process kills itself with SIGKILL when it reaches a named point.

Set `D3D_PRUNE_KILL_AT=NAME` (the first time NAME is reached) or `NAME:COUNT` (the COUNT-th time) in the
environment of a command; unset, `fault_point` costs one dictionary lookup. The points:

    write:FILE     an atomic write of FILE (a file or a folder, named without its path) is complete on disk
                   but not yet renamed into place (models.checkpoint): step-02, state.json, report.md, ...
    score-layer    a layer's evaluation in a scoring round has been saved (prune.scoring)
    heal           a LoRA heal has trained, before its adapters are merged (prune.heal)
    train-checkpoint  a training run (a drafter's or a heal's) has saved a checkpoint (prune.training.loop)

A SIGKILL runs no handler, no `finally` and no atexit hook: what is on disk is what a preempted job leaves.
"""

import os
import signal

ENV = "D3D_PRUNE_KILL_AT"
_reached: dict[str, int] = {}


def kill_spec() -> tuple[str, int] | None:
    """(point name, count) of the environment's D3D_PRUNE_KILL_AT, or None when unset."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else (spec, 1)


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if D3D_PRUNE_KILL_AT names `name` and this is its COUNT-th arrival."""
    spec = kill_spec()
    if spec is None or spec[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)
