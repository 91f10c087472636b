"""Reports: the summary's figures and plots, and the base model's report.

The figure files' names live here, not in :mod:`tpgrpo.reports.figures`: dvc.yaml's renderer declares them as
the summary stage's outputs, and the drawing code loads policies (:mod:`tpgrpo.policy.loading`); naming them
there once made an import cycle through the renderer's stage params.
"""

FIGURES = ("reward_curves.png", "turning_points.png", "turning_point_rates.png", "before_after.png")


def figure_names(cfg) -> list[str]:
    """The figures a run of these params draws: the same for every credit mode (one dvc.yaml for all)."""
    return list(FIGURES)
