"""Collect a comparison (:mod:`tpgrpo.comparison.runs`) from its stored run folders: curves, paired differences
with bootstrap intervals, and the paper's claims marked confirmed / refuted / not detectable / not run.

Paired difference of variant A against variant B (both scored on the same held-out prompts and eval seeds):
1. take the training seeds both have; for each side read every seed's per-image ``eval.parquet`` at the
   compared iteration (one row per prompt x eval sample);
2. pool the seeds: per (prompt, eval sample) the mean over training seeds (strict results as 0/1);
3. ``tpgrpo.comparison.stats.paired_bootstrap`` of A - B: the mean over images, and a 95% percentile interval from
   10,000 resamples of whole prompts (each with all its eval samples): prompt and eval-noise sampling given
   these training seeds;
4. ``tpgrpo.comparison.stats.seed_prompt_bootstrap``: a second interval that resamples the training seeds too (seed
   s of A paired with seed s of B), beside the per-seed mean differences. Verdicts use this one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from tpgrpo.comparison.stats import PAIR_KEYS, paired_bootstrap, read_eval_table, seed_prompt_bootstrap, verdict
from tpgrpo.comparison.runs import BASELINE_MODE, TRAIN_STAGES, discover, flatten, stage_seconds
from tpgrpo.errors import PipelineError

RESULTS = "results"  # OUT/results/: curves, tp_rates, pairs, claims (CSV and Parquet)
SCORES = {"reward": "eval_reward", "strict": "eval_strict"}
LEVEL, N_BOOT = 0.95, 10_000
MIN_PROMPTS = 20  # fewer held-out prompts than this: a bootstrap over prompts says little (noted in the claims)


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def run_curve(run: dict) -> tuple[list[dict], list[dict]]:
    """Rows of one run: iteration 0 (base model) and each finished iteration 1..k (stops at the first
    iteration whose stage JSONs are not all there), and its turning-point rates per window step."""
    folder, keys = Path(run["folder"]), {k: run[k] for k in ("variant", "mode", "seed", "family")}
    rows, rates = [], []
    base = _json(folder / "data" / "iters" / "baseline_eval.json")
    if base is not None:
        rows.append({**keys, "iteration": 0, "train_seconds": 0.0, "cum_seconds": 0.0,
                     "eval_reward": base.get("eval_reward"), "strict_accuracy": base.get("eval_strict_accuracy")})
    cum, i = 0.0, 1
    while True:
        d = folder / "data" / "iters" / f"{i:04d}"
        m = {s: _json(d / f"{s}.json") for s in ("rollout", "credit", "update", "eval")}  # probe: optional
        if any(v is None for v in m.values()):
            break
        seconds = sum(stage_seconds(d, s) for s in TRAIN_STAGES)
        cum += seconds
        evaluated = bool(m["eval"].get("evaluated"))
        rows.append({**keys, "iteration": i, "train_seconds": seconds, "cum_seconds": cum,
                     "eval_reward": m["eval"]["eval_reward"] if evaluated else np.nan,
                     "strict_accuracy": m["eval"]["eval_strict_accuracy"] if evaluated else np.nan,
                     "train_reward": m["rollout"].get("mean_reward"),
                     "tp_rate": m["credit"].get("turning_point_rate"),
                     "approx_kl": m["update"].get("approx_kl_after")})
        rates += [{**keys, "iteration": i, "step": k, "tp_rate": float(r)}
                  for k, r in enumerate(m["credit"].get("turning_point_rate_per_step", []))]
        i += 1
    return rows, rates


def collect_curves(runs: Sequence[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The long tables of a comparison: ``curves`` (variant, mode, seed, family, iteration, train_seconds,
    cum_seconds, eval_reward, strict_accuracy, train_reward, tp_rate, approx_kl; iteration 0 = base model)
    and ``tp_rates`` (variant, mode, seed, family, iteration, step, tp_rate)."""
    rows, rates = [], []
    for run in runs:
        r, t = run_curve(run)
        rows += r
        rates += t
    curve_cols = ["variant", "mode", "seed", "family", "iteration", "train_seconds", "cum_seconds", "eval_reward",
                  "strict_accuracy", "train_reward", "tp_rate", "approx_kl"]
    curves = pd.DataFrame(rows, columns=curve_cols).sort_values(["variant", "seed", "iteration"], kind="stable")
    tp = pd.DataFrame(rates, columns=["variant", "mode", "seed", "family", "iteration", "step", "tp_rate"])
    return curves.reset_index(drop=True), tp


def eval_table_path(folder: Path, iteration: int) -> Path:
    if iteration == 0:
        return Path(folder) / "data" / "iters" / "baseline_eval.parquet"
    return Path(folder) / "data" / "iters" / f"{iteration:04d}" / "eval.parquet"


def seed_scores(side: Sequence[tuple[Path, int]]) -> list[pd.DataFrame]:
    """Each run's (folder, iteration) per-image scores (PAIR_KEYS, eval_reward, eval_strict as 0/1), read
    once and sorted by PAIR_KEYS; the runs must share their images (same eval params), else a one-line error."""
    frames, keys = [], None
    for folder, iteration in side:
        path = eval_table_path(folder, iteration)
        t = read_eval_table(path)
        if t.empty:
            raise PipelineError(f"{path}: no rows (iteration {iteration} was not evaluated)")
        these = set(map(tuple, t[PAIR_KEYS].astype(str).to_numpy()))
        if keys is not None and these != keys:
            raise PipelineError(f"{path}: other held-out images than the runs it is pooled with "
                                "(compare runs evaluated with the same eval params)")
        keys = these
        t = t[[*PAIR_KEYS, *SCORES.values()]].astype({"eval_strict": float})
        frames.append(t.sort_values(PAIR_KEYS, ignore_index=True))
    return frames


def pooled_scores(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Per (prompt_id, sample, seed) the mean over runs (their :func:`seed_scores`) of eval_reward and
    eval_strict (0/1)."""
    return pd.concat(frames).groupby(PAIR_KEYS, sort=True)[list(SCORES.values())].mean().reset_index()


def paired_difference(a_side: Sequence[tuple[Path, int]], b_side: Sequence[tuple[Path, int]],
                      n_boot: int = N_BOOT, level: float = LEVEL) -> dict:
    """A - B on the pooled per-image scores (see the module docstring): for reward and strict accuracy
    the mean difference and its bootstrap interval, plus the per-seed mean differences (side i pairs with
    side i: same training seed)."""
    seeds_a, seeds_b = seed_scores(a_side), seed_scores(b_side)
    a, b = pooled_scores(seeds_a), pooled_scores(seeds_b)
    merged = a.merge(b, on=PAIR_KEYS, suffixes=("_a", "_b"), validate="one_to_one")
    if len(merged) != len(a) or len(merged) != len(b):
        raise PipelineError("the compared runs were evaluated on different held-out images (eval params differ)")
    out = {"prompts": int(merged["prompt_id"].nunique()), "images": len(merged)}
    for name, column in SCORES.items():
        mean, lo, hi = paired_bootstrap(merged[f"{column}_a"], merged[f"{column}_b"], merged["prompt_id"],
                                        n_boot=n_boot, seed=0, level=level)
        out.update({f"{name}_a": float(merged[f"{column}_a"].mean()), f"{name}_b": float(merged[f"{column}_b"].mean()),
                    f"{name}_diff": mean, f"{name}_lo": lo, f"{name}_hi": hi})
    per_image = []  # (S, N): seed i's A - B per image, in merged's row order
    for ta, tb in zip(seeds_a, seeds_b):
        pair = ta.merge(tb, on=PAIR_KEYS, suffixes=("_a", "_b"))
        pair = merged[PAIR_KEYS].merge(pair, on=PAIR_KEYS, how="left", validate="one_to_one")
        per_image.append((pair["eval_reward_a"] - pair["eval_reward_b"]).to_numpy())
    out["per_seed_reward_diff"] = [float(d.mean()) for d in per_image]
    _, out["reward_seed_lo"], out["reward_seed_hi"] = seed_prompt_bootstrap(
        np.stack(per_image), merged["prompt_id"], n_boot=n_boot, seed=0, level=level)
    return out


@dataclass(frozen=True)
class Pair:
    """A compared at ``kind`` against B: iteration = both at the last iteration evaluated in every run of
    both within the budget; equal_wall = B at its evaluated iteration nearest A's training seconds."""

    a: str
    b: str
    kind: str = "iteration"


@dataclass(frozen=True)
class Claim:
    key: str
    text: str                    # what the paper says, as a claim "A beats B"
    paper: str                   # the paper's numbers
    pair: Pair
    requires: dict = field(default_factory=dict)  # {variant: {params key: value}} the claim presumes


PAPER = "GenEval 0.9725 (TP) / 0.9714 (w/o constraint) vs 0.9673 (Flow-GRPO)"
CLAIMS = (
    Claim("tp_beats_flow", "TP-GRPO beats Flow-GRPO at the same iteration", PAPER, Pair("tp", BASELINE_MODE)),
    Claim("tpu_beats_flow", "TP-GRPO w/o constraint beats Flow-GRPO at the same iteration", PAPER,
          Pair("tp_unconstrained", BASELINE_MODE)),
    Claim("constraint", "the constraint helps on compositional prompts (OCR and PickScore go the other way)",
          "GenEval 0.9725 with vs 0.9714 without", Pair("tp", "tp_unconstrained")),
    Claim("equal_wall", "TP-GRPO beats Flow-GRPO at equal wall-clock time", "Figure 8 (PickScore)",
          Pair("tp", BASELINE_MODE, "equal_wall")),
    Claim("noise_0.4", "noise level 0.7 beats 0.4", "0.4 oscillates, mostly below 0.7", Pair("tp", "tp-noise0.4"),
          {"tp": {"sampling.noise_level": 0.7}}),
    Claim("noise_1.0", "noise level 0.7 beats 1.0", "1.0 destabilises training", Pair("tp", "tp-noise1.0"),
          {"tp": {"sampling.noise_level": 0.7}}),
    Claim("window_8", "SDE window 8 beats window 9", "window 8 improved (2,400 steps)", Pair("tp-window8", "tp"),
          {"tp": {"sampling.window_size": 9}}),
    Claim("window_4", "SDE window 9 beats window 4", "window 4: a sharp drop", Pair("tp", "tp-window4"),
          {"tp": {"sampling.window_size": 9}}),
    Claim("cps", "cps steps beat sde steps", "not in the paper: its code release switched to cps",
          Pair("tp-cps", "tp"), {"tp": {"sampling.step_kind": "sde"}}),
)


def by_variant(runs: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """``{variant: {seed: run}}``."""
    out: dict[str, dict[int, dict]] = {}
    for r in runs:
        out.setdefault(r["variant"], {})[int(r["seed"])] = r
    return out


def _evaluated(curves: pd.DataFrame, variant: str, seed: int, budget: int | None = None) -> pd.DataFrame:
    rows = curves[(curves["variant"] == variant) & (curves["seed"] == seed) & (curves["iteration"] > 0)]
    rows = rows.dropna(subset=["eval_reward"])
    return rows if budget is None else rows[rows["iteration"] <= budget]


def _fmt(values: Sequence) -> str:
    values = list(values)
    return str(values[0]) if len(set(values)) == 1 else ",".join(map(str, values))


def _sides(pair: Pair, runs: dict, curves: pd.DataFrame) -> tuple[list, list, list[int]] | str:
    """(A side, B side, seeds) of ``pair`` as lists of (folder, iteration, cum seconds), or why not."""
    missing = [v for v in (pair.a, pair.b) if v not in runs]
    if missing:
        return f"no runs of {', '.join(missing)}"
    seeds = sorted(set(runs[pair.a]) & set(runs[pair.b]))
    if not seeds:
        return "no training seed in common"
    budget = min(int(runs[v][s]["budget"]) for v in (pair.a, pair.b) for s in seeds)
    names = (pair.a,) if pair.kind == "equal_wall" else (pair.a, pair.b)
    common = set.intersection(*(set(_evaluated(curves, v, s, budget)["iteration"]) for v in names for s in seeds))
    if not common:
        return "no evaluated iteration in every run yet"
    it = max(common)
    side = lambda v: [(runs[v][s]["folder"], it, _cum(curves, v, s, it)) for s in seeds]  # noqa: E731
    if pair.kind == "iteration":
        return side(pair.a), side(pair.b), seeds
    if pair.kind != "equal_wall":
        raise ValueError(f"pair kind {pair.kind!r}: expected iteration or equal_wall")
    # B's iteration that costs A's `it` iterations, at each side's mean training seconds per iteration over
    # the budget (what the equal-wall pass planned with), not B's recorded seconds of its extension: those
    # depend on what else shared the machine while it ran
    target = it * _seconds_per_iteration(curves, pair.a, seeds, budget) / _seconds_per_iteration(
        curves, pair.b, seeds, budget)
    a, b = side(pair.a), []
    for s in seeds:
        run = runs[pair.b][s]
        if int(run["params"]["train"]["iterations"]) <= int(run["budget"]):
            return f"{pair.b} was not given extra iterations (run the equal-wall pass)"
        rows = _evaluated(curves, pair.b, s)
        nearest = rows.iloc[int(np.argmin(np.abs(rows["iteration"].to_numpy() - target)))]
        b.append((run["folder"], int(nearest["iteration"]), float(nearest["cum_seconds"])))
    return a, b, seeds


def _seconds_per_iteration(curves: pd.DataFrame, variant: str, seeds: Sequence[int], budget: int) -> float:
    rows = curves[(curves["variant"] == variant) & curves["seed"].isin(seeds) & curves["iteration"].between(1, budget)]
    return float(rows["train_seconds"].mean())


def _cum(curves: pd.DataFrame, variant: str, seed: int, iteration: int) -> float:
    rows = curves[(curves["variant"] == variant) & (curves["seed"] == seed) & (curves["iteration"] == iteration)]
    return float(rows["cum_seconds"].iloc[0])


def compare_pair(pair: Pair, runs: dict, curves: pd.DataFrame, n_boot: int = N_BOOT) -> dict:
    """One row of the pairs table: the paired difference of ``pair`` or, where it cannot be computed, the
    reason in ``note`` (and NaN numbers)."""
    row = {"a": pair.a, "b": pair.b, "kind": pair.kind}
    sides = _sides(pair, runs, curves)
    if isinstance(sides, str):
        return {**row, **dict.fromkeys(("reward_diff", "reward_lo", "reward_hi", "reward_seed_lo", "reward_seed_hi"),
                                       np.nan), "note": sides}
    a, b, seeds = sides
    diff = paired_difference([x[:2] for x in a], [x[:2] for x in b], n_boot=n_boot)
    per_seed = diff.pop("per_seed_reward_diff")
    return {**row, "seeds": _fmt(seeds) if len(seeds) == 1 else ",".join(map(str, seeds)),
            "iteration_a": _fmt([x[1] for x in a]), "iteration_b": _fmt([x[1] for x in b]),
            "seconds_a": float(np.mean([x[2] for x in a])), "seconds_b": float(np.mean([x[2] for x in b])),
            **diff, "per_seed_reward_diff": ", ".join(f"{d:+.4f}" for d in per_seed), "note": ""}


def best_lr_variant(mode: str, runs: Sequence[dict], curves: pd.DataFrame, last: int = 3) -> str | None:
    """Among ``mode``'s main variant and its learning-rate sweep, the one with the highest training reward
    (rollout mean over its last ``last`` iterations within the budget, mean over seeds): chosen on the
    training reward so that the held-out comparison is not also the selection."""
    names = {r["variant"] for r in runs if r["mode"] == mode and r["family"] in ("main", "lr_sweep")}
    scores = {}
    for name in names:
        budget = min(int(r["budget"]) for r in runs if r["variant"] == name)
        rows = curves[(curves["variant"] == name) & curves["iteration"].between(max(1, budget - last + 1), budget)]
        if len(rows):
            scores[name] = float(rows["train_reward"].mean())
    return max(sorted(scores), key=scores.get) if scores else None


def standard_pairs(runs: Sequence[dict], curves: pd.DataFrame) -> list[tuple[str, Pair]]:
    """The comparisons every report shows: each main mode against flow_grpo (same iteration; equal wall
    clock when flow_grpo was extended), each ablation against its reference, and with a learning-rate
    sweep each mode at its best rate against flow_grpo at its best."""
    main = [v for v in dict.fromkeys(r["variant"] for r in runs if r["family"] == "main")]
    out = []
    if BASELINE_MODE in main:
        extended = any(int(r["params"]["train"]["iterations"]) > int(r["budget"])
                       for r in runs if r["variant"] == BASELINE_MODE)
        for v in main:
            if v != BASELINE_MODE:
                out.append(("defaults", Pair(v, BASELINE_MODE)))
                if extended:
                    out.append(("equal wall", Pair(v, BASELINE_MODE, "equal_wall")))
    out += [("ablation", Pair(v, r["reference"])) for v, r in
            {r["variant"]: r for r in runs if r["family"] == "ablation"}.items()]
    best = best_variants(runs, curves)
    if best.get(BASELINE_MODE):
        flow = best[BASELINE_MODE]
        extended = any(int(r["params"]["train"]["iterations"]) > int(r["budget"]) for r in runs if r["variant"] == flow)
        for m, v in best.items():
            if m != BASELINE_MODE and v:
                out.append(("best lr", Pair(v, flow)))
                if extended:
                    out.append(("best lr, equal wall", Pair(v, flow, "equal_wall")))
    return out


def best_variants(runs: Sequence[dict], curves: pd.DataFrame) -> dict[str, str | None]:
    """Each mode's variant at its best learning rate (:func:`best_lr_variant`); empty without a sweep."""
    if not any(r["family"] == "lr_sweep" for r in runs):
        return {}
    return {m: best_lr_variant(m, runs, curves) for m in dict.fromkeys(r["mode"] for r in runs)}


def best_lr_claims(runs: Sequence[dict], curves: pd.DataFrame) -> list[Claim]:
    """The step-size-fair versions of the TP-vs-Flow-GRPO claims: each mode at its own best learning rate
    of the sweep (Flow-GRPO copies R_fin to every window step, so one learning rate gives it a stronger
    update than per-step credit gets). None without a sweep of both."""
    best = best_variants(runs, curves)
    tp, flow = best.get("tp"), best.get(BASELINE_MODE)
    if not (tp and flow):
        return []
    return [Claim("tp_beats_flow_best_lr", "TP-GRPO beats Flow-GRPO at the same iteration, each at its best "
                  "learning rate", PAPER, Pair(tp, flow)),
            Claim("equal_wall_best_lr", "TP-GRPO beats Flow-GRPO at equal wall-clock time, each at its best "
                  "learning rate", "Figure 8 (PickScore)", Pair(tp, flow, "equal_wall"))]


def claim_row(claim: Claim, pairs: pd.DataFrame, runs: dict) -> dict:
    """One row of the claims table: the claim's pair looked up in ``pairs`` and its verdict."""
    row = {"claim": claim.text, "paper": claim.paper, "a": claim.pair.a, "b": claim.pair.b, "kind": claim.pair.kind}
    for variant, wanted in claim.requires.items():
        if variant in runs:
            params = flatten(next(iter(runs[variant].values()))["params"])
            for key, value in wanted.items():
                if params.get(key) != value:
                    return {**row, "verdict": "not run", "note": f"{variant} has {key} = {params.get(key)}, "
                            f"not the paper's {value}"}
    h = lookup(pairs, claim.pair)
    if h is None or not np.isfinite(h["reward_diff"]):
        return {**row, "verdict": "not run", "note": "not compared" if h is None else h["note"]}
    keys = ("reward_diff", "reward_lo", "reward_hi", "reward_seed_lo", "reward_seed_hi", "seeds", "per_seed_reward_diff")
    # the verdict is the interval over training seeds and prompts: over prompts alone, a difference one
    # seed of three reverses can still look certain
    return {**row, **{k: h[k] for k in keys}, "verdict": verdict(h["reward_seed_lo"], h["reward_seed_hi"]),
            "verdict_prompts_only": verdict(h["reward_lo"], h["reward_hi"]),
            "note": f"only {int(h['prompts'])} held-out prompts: the interval is unreliable"
                    if h["prompts"] < MIN_PROMPTS else ""}


def lookup(pairs: pd.DataFrame, pair: Pair) -> dict | None:
    """The row of ``pair`` in the pairs table, or its reverse (B - A) turned round: A - B = -(B - A), the
    interval mirrored (the percentile bootstrap of the negated differences); None if neither is there."""
    for (a, b), sign in (((pair.a, pair.b), 1), ((pair.b, pair.a), -1)):
        hit = pairs[(pairs["a"] == a) & (pairs["b"] == b) & (pairs["kind"] == pair.kind)]
        if len(hit):
            h = hit.iloc[0].to_dict()
            if sign < 0 and np.isfinite(h["reward_diff"]):
                h.update(reward_diff=-h["reward_diff"], reward_lo=-h["reward_hi"], reward_hi=-h["reward_lo"],
                         reward_seed_lo=-h["reward_seed_hi"], reward_seed_hi=-h["reward_seed_lo"],
                         per_seed_reward_diff=", ".join(f"{-float(d):+.4f}"
                                                        for d in h["per_seed_reward_diff"].split(",")))
            return h
    return None


def collect(out: Path, n_boot: int = N_BOOT) -> dict[str, pd.DataFrame]:
    """Read every run under OUT, compute curves, pairs and claims, write them to OUT/results/ (CSV, and
    Parquet for the long tables) and return them."""
    from tpgrpo.io.artifacts import atomic_path

    runs = discover(out)
    if not runs:
        raise PipelineError(f"{out}: no run folders (*/seed*/run.json): run the comparison first")
    curves, tp_rates = collect_curves(runs)
    grouped = by_variant(runs)
    computed = {}
    claims_here = [*CLAIMS, *best_lr_claims(runs, curves)]
    for label, pair in [*standard_pairs(runs, curves), *(("claim", c.pair) for c in claims_here)]:
        if pair not in computed and Pair(pair.b, pair.a, pair.kind) not in computed:
            computed[pair] = {"set": label, **compare_pair(pair, grouped, curves, n_boot)}
    pairs = pd.DataFrame(list(computed.values()))
    claims = pd.DataFrame([claim_row(c, pairs, grouped) for c in claims_here])
    tables = {"curves": curves, "tp_rates": tp_rates, "pairs": pairs, "claims": claims}
    folder = out / RESULTS
    for name, frame in tables.items():
        with atomic_path(folder / f"{name}.csv") as tmp:
            frame.to_csv(tmp, index=False)
        if name in ("curves", "tp_rates"):
            with atomic_path(folder / f"{name}.parquet") as tmp:
                frame.to_parquet(tmp, index=False)
    return tables
