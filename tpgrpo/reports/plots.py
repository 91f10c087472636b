"""The run's figures as PNG files: reward curves, the paper's Figure-1 view, turning-point heat map, images.

Each function draws from tables the stages already write (``history.csv``, ``probe.parquet``,
``credit.parquet``, eval images), writes one PNG of a fixed pixel size (``figsize`` inches x ``dpi``)
atomically and returns the matplotlib ``Figure`` (tests count its series). Matplotlib is imported
lazily and drawn with the Agg canvas directly (no pyplot, no global backend state), so the same
inputs give the same bytes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tpgrpo.io.artifacts import atomic_path

TREND_COLOURS = {1: "tab:blue", -1: "tab:red", 0: "tab:gray"}  # sign of D = R_fin - Q_0
TREND_LABELS = {1: "D > 0 (reward rises)", -1: "D < 0 (reward falls)", 0: "D = 0"}


def _new_figure(figsize: tuple[float, float], dpi: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    """The PNG at exactly figsize x dpi pixels (no tight bbox), written atomically, no date in it."""
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi, metadata={"Software": None})


def _require_columns(frame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: missing columns {missing} (has {list(frame.columns)})")


def reward_curves(history, path: Path, base_iteration: int = -1, reward: str = "eval_eval_reward",
                  strict: str = "eval_eval_strict_accuracy", figsize=(9.0, 3.4), dpi: int = 100):
    """Held-out reward and strict accuracy against iteration, the base model as a dashed line.

    Args:
        history: DataFrame with ``iteration`` and the ``reward``/``strict`` columns (as ``history.csv``);
            rows without an evaluation (NaN) are skipped.
        base_iteration: the ``iteration`` value of the base model's row (drawn as a horizontal line).
    Returns the Figure: two axes, each with the policy's curve and the base line.
    """
    _require_columns(history, ["iteration", reward, strict], "history")
    base = history[history["iteration"] == base_iteration]
    if len(base) != 1:
        raise ValueError(f"history: {len(base)} rows with iteration {base_iteration} (expected the base model's)")
    runs = history[history["iteration"] != base_iteration].dropna(subset=[reward]).sort_values("iteration")
    fig = _new_figure(figsize, dpi)
    for ax, column, name in zip(fig.subplots(1, 2), (reward, strict), ("held-out reward", "strict accuracy")):
        ax.plot(runs["iteration"], runs[column], marker="o", color="tab:blue", label="policy")
        ax.axhline(float(base[column].iloc[0]), color="black", linestyle="--", label="base model")
        ax.set(xlabel="iteration", ylabel=name, title=f"{name} vs iteration")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    _save(fig, path)
    return fig


def _pick_group(credit, prompt_id):
    """The prompt group to draw: the one asked for, else the one with most turning points (ties: first id)."""
    if prompt_id is not None:
        return prompt_id
    counts = credit.groupby("prompt_id")["turning_point"].sum()
    return sorted(counts.index[counts == counts.max()])[0]


def turning_point_view(probe, credit, path: Path, prompt_id=None, title: str | None = None,
                       figsize=(7.0, 4.5), dpi: int = 100):
    """The paper's Figure 1 for one prompt group: ``Q_0..Q_K`` of each trajectory against step.

    Args:
        probe: DataFrame with ``trajectory, prompt_id, step, reward`` (state k = 0..K, reward Q_k).
        credit: DataFrame with ``trajectory, step, turning_point, trend`` (window step k = 0..K-1, the
            transition Q_k -> Q_{k+1}; ``trend`` the sign of D = R_fin - Q_0).
        prompt_id: the group to draw; None picks the group with the most turning points.
    Each curve is coloured by its trend sign; a turning step k is drawn thick with a star at Q_{k+1}.
    Returns the Figure: one line per trajectory, one thick segment per turning point, one star collection.
    """
    _require_columns(probe, ["trajectory", "prompt_id", "step", "reward"], "probe table")
    _require_columns(credit, ["trajectory", "step", "turning_point", "trend"], "credit table")
    # credit.parquet carries prompt_id too: take it from the probe table alone (no _x/_y suffixes).
    credit = credit.drop(columns=["prompt_id"], errors="ignore").merge(
        probe[["trajectory", "prompt_id"]].drop_duplicates(), on="trajectory")
    group = _pick_group(credit, prompt_id)
    rows = probe[probe["prompt_id"] == group]
    if rows.empty:
        raise ValueError(f"probe table: no trajectory of prompt_id {group!r}")
    from matplotlib.lines import Line2D

    fig = _new_figure(figsize, dpi)
    ax = fig.subplots()
    segments = []  # (x pair, y pair, colour) of each turning step, drawn over all curves
    for traj, q in rows.sort_values(["trajectory", "step"]).groupby("trajectory", sort=True):
        steps, values = q["step"].to_numpy(), q["reward"].to_numpy(dtype=float)
        own = credit[credit["trajectory"] == traj]
        colour = TREND_COLOURS[int(np.sign(own["trend"].iloc[0])) if len(own) else 0]
        ax.plot(steps, values, color=colour, alpha=0.75, linewidth=1.2, marker=".")
        for k in sorted(own.loc[own["turning_point"].astype(bool), "step"]):
            at = np.searchsorted(steps, [k, k + 1])
            segments.append((steps[at], values[at], colour))
    for xs, ys, colour in segments:
        ax.plot(xs, ys, color=colour, linewidth=3.2)
    if segments:
        stars = [(xs[1], ys[1]) for xs, ys, _ in segments]
        ax.scatter(*zip(*stars), marker="*", s=140, color="gold", edgecolor="black", zorder=5)
    handles = [Line2D([], [], color=TREND_COLOURS[s], label=TREND_LABELS[s]) for s in (1, -1)]
    handles.append(Line2D([], [], color="gold", marker="*", markeredgecolor="black", linestyle="none",
                          markersize=12, label="turning point (end of the step)"))
    ax.legend(handles=handles, loc="best", fontsize="small")
    label = rows["prompt"].iloc[0] if "prompt" in rows.columns else group
    ax.set(xlabel="step k (state before window step k)", ylabel="Q_k (reward of the ODE completion)",
           title=title or f"Q_k of one prompt group: {label}")
    ax.grid(alpha=0.3)
    _save(fig, path)
    return fig


def turning_point_rates(credit):
    """Turning-point rate per window step (rows) and iteration (columns), a DataFrame in [0, 1].

    ``credit``: a long DataFrame with ``iteration, step, turning_point``, or a mapping
    ``{iteration: credit table}`` of tables with ``step, turning_point``.
    """
    import pandas as pd

    if isinstance(credit, Mapping):
        if not credit:
            raise ValueError("credit tables: none given")
        credit = pd.concat([t.assign(iteration=i) for i, t in credit.items()], ignore_index=True)
    _require_columns(credit, ["iteration", "step", "turning_point"], "credit table")
    return credit.pivot_table(index="step", columns="iteration", values="turning_point",
                              aggfunc=lambda s: float(np.mean(s.astype(float)))).sort_index().sort_index(axis=1)


def turning_point_heatmap(credit, path: Path, figsize=(8.0, 4.0), dpi: int = 100):
    """Heat map of the turning-point rate, window step (rows, 0 on top) x iteration (columns).

    ``credit`` as in :func:`turning_point_rates`. Returns the Figure: one image and its colour bar.
    """
    rates = turning_point_rates(credit)
    fig = _new_figure(figsize, dpi)
    ax = fig.subplots()
    iterations, steps = rates.columns.to_numpy(), rates.index.to_numpy()
    image = ax.imshow(rates.to_numpy(dtype=float), aspect="auto", cmap="viridis", vmin=0.0,
                      vmax=max(float(np.nanmax(rates.to_numpy(dtype=float))), 1e-9), interpolation="nearest")
    # Tick labels are the iteration and step values, at most 12 per axis so 1,000 iterations stay readable.
    for axis, values in ((ax.xaxis, iterations), (ax.yaxis, steps)):
        at = np.unique(np.linspace(0, len(values) - 1, min(len(values), 12)).round().astype(int))
        axis.set_ticks(at, labels=[str(values[i]) for i in at])
    ax.set(xlabel="iteration", ylabel="window step k", title="turning-point rate by step and iteration")
    fig.colorbar(image, ax=ax, label="turning-point rate")
    _save(fig, path)
    return fig


def before_after_grid(base_images, final_images, labels: Sequence[str], path: Path,
                      row_names=("base model", "final policy"), cell_inches: float = 1.6, dpi: int = 100,
                      verdicts=None):
    """The same held-out prompts and eval seeds from the base model (top row) and the final policy
    (bottom row), one column per image, the prompt above it.

    Args:
        base_images, final_images: uint8 arrays (N, H, W, 3), row i of each from the same prompt and seed.
        labels: N prompt labels.
        verdicts: optional (base, final) bool arrays (N,) (either may be None): each image is framed green
            when right, red when wrong, and each row's name counts the right ones.
        cell_inches: width of one column; the figure is (cell_inches * N + 0.6) x (2 cell_inches + 0.9)
            inches at ``dpi``.
    Returns the Figure: 2N axes, each with one image.
    """
    base, final = np.asarray(base_images), np.asarray(final_images)
    if base.shape != final.shape or base.ndim != 4 or base.shape[-1] != 3 or base.dtype != np.uint8:
        raise ValueError(f"expected two uint8 arrays (N, H, W, 3) of one shape, got {base.shape} {base.dtype} "
                         f"and {final.shape} {final.dtype}")
    if len(labels) != len(base) or len(base) == 0:
        raise ValueError(f"got {len(base)} image pairs and {len(labels)} labels (expected equal, at least 1)")
    n = len(base)
    verdicts = verdicts or (None, None)
    fig = _new_figure((cell_inches * n + 0.6, 2 * cell_inches + 0.9), dpi)
    axes = fig.subplots(2, n, squeeze=False)
    for row, (images, name, right) in enumerate(zip((base, final), row_names, verdicts)):
        if right is not None:
            name = f"{name}\n{int(np.sum(right))} of {n} right"
        for col in range(n):
            ax = axes[row, col]
            ax.imshow(images[col], interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if right is not None:  # a thick frame: the verdict is seen before the prompt is read
                for spine in ax.spines.values():
                    spine.set_edgecolor("#1a9641" if right[col] else "#d7191c")
                    spine.set_linewidth(3)
            if row == 0:
                ax.set_title("\n".join(textwrap.wrap(str(labels[col]), 18)[:3]), fontsize=8)
            if col == 0:
                ax.set_ylabel(name, fontsize=9)
    _save(fig, path)
    return fig
