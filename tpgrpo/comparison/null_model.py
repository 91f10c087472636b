"""How often the comparison's intervals exclude 0 when nothing differs: a simulation of paired differences.

The model of one comparison's per-image differences A - B (seed s, prompt p, image j):

    d[s, p, j] = true_diff + seed_effect[s] + prompt_effect[p] + noise[s, p, j]

seed_effect ~ N(0, seed_sd) is what another training seed changes, prompt_effect ~ N(0, prompt_sd) a
prompt one mode handles better in every seed (shared by the seeds), noise ~ N(0, image_sd) the rest. With
true_diff = 0 the share of draws whose 95% interval excludes 0 is the false-exclusion rate (nominal 5%);
with true_diff > 0 the share whose interval lies above 0 is the power. Used by
tests/test_comparison_intervals.py and bench/compare_intervals.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpgrpo.comparison.stats import seed_prompt_bootstrap, t_interval_of_cells


@dataclass(frozen=True)
class NullModel:
    seeds: int = 3
    prompts: int = 20
    images: int = 4          # images per prompt (eval samples)
    seed_sd: float = 0.02    # the setting
    prompt_sd: float = 0.0
    image_sd: float = 0.05   # with seed_sd 0.02: the bootstrap excludes 0 in 19% at 3 seeds (the issue: 26%)


def simulate(model: NullModel, draws: int, rng: np.random.Generator, true_diff: float = 0.0) -> np.ndarray:
    """(draws, S, P, images) per-image differences A - B under ``model``."""
    m = model
    return (true_diff + rng.normal(0.0, m.seed_sd, (draws, m.seeds, 1, 1))
            + rng.normal(0.0, m.prompt_sd, (draws, 1, m.prompts, 1))
            + rng.normal(0.0, m.image_sd, (draws, m.seeds, m.prompts, m.images)))


def t_rates(model: NullModel, draws: int, seed: int = 0, true_diff: float = 0.03) -> tuple[float, float]:
    """(false-exclusion rate at no difference, power at ``true_diff``) of
    :func:`tpgrpo.comparison.stats.seed_prompt_t_interval` (its vectorised core), ``draws`` each."""
    rng = np.random.default_rng(seed)
    _, lo, hi = t_interval_of_cells(simulate(model, draws, rng).mean(axis=-1))
    _, lo_true, _ = t_interval_of_cells(simulate(model, draws, rng, true_diff).mean(axis=-1))
    return float(np.mean((lo > 0) | (hi < 0))), float(np.mean(lo_true > 0))


def bootstrap_rates(model: NullModel, draws: int, seed: int = 0, true_diff: float = 0.03,
                    n_boot: int = 1000) -> tuple[float, float]:
    """The same two rates for the percentile :func:`tpgrpo.comparison.stats.seed_prompt_bootstrap` (one
    bootstrap per draw: slower, so fewer draws)."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(model.prompts), model.images)
    out = []
    for shift in (0.0, true_diff):
        d = simulate(model, draws, rng, shift).reshape(draws, model.seeds, -1)
        bounds = np.array([seed_prompt_bootstrap(x, ids, n_boot=n_boot, seed=k)[1:] for k, x in enumerate(d)])
        out.append(np.mean((bounds[:, 0] > 0) | (bounds[:, 1] < 0)) if shift == 0 else np.mean(bounds[:, 0] > 0))
    return float(out[0]), float(out[1])
