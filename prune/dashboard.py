"""The saved W&B workspace of a project's pruning runs and sweeps (built with `wandb-workspaces`).

`build_workspace` is the whole panel definition; it reads only the stable metric names of
prune.tracking, so the saved workspace keeps working for later runs. Building needs no network;
`save_workspace` uploads it and needs a logged-in W&B.
"""

from .tracking import HEAL_AXIS, STEP_AXIS

# Searched settings shown on the parallel coordinates (trial config: trial.params.NAME).
SWEEP_PARAMS = ("layers_to_remove", "criterion", "per_step", "calibration_prompts", "heal_steps", "lora_rank",
                "lora_alpha", "heal_lr")
DEFAULT_NAME = "d3d-prune: pruning and sweeps"


def build_workspace(entity: str, project: str, name: str = DEFAULT_NAME, params=SWEEP_PARAMS):
    """The workspace: sections Pruning (tau, retention and predicted speedup vs layers removed, heal
    losses), Layer scores (the heatmap image, its table, the per-step bar chart) and Sweep (parallel
    coordinates of the searched settings, the Pareto scatter of eval retention vs layers left,
    parameter importance). Returns a `wandb_workspaces.workspaces.Workspace`."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    pruning = ws.Section(name="Pruning", is_open=True, panels=[
        wr.LinePlot(title="tau vs layers removed", x=STEP_AXIS, y=["pruning/tau"], title_x="layers removed",
                    title_y="calibration tau"),
        wr.LinePlot(title="retention vs layers removed", x=STEP_AXIS, y=["pruning/retention"],
                    title_x="layers removed", title_y="tau / unpruned tau"),
        wr.LinePlot(title="predicted speedup vs layers removed", x=STEP_AXIS, y=["pruning/predicted_speedup"],
                    title_x="layers removed", title_y="x over target-only decoding"),
        wr.LinePlot(title="heal loss", x=HEAL_AXIS, y=["heal/loss"], title_x="LoRA update", title_y="drafter loss"),
    ])
    scores = ws.Section(name="Layer scores", is_open=True, panels=[
        wr.MediaBrowser(title="layer-score heatmap (step x original layer, 0-based)",
                        media_keys=["plots/layer_scores"], num_columns=1),
        wr.WeavePanelSummaryTable(table_name="layer_scores_heatmap"),
        wr.WeavePanelSummaryTable(table_name="layer_scores"),
        wr.MediaBrowser(title="tau and predicted speedup (report plot)", media_keys=["plots/tau_vs_layers_removed"],
                        num_columns=1),
    ])
    sweep = ws.Section(name="Sweep", is_open=True, panels=[
        wr.ParallelCoordinatesPlot(title="sweep: settings -> results", columns=[
            *[wr.ParallelCoordinatesPlotColumn(metric=wr.Config(f"trial.params.{p}"), display_name=p) for p in params],
            wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("final/layers"), display_name="layers left"),
            wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("sweep/eval_retention"),
                                             display_name="eval retention"),
            wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric("sweep/eval_predicted_speedup"),
                                             display_name="predicted speedup"),
        ]),
        wr.ScatterPlot(title="Pareto: eval retention vs layers left", x=wr.SummaryMetric("final/layers"),
                       y=wr.SummaryMetric("sweep/eval_retention")),
        wr.ScatterPlot(title="predicted speedup vs eval retention", x=wr.SummaryMetric("sweep/eval_retention"),
                       y=wr.SummaryMetric("sweep/eval_predicted_speedup")),
        wr.ParameterImportancePlot(with_respect_to="sweep/eval_predicted_speedup"),
    ])
    return ws.Workspace(entity=entity, project=project, name=name, sections=[pruning, scores, sweep],
                        settings=ws.WorkspaceSettings(x_axis=STEP_AXIS))
