"""How many training seeds and held-out images per prompt a paired verdict needs, from an archived pair of arms
(the tree's equal-wall effect of about +0.012 on `geneval_soft` was not detectable at 6 seeds x 108 prompts
x 2 images).

    python -m bench.studies.power_plan A_ROOT/ARM B_ROOT/ARM [A2_ROOT/ARM B2_ROOT/ARM ...] --at IA:IB [--effect 0.012]

(several pairs of arms pool their seeds: two archives of the same comparison on other seeds.)

Reads the per-image held-out rewards of A at IA and B at IB (``eval.parquet``, paired by image as
``bench/studies/arm_pairs.py``), splits the paired difference d[s, p, k] (training seed s, prompt p, eval image
k) into the variance components of a two-way model with interaction, d = mu + a_s + b_p + c_sp + e_spk, by the
method of moments on the balanced table, and projects the expected half width of the report's interval
(``tpgrpo.comparison.stats.t_interval_of_cells``: sqrt(t_{P-1}^2 Vp / P + t_{S-1}^2 Vs / S), with the prompt
means' variance Vp = var_b + var_c / S + var_e / (S K) and the seed means' Vs = var_a + var_c / P +
var_e / (P K)) for other seed counts S and images per prompt K at the same P prompts (the shipped held-out
set is every prompt its templates allow, so P cannot grow without new templates). A projection from one
archive's estimates, not a guarantee: the components themselves are estimated from S seeds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np



def paired_cube(a_arm: Path, b_arm: Path, ia: int, ib: int, seeds: list[int],
                column: str = "eval_reward") -> np.ndarray:
    """(S, P, K) paired differences of ``column``, A at ``ia`` - B at ``ib``, prompts and images in one order for
    every seed."""
    from bench.studies.arm_pairs import paired_row

    from tpgrpo.comparison.store import read_eval_table

    rows = []
    for seed in seeds:
        ta, tb = (read_eval_table(arm / f"seed{seed}" / "data" / "iters" / f"{it:04d}" / "eval.parquet")
                  for arm, it in ((a_arm, ia), (b_arm, ib)))
        paired = paired_row(ta, tb, column)
        if paired is None:
            raise SystemExit(f"seed {seed}: the two tables hold other images")
        diff, prompts = paired
        rows.append(diff.reshape(len(set(prompts)), -1))  # images sorted by prompt: K a row
    return np.stack(rows)


def components(d: np.ndarray) -> dict[str, float]:
    """Variance components (var_a seeds, var_b prompts, var_c seed x prompt, var_e image) of a balanced (S, P, K)
    table, by the method of moments; a negative estimate is set to 0."""
    n_s, n_p, n_k = d.shape
    var_e = float(d.var(axis=2, ddof=1).mean()) if n_k > 1 else 0.0
    cells = d.mean(axis=2)
    resid = cells - cells.mean(axis=1, keepdims=True) - cells.mean(axis=0, keepdims=True) + cells.mean()
    ms_cell = float((resid ** 2).sum() / ((n_s - 1) * (n_p - 1)))  # var_c + var_e / K
    var_s = float(cells.mean(axis=1).var(ddof=1))
    var_p = float(cells.mean(axis=0).var(ddof=1))
    return {"var_a": max(0.0, var_s - ms_cell / n_p), "var_b": max(0.0, var_p - ms_cell / n_s),
            "var_c": max(0.0, ms_cell - var_e / n_k), "var_e": var_e}


def half_width(c: dict[str, float], n_s: int, n_p: int, n_k: int, level: float = 0.95) -> float:
    """Expected half width of the report's interval at S seeds, P prompts, K images per prompt."""
    from tpgrpo.comparison.stats import t_quantile

    q = 0.5 + level / 2
    v_p = c["var_b"] + c["var_c"] / n_s + c["var_e"] / (n_s * n_k)
    v_s = c["var_a"] + c["var_c"] / n_p + c["var_e"] / (n_p * n_k)
    return float(np.sqrt(t_quantile(q, n_p - 1) ** 2 * v_p / n_p + t_quantile(q, n_s - 1) ** 2 * v_s / n_s))


def main(argv: list[str] | None = None) -> None:
    from tpgrpo.comparison.stats import seed_prompt_t_interval

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", type=Path, nargs="+", help="A B, or pairs A B A2 B2 ... whose seeds are pooled")
    ap.add_argument("--at", required=True, help="IA:IB, the iterations of A and B paired")
    ap.add_argument("--effect", type=float, default=0.012, help="the difference a verdict should resolve")
    ap.add_argument("--column", default="eval_reward", help="eval_reward (the report's), or train_reward (the "
                    "training reward of the same held-out images)")
    a = ap.parse_args(argv)
    if len(a.arms) % 2:
        ap.error("arms come in pairs: A B [A2 B2 ...]")
    ia, ib = (int(x) for x in a.at.split(":"))
    from tpgrpo.comparison.store import seed_folders

    have = lambda arm: {int(p.name[4:]) for p in seed_folders(arm)}  # noqa: E731
    parts, seeds = [], []
    for arm_a, arm_b in zip(a.arms[::2], a.arms[1::2]):
        both = sorted(have(arm_a) & have(arm_b))
        parts.append(paired_cube(arm_a, arm_b, ia, ib, both, a.column))
        seeds += both
    d = np.concatenate(parts)
    n_s, n_p, n_k = d.shape
    mean, lo, hi = seed_prompt_t_interval(d.reshape(n_s, -1), np.repeat(np.arange(n_p), n_k))
    c = components(d)
    print(f"{a.column}, A@{ia} - B@{ib}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (the report's 95%) over S={n_s} seeds "
          f"{seeds}, P={n_p} prompts, K={n_k} images per prompt")
    print("variance components: " + ", ".join(f"{k} {v:.2e}" for k, v in c.items()))
    print(f"projected 95% half width (at P={n_p}); a verdict resolves {a.effect:+.3f} where it is below that:")
    ks = sorted({n_k, 2, 4, 8, 16})
    print("  seeds S " + "".join(f"   K={k:<3}" for k in ks))
    for s in (3, 6, 9, 12, 18, 24):
        cells = "".join(f"  {half_width(c, s, n_p, k):.4f}{'*' if half_width(c, s, n_p, k) < a.effect else ' '}"
                        for k in ks)
        print(f"  {s:>7} {cells}")
    print("  (* below the effect)")


if __name__ == "__main__":
    main()
