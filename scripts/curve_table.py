"""Helpers of scripts/pruning-curve.sh: the drafters each step had before its heal, and the curve's table.

    python scripts/curve_table.py preheal RUN...          rebuild RUN/preheal-XX for every step whose heal was kept
    python scripts/curve_table.py drafters RUN...         the step and pre-heal folders measured on the full suite
    python scripts/curve_table.py table OUT DRAFTER SUITE...

A step's pre-heal drafter is the drafter it started from (the unpruned one, or the previous step's export)
without the layers the step removed: exactly what the run measured as `tau_before_heal`. A step whose heal
was rolled back exported those weights already.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _state(run: Path) -> dict:
    return json.loads((run / "state.json").read_text())


def _steps(run: Path) -> list[dict]:
    return _state(run)["history"]


def preheal(runs: list[Path]) -> None:
    from models.drafter import load_drafter, save_drafter
    from models.surgery import remove_layers

    for run in runs:
        state = _state(run)
        source = Path(state["source"])
        previous = source
        for step in state["history"]:
            folder = run / f"preheal-{step['step']:02d}"
            if _heal_kept(step) and not folder.exists():
                save_drafter(remove_layers(load_drafter(previous), step["removed"]), folder, tokenizer_source=source)
            previous = run / step["folder"]


def drafters(runs: list[Path]) -> list[str]:
    steps = runs[0]  # the per-step run; its last step is steps/final, measured on every suite already
    folders = [str(steps / s["folder"]) for s in _steps(steps)[:-1]]
    for run in runs:
        folders += [str(run / f"preheal-{s['step']:02d}") for s in _steps(run) if _heal_kept(s)]
    return folders


def _heal_kept(step: dict) -> bool:
    """A step healed (the run heals only steps that lost enough tau) whose heal was not rolled back."""
    return bool(step["heal_loss"]) and not step["heal_rolled_back"]


def _taus(out: Path, suite: str) -> dict:
    """{drafter folder (resolved): (tau_macro, tau_micro, prompts)} of one suite's bench report."""
    path = out / f"bench-{suite}.json"
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    entries = report.get("drafters") or [{"drafter": report["settings"]["drafter"], "decoders": report["decoders"]}]
    return {str(Path(e["drafter"]).resolve()): (e["decoders"]["async"]["tau_macro"], e["decoders"]["async"]["tau_micro"],
                                                e["decoders"]["async"]["prompts"]) for e in entries}


def table(out: Path, drafter: str, suites: list[str]) -> str:
    taus = {suite: _taus(out, suite) for suite in suites}
    base = str(Path(drafter).resolve())
    lines = ["| removed | run | calib tau before heal | calib tau | heal | "
             + " | ".join(f"{s}:eval tau (retention)" for s in suites) + " | pre-heal " + suites[0] + ":eval tau |",
             "|---" * (6 + len(suites)) + "|"]

    def held_out(folder: str) -> list[str]:
        cells = []
        for suite in suites:
            got, ref = taus[suite].get(str(Path(folder).resolve())), taus[suite].get(base)
            cells.append("-" if got is None else f"{got[0]:.3f} ({got[0] / ref[0]:.1%})" if ref else f"{got[0]:.3f}")
        return cells

    unpruned = _state(out / "steps")["base"]["tau"]
    lines.append(f"| 0 | - | - | {unpruned:.3f} | - | " + " | ".join(held_out(drafter)) + " | - |")
    rows = []
    for name in ("steps", "at5"):
        removed = 0
        for step in _steps(out / name):
            removed += len(step["removed"])
            pre = taus[suites[0]].get(str((out / name / f"preheal-{step['step']:02d}").resolve()))
            healed, kept = bool(step["heal_loss"]), _heal_kept(step)
            heal = "kept" if kept else "rolled back" if healed else "not needed"
            rows.append((removed, f"| {removed} | {name} step {step['step']} ({','.join(map(str, step['removed_original']))}) | "
                         f"{step['tau_before_heal']:.3f} | {step['tau']:.3f} | {heal} | "
                         + " | ".join(held_out(str(out / name / step["folder"])))
                         + f" | {'same' if healed and not kept else '-' if pre is None or not kept else f'{pre[0]:.3f}'} |"))
    lines += [row for _, row in sorted(rows, key=lambda r: r[0])]
    return "\n".join(lines)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "preheal":
        preheal([Path(p) for p in rest])
    elif command == "drafters":
        print("\n".join(drafters([Path(p) for p in rest])))
    elif command == "table":
        print(table(Path(rest[0]), rest[1], rest[2:]))
    else:
        sys.exit(f"unknown command {command!r}; choose preheal, drafters or table")
