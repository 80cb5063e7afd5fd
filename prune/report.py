"""The local report of a pruning run: OUT/report.md and PNG plots, for users without W&B.

Every file is written atomically (models.checkpoint), so a killed run never leaves half a report.
Plots (matplotlib, Agg backend): a heatmap of layer scores (steps x original layer index, 0-based; a head
step's row is empty), tau and predicted speedup against layers removed (against steps, each labelled with
what it removed, in a run that took head steps), and the heal loss curves.
"""

from pathlib import Path

from models.checkpoint import atomic_file, atomic_write_text

from .state import RunState, SpeedCheck
from .text import number, plus_minus


def write_report(out, state: RunState) -> list[Path]:
    """Write report.md and the plots for `state`; returns the files written."""
    out = Path(out)
    files = [_heatmap(out, state), _curve(out, state), _heal_losses(out, state)]
    files = [f for f in files if f is not None]
    atomic_write_text(out / "report.md", _markdown(state, files))
    return [out / "report.md", *files]


def _markdown(state: RunState, plots: list[Path]) -> str:
    base = state.base
    lines = [
        "# Pruning report",
        "",
        f"Source drafter: `{state.source}`. Unpruned {state.judged_on} tau {base.tau:.3f}"
        + (f", predicted speedup {base.predicted_speedup:.2f}x." if base.predicted_speedup else "."),
        f"Stopped by: {state.stopped_by}.",
        *([f"Heals on: {', '.join(state.heal_data)}."] if state.heal_data else []),
        *([f"Measured on: {state.host.text()}."] if state.host else []),
        *([f"Head steps cut the drafter's head to the ids its target says most in "
           f"{', '.join(state.vocab['source'])} ({state.vocab['tokens']} answer tokens)."] if state.vocab else []),
        "",
        "Layer indices are 0-based indices in the unpruned drafter. Steps are judged (tau, retention, heals, stop "
        f"rules) on the {state.judged_on} prompts"
        + (", disjoint from the calibration prompts that chose the layers." if state.judged_on == "check" else "."),
        "",
        "| step | removed | layers | tau before heal | tau | retention | heal | predicted speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # A step without heal losses was not healed: healing was off, or the removal cost too little to heal.
    healing = "not needed" if state.config.get("heal", {}).get("steps") else "off"
    for h in state.history:
        heal = "rolled back" if h.heal_rolled_back else ("kept" if h.heal_loss else healing)
        removed = f"head: {h.head_rows} ids" if h.is_head_step else h.removed_original
        lines.append(f"| {h.step} | {removed} | {h.layers} | {h.tau_before_heal:.3f} | "
                     f"{h.tau:.3f} | {h.retention:.4f} | {heal} | {number(h.predicted_speedup, 2, 'x')} |")
    gain = state.equal_tau_speedup(state.layers, state.head_rows) if state.history else None
    if gain is not None:
        head = f" and head of {state.head_rows} rows" if state.head_rows else ""
        lines += ["", f"At the unpruned tau, the final drafter's {state.timing.layers - state.layers} fewer layers"
                  f"{head} would make it {gain:.3f}x faster (predicted: {state.timing.depth_text()}). That is the most "
                  "its size buys on this machine; the predicted speedup above is about this times what its tau keeps."]
    lines += _speed_lines(state.speed)
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    return "\n".join(lines)


def _speed_lines(speed: SpeedCheck | None) -> list[str]:
    """The measured speed check (prune.speed), predicted beside measured."""
    if speed is None:
        return []
    lines = ["", f"Measured on {speed.prompts} held-out prompts ({speed.source}, {speed.max_new_tokens} "
             "tokens, live target, async decoder, interleaved with ar):", "",
             "| drafter | tau | measured speedup | predicted speedup | limit | exact |", "|---|---|---|---|---|---|"]
    for name, row in (("unpruned", speed.base), ("final", speed.final)):
        if row is not None:
            measured = number(row.measured_speedup, 2, "x") + plus_minus(row.measured_speedup_error)
            cells = [number(row.tau, 3), measured] + [number(v, 2, "x") for v in (row.predicted_speedup,
                                                                                row.speedup_limit)]
            lines.append(f"| {name} | {' | '.join(cells)} | {row.exact} |")
    if speed.base and speed.final and speed.base.tau and speed.retention_error is not None:
        retention = speed.final.tau / speed.base.tau
        lines += ["", f"Held-out tau retention {retention:.4f}{plus_minus(speed.retention_error, 4)} "
                  f"(standard error over these {speed.prompts} prompts)."]
    return lines


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _heatmap(out: Path, state: RunState) -> Path | None:
    if not any(h.scores for h in state.history):  # no step, or head steps only: no layer was scored
        return None
    import numpy as np

    plt = _pyplot()
    # Columns are original indices; a campaign that starts from a pruned drafter has gaps and larger ones.
    width = max(s.original_layer for h in state.history for s in h.scores) + 1
    grid = np.full((len(state.history), width), np.nan)
    for row, h in enumerate(state.history):
        for s in h.scores:
            if not s.skipped:  # a pre-screen's score is on another scale
                grid[row, s.original_layer] = s.score
    fig, ax = plt.subplots(figsize=(max(6, width * 0.3), 1.5 + 0.4 * len(grid)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(width), [str(i) for i in range(width)], fontsize=7)
    ax.set_xlabel("original layer index (0-based)")
    ax.set_ylabel("step")
    ax.set_yticks(range(len(grid)), [f"{h.step} (head)" if h.is_head_step else str(h.step) for h in state.history])
    fig.colorbar(image, ax=ax, label="score (drop when removed)")
    fig.tight_layout()
    return _save_png(plt, fig, out / "layer_scores.png")


def _curve(out: Path, state: RunState) -> Path:
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    removed = [0] + [state.timing.layers - h.layers for h in state.history]
    taus = [state.base.tau] + [h.tau for h in state.history]
    fig, ax = plt.subplots(figsize=(6, 4))
    heads = any(h.is_head_step for h in state.history)
    x = list(range(len(taus))) if heads else removed  # head steps remove no layer: one point per step
    lines = ax.plot(x, taus, "o-", label=f"tau ({state.judged_on} prompts)")
    ax.set_ylabel("tau")
    if heads:
        ax.set_xlabel("step")
        labels = [f"{h.head_rows} ids" if h.is_head_step else "-L" + ",".join(map(str, h.removed_original))
                  for h in state.history]
        ax.set_xticks(x, ["start"] + labels, rotation=45, fontsize=7)
    else:
        ax.set_xlabel("layers removed")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers come whole
    speedups = [state.base.predicted_speedup] + [h.predicted_speedup for h in state.history]
    if all(s is not None for s in speedups):
        twin = ax.twinx()
        lines += twin.plot(x, speedups, "s--", color="tab:orange", label="predicted speedup")
        twin.set_ylabel("predicted speedup (x)")
    # One legend for both axes, above the plot, where it covers neither a curve nor an axis label.
    ax.legend(lines, [line.get_label() for line in lines], loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=len(lines), frameon=False)
    fig.tight_layout()
    return _save_png(plt, fig, out / "tau_vs_layers_removed.png")


def _heal_losses(out: Path, state: RunState) -> Path | None:
    curves = [(h.step, h.heal_loss) for h in state.history if h.heal_loss]
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for step, losses in curves:
        ax.plot(range(1, len(losses) + 1), losses, label=f"step {step}")
    ax.set_xlabel("heal update")
    ax.set_ylabel("drafter loss")
    ax.legend()
    fig.tight_layout()
    return _save_png(plt, fig, out / "heal_loss.png")


def _save_png(plt, fig, path: Path) -> Path:
    """Write figure `fig` to `path` as a PNG (atomically), close it and return the path."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path
