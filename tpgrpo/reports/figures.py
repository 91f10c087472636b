"""The run's four figures in ``data/reports/`` (``tpgrpo plot``; the summary stage runs it too).

- ``reward_curves.png``: held-out reward and strict accuracy against iteration, the base model as a line;
- ``turning_points.png``: the paper's Figure-1 view of the last iteration (``Q_0..Q_K`` of one prompt group);
- ``turning_point_rates.png``: turning-point rate by window step and iteration;
- ``before_after.png``: the same held-out prompts and eval seeds from the base model and the final policy,
  each image framed by the eval reward's strict verdict (green right, red wrong).

Drawing is in :mod:`tpgrpo.reports.plots`; this module only gathers the run's tables and images.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.io.artifacts import IterationPaths, read_json
from tpgrpo.reports import FIGURES, figure_names  # noqa: F401 (FIGURES re-exported)

TURNING_POINTS = "turning_points.png"  # for credit.mode flow_grpo: flat Q_k = R_fin, no turning point
GRID_PER_KIND = 3  # held-out prompts of each kind in the before/after figure (first eval seed of each)


def tp_rate_table(root: Path, iterations: range):
    """Long table ``iteration, step, turning_point`` (the rate) from each iteration's ``credit.json``:
    small files, so the heat map stays cheap at 1,000 iterations."""
    import pandas as pd

    rows = []
    for i in iterations:
        rates = read_json(IterationPaths(root, i).credit_metrics, f"credit metrics of iteration {i}")
        rows += [{"iteration": i, "step": k, "turning_point": r}
                 for k, r in enumerate(rates["turning_point_rate_per_step"])]
    return pd.DataFrame(rows)


def grid_prompts(cfg, root: Path) -> list[dict]:
    """The before/after figure's prompts, fixed before any result: the first ``GRID_PER_KIND`` evaluated
    held-out prompts of each kind (single, counting, two objects, position), in the eval file's order."""
    from tpgrpo.stage_common import resolve
    from tpgrpo.tasks.prompts import load_prompts

    metas = load_prompts(resolve(root, cfg.task.eval_prompts))[:cfg.eval.num_prompts]
    taken: dict[str, int] = {}
    chosen = []
    for meta in metas:
        kind = str(meta.get("kind", ""))
        if taken.get(kind, 0) < GRID_PER_KIND:
            taken[kind] = taken.get(kind, 0) + 1
            chosen.append(meta)
    return chosen


def grid_images(cfg, root: Path, policy: int):
    """uint8 ``(P, H, W, 3)`` ODE images of the ``grid_prompts`` at their first eval seed, from policy
    ``policy`` (0 = base model; its EMA with ``update.ema``, as eval scores), and their prompts."""
    from tpgrpo.policy.generate import evaluation_seeds, sample_ode
    from tpgrpo.policy.loading import policy_to_score

    metas = grid_prompts(cfg, root)
    # The eval's own seeds: with samples_per_prompt S, prompt p's first seed is at index p * S.
    seeds = evaluation_seeds(cfg.eval.seed, metas, cfg.eval.samples_per_prompt)[::cfg.eval.samples_per_prompt]
    backend = policy_to_score(cfg, root, policy)[0]  # the weights eval scores: the EMA with update.ema
    images = sample_ode(backend, [m["prompt"] for m in metas], seeds, num_steps=cfg.eval.num_steps,
                        guidance_scale=cfg.eval.guidance_scale, shift=cfg.sampling.shift,
                        batch_size=cfg.rollout.batch_size)
    return images, [m["prompt"] for m in metas]


def make_figures(cfg, root: Path, history, out_dir: Path | None = None) -> list[Path]:
    """Write the four figures for iterations 1..train.iterations from the ``history.csv`` frame (base model
    = iteration 0); returns their paths."""
    from tpgrpo.reports import plots
    from tpgrpo.io.artifacts import read_table
    from tpgrpo.io.schemas import CREDIT, PROBE

    out = out_dir or root / "data" / "reports"
    last = cfg.train.iterations
    paths = {name: out / name for name in figure_names(cfg)}
    plots.reward_curves(history, paths["reward_curves.png"], base_iteration=0)
    last_paths = IterationPaths(root, last)
    probe = read_table(last_paths.probe, PROBE, f"probe table of iteration {last}")
    credit = read_table(last_paths.credit, CREDIT, f"credit table of iteration {last}")
    plots.turning_point_view(probe, credit, paths[TURNING_POINTS],
                             title=f"iteration {last}: Q_k of one prompt group's trajectories")
    plots.turning_point_heatmap(tp_rate_table(root, range(1, last + 1)), paths["turning_point_rates.png"])
    base, labels = grid_images(cfg, root, 0)
    final, _ = grid_images(cfg, root, last)
    verdicts = [strict_verdicts(cfg, root, images) for images in (base, final)]
    plots.before_after_grid(base, final, labels, paths["before_after.png"], row_names=("base model", f"policy {last}"),
                            verdicts=verdicts)
    return list(paths.values())


def strict_verdicts(cfg, root: Path, images):
    """Bool ``(P,)``: the eval reward's strict verdict of each ``grid_prompts`` image (None without one)."""
    import numpy as np

    from tpgrpo.tasks.rewards import build_reward

    scored = build_reward(cfg.task.eval_reward, cfg, root)(images, grid_prompts(cfg, root))
    strict = getattr(scored, "strict", None)
    return None if strict is None else np.asarray(strict, dtype=bool)
