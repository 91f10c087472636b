"""The paper's claims about a comparison and their verdicts, and ``collect``: every table of one root.

A claim "A beats B" is decided by the interval of A - B over training seeds and prompts
(:func:`tpgrpo.comparison.stats.seed_prompt_t_interval`): confirmed / refuted where it excludes 0, not
detectable where it does not, "one seed: a hint" where only one training seed was run (its interval has no
seed variance in it), not run where the runs are missing. The pairs themselves: :mod:`tpgrpo.comparison.results`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from tpgrpo.comparison.results import (MIN_PROMPTS, N_BOOT, NOT_COMPARABLE, RESULTS, WALL_KINDS, Pair, by_variant,
                                       collect_curves, compare_pair)
from tpgrpo.comparison.runs import BASELINE_MODE, discover, flatten
from tpgrpo.comparison.stats import verdict
from tpgrpo.errors import PipelineError


@dataclass(frozen=True)
class Claim:
    key: str
    text: str                    # what the paper says, as a claim "A beats B"
    paper: str                   # the paper's numbers
    pair: Pair
    requires: dict = field(default_factory=dict)  # {variant: {params key: value}} the claim presumes
    # Read from the equal-wall pair B - A turned round: for an arm cheaper than flow_grpo, the equal-wall pass
    # gives the extra iterations to A (the arm), and an equal-wall pair's B is always the one extended.
    mirror: bool = False


PAPER = "GenEval 0.9725 (TP) / 0.9714 (w/o constraint) vs 0.9673 (Flow-GRPO)"
CLAIMS = (
    Claim("tp_beats_flow", "TP-GRPO beats Flow-GRPO at the same iteration", PAPER, Pair("tp", BASELINE_MODE)),
    Claim("tpu_beats_flow", "TP-GRPO w/o constraint beats Flow-GRPO at the same iteration", PAPER,
          Pair("tp_unconstrained", BASELINE_MODE)),
    Claim("constraint", "the constraint helps on compositional prompts (OCR and PickScore go the other way)",
          "GenEval 0.9725 with vs 0.9714 without", Pair("tp", "tp_unconstrained")),
    Claim("equal_wall", "TP-GRPO beats Flow-GRPO at equal wall-clock time", "Figure 8 (PickScore)",
          Pair("tp", BASELINE_MODE, "equal_wall")),
    Claim("equal_wall_net", "TP-GRPO beats Flow-GRPO at equal wall-clock time, model loading left out",
          "Figure 8 (PickScore)", Pair("tp", BASELINE_MODE, "equal_wall_net")),
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
TREE = "tree-tp"  # TP-GRPO on ODE-anchored trees (tpgrpo.comparison.variants.tree_variants)
TREE_PAPERS = "not in the paper: BranchGRPO / TreeGRPO share prefixes, TempFlow-GRPO / G2RPO branch off an ODE anchor"
TREE_CLAIMS = (
    Claim("tree_beats_flow", "TP-GRPO on trees beats Flow-GRPO at the same iteration", TREE_PAPERS,
          Pair(TREE, BASELINE_MODE)),
    Claim("tree_equal_wall", "TP-GRPO on trees beats Flow-GRPO at equal wall-clock time (the tree given the "
          "iterations its cheaper iteration buys)", TREE_PAPERS, Pair(TREE, BASELINE_MODE, "equal_wall"), mirror=True),
    Claim("tree_beats_chain", "TP-GRPO on trees beats TP-GRPO on chains at the same iteration", TREE_PAPERS,
          Pair(TREE, "tp")),
    Claim("tree_equal_wall_chain", "TP-GRPO on trees beats TP-GRPO on chains at equal wall-clock time (the tree "
          "given the iterations its cheaper iteration buys)", TREE_PAPERS, Pair(TREE, "tp", "equal_wall"), mirror=True),
    Claim("tree_turning_points", "on trees, turning points beat incremental credit at the same iteration",
          TREE_PAPERS, Pair(TREE, "tree-incremental")),
)


NFT_PAPER = "DiffusionNFT: up to 25x Flow-GRPO's efficiency; GenEval 0.24 -> 0.98 in about 1,000 steps (SD3.5-M)"
AWM_PAPER = "AWM: 24-34x Flow-GRPO's speed (SD3.5-M)"
NOT_PAPER = "not in any paper: TP's exact step credit inside a forward-process objective"
OBJECTIVE_CLAIMS = (  # the forward-process objectives (tpgrpo.comparison.variants.OBJECTIVES) as arms
    Claim("nft_beats_flow", "DiffusionNFT beats Flow-GRPO at the same iteration", NFT_PAPER, Pair("nft", BASELINE_MODE)),
    Claim("awm_beats_flow", "AWM beats Flow-GRPO at the same iteration", AWM_PAPER, Pair("awm", BASELINE_MODE)),
    Claim("nft_beats_awm", "DiffusionNFT beats AWM at the same iteration", "not compared in either paper",
          Pair("nft", "awm")),
    Claim("nft_beats_tree", "DiffusionNFT beats TP-GRPO on trees at the same iteration", NFT_PAPER, Pair("nft", TREE)),
    Claim("tp_credit_nft", "TP's tree step credit inside DiffusionNFT beats plain DiffusionNFT at the same iteration",
          NOT_PAPER, Pair("tree-tp-nft", "nft")),
    Claim("tp_credit_awm", "TP's tree step credit inside AWM beats plain AWM at the same iteration", NOT_PAPER,
          Pair("tree-tp-awm", "awm")),
)
OBJECTIVE_ARMS = {name for claim in OBJECTIVE_CLAIMS for name in (claim.pair.a, claim.pair.b)} - {BASELINE_MODE, TREE}
# the other arms' best-learning-rate claims against Flow-GRPO's best (chain TP-GRPO's are the two above)
BEST_LR_ARMS = ((TREE, "TP-GRPO on trees", TREE_PAPERS), ("nft", "DiffusionNFT", NFT_PAPER), ("awm", "AWM", AWM_PAPER))


def best_lr_variant(arm: str, runs: Sequence[dict], curves: pd.DataFrame, last: int = 3) -> str | None:
    """Among the main variant ``arm`` and its learning-rate sweep (the variants whose reference it is), the one
    with the highest training reward (rollout mean over its last ``last`` iterations within the budget, mean
    over seeds): chosen on the training reward so that the held-out comparison is not also the selection. By
    arm, not by credit mode: NFT, AWM and the tree arms share Flow-GRPO's or TP's credit mode."""
    names = {r["variant"] for r in runs if (r["family"] == "main" and r["variant"] == arm)
             or (r["family"] == "lr_sweep" and r.get("reference") == arm)}
    scores = {}
    for name in names:
        budget = min(int(r["budget"]) for r in runs if r["variant"] == name)
        rows = curves[(curves["variant"] == name) & curves["iteration"].between(max(1, budget - last + 1), budget)]
        if len(rows):
            scores[name] = float(rows["train_reward"].mean())
    return max(sorted(scores), key=scores.get) if scores else None


def standard_pairs(runs: Sequence[dict], curves: pd.DataFrame) -> list[tuple[str, Pair]]:
    """The comparisons every report shows: each main mode against flow_grpo (same iteration; equal wall
    clock, with and without model loading where measured, when flow_grpo was extended), each ablation
    against its reference, and with a learning-rate sweep each mode at its best rate against flow_grpo at
    its best."""
    main = [v for v in dict.fromkeys(r["variant"] for r in runs if r["family"] == "main")]
    kinds = WALL_KINDS if "net_seconds" in curves and curves["net_seconds"].notna().any() else WALL_KINDS[:1]
    out = []
    if BASELINE_MODE in main:
        extended = _extended(runs, BASELINE_MODE)
        for v in main:
            if v != BASELINE_MODE:
                out.append(("defaults", Pair(v, BASELINE_MODE)))
                if extended:
                    out += [("equal wall", Pair(v, BASELINE_MODE, k)) for k in kinds]
                if _extended(runs, v):  # an arm cheaper than flow_grpo: it was given the extra iterations
                    out += [("equal wall", Pair(BASELINE_MODE, v, k)) for k in kinds]
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
                    out += [("best lr, equal wall", Pair(v, flow, k)) for k in kinds]
    return out


def _extended(runs: Sequence[dict], variant: str) -> bool:
    """Whether an equal-wall pass raised ``variant``'s iterations above the comparison's budget."""
    return any(int(r["params"]["train"]["iterations"]) > int(r["budget"]) for r in runs if r["variant"] == variant)


def best_variants(runs: Sequence[dict], curves: pd.DataFrame) -> dict[str, str | None]:
    """Each main arm's variant at its best learning rate (:func:`best_lr_variant`); empty without a sweep."""
    if not any(r["family"] == "lr_sweep" for r in runs):
        return {}
    return {v: best_lr_variant(v, runs, curves) for v in dict.fromkeys(r["variant"] for r in runs
                                                                       if r["family"] == "main")}


def best_lr_claims(runs: Sequence[dict], curves: pd.DataFrame) -> list[Claim]:
    """The step-size-fair versions of the TP-vs-Flow-GRPO claims: each mode at its own best learning rate
    of the sweep (Flow-GRPO copies R_fin to every window step, so one learning rate gives it a stronger
    update than per-step credit gets). None without a sweep of both."""
    best = best_variants(runs, curves)
    tp, flow = best.get("tp"), best.get(BASELINE_MODE)
    if not flow:
        return []
    out = [] if not tp else [
        Claim("tp_beats_flow_best_lr", "TP-GRPO beats Flow-GRPO at the same iteration, each at its best learning "
              "rate", PAPER, Pair(tp, flow)),
        Claim("equal_wall_best_lr", "TP-GRPO beats Flow-GRPO at equal wall-clock time, each at its best learning "
              "rate", "Figure 8 (PickScore)", Pair(tp, flow, "equal_wall"))]
    for arm, name, paper in BEST_LR_ARMS:
        if best.get(arm):
            out.append(Claim(f"{arm}_beats_flow_best_lr", f"{name} beats Flow-GRPO at the same iteration, each at "
                             "its best learning rate", paper, Pair(best[arm], flow)))
    return out


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
    h = lookup(pairs, Pair(claim.pair.b, claim.pair.a, claim.pair.kind)) if claim.mirror else lookup(pairs, claim.pair)
    if h is None or not np.isfinite(h["reward_diff"]):
        return {**row, "verdict": "not run", "note": "not compared" if h is None else h["note"]}
    if claim.mirror:
        h = mirrored(h)
    if str(h.get("note") or "").startswith(NOT_COMPARABLE):
        return {**row, "verdict": NOT_COMPARABLE, "note": h["note"]}
    keys = ("reward_diff", "reward_lo", "reward_hi", "reward_seed_lo", "reward_seed_hi", "reward_boot_lo",
            "reward_boot_hi", "seeds", "n_seeds", "per_seed_reward_diff")
    # the verdict is the interval over training seeds and prompts: over prompts alone, a difference one
    # seed of three reverses can still look certain; from one seed, no verdict is more than a hint
    n = int(h["n_seeds"])
    return {**row, **{k: h[k] for k in keys}, "verdict": verdict(h["reward_seed_lo"], h["reward_seed_hi"], seeds=n),
            "verdict_prompts_only": verdict(h["reward_lo"], h["reward_hi"], seeds=n),
            "verdict_bootstrap": verdict(h["reward_boot_lo"], h["reward_boot_hi"], seeds=n),
            "note": f"only {int(h['prompts'])} held-out prompts: the interval is unreliable"
                    if h["prompts"] < MIN_PROMPTS else ""}


def lookup(pairs: pd.DataFrame, pair: Pair) -> dict | None:
    """The row of ``pair`` in the pairs table, or (same-iteration pairs only) its reverse (B - A) turned
    round: A - B = -(B - A), the intervals mirrored (both are symmetric in the sign of the differences). An
    equal-wall pair is never reversed: B - A there would give A the extra iterations. None if not there."""
    orders = (((pair.a, pair.b), 1), ((pair.b, pair.a), -1)) if pair.kind == "iteration" else (((pair.a, pair.b), 1),)
    for (a, b), sign in orders:
        hit = pairs[(pairs["a"] == a) & (pairs["b"] == b) & (pairs["kind"] == pair.kind)]
        if len(hit):
            h = hit.iloc[0].to_dict()
            return mirrored(h) if sign < 0 and np.isfinite(h["reward_diff"]) else h
    return None


def mirrored(h: dict) -> dict:
    """A pairs-table row of A - B as B - A: the difference negated, every interval mirrored (they are
    symmetric in the sign of the differences)."""
    return {**h, "reward_diff": -h["reward_diff"], "reward_lo": -h["reward_hi"], "reward_hi": -h["reward_lo"],
            "reward_seed_lo": -h["reward_seed_hi"], "reward_seed_hi": -h["reward_seed_lo"],
            "reward_boot_lo": -h["reward_boot_hi"], "reward_boot_hi": -h["reward_boot_lo"],
            "per_seed_reward_diff": ", ".join(f"{-float(d):+.4f}" for d in h["per_seed_reward_diff"].split(","))}


def collect(out: Path, n_boot: int = N_BOOT) -> dict[str, pd.DataFrame]:
    """Read every run under OUT, compute curves, pairs and claims, write them to OUT/results/ (CSV, and
    Parquet for the long tables) and return them."""
    from tpgrpo.comparison.headline import headline_table
    from tpgrpo.comparison.loadcost import load_record, with_net_seconds
    from tpgrpo.io.artifacts import atomic_path

    runs = discover(out)
    if not runs:
        raise PipelineError(f"{out}: no run folders (*/seed*/run.json): run the comparison first")
    curves, tp_rates = collect_curves(runs)
    curves = with_net_seconds(curves, load_record(out))
    grouped = by_variant(runs)
    computed = {}
    claims_here = [*CLAIMS, *best_lr_claims(runs, curves),
                   *(TREE_CLAIMS if any(r["variant"] == TREE for r in runs) else ()),
                   *(OBJECTIVE_CLAIMS if any(r["variant"] in OBJECTIVE_ARMS for r in runs) else ())]
    asked = [Pair(c.pair.b, c.pair.a, c.pair.kind) if c.mirror else c.pair for c in claims_here]
    for label, pair in [*standard_pairs(runs, curves), *(("claim", p) for p in asked)]:
        reverse = Pair(pair.b, pair.a, pair.kind)
        if pair not in computed and not (pair.kind == "iteration" and reverse in computed):
            computed[pair] = {"set": label, **compare_pair(pair, grouped, curves, n_boot)}
    pairs = pd.DataFrame(list(computed.values()))
    claims = pd.DataFrame([claim_row(c, pairs, grouped) for c in claims_here])
    tables = {"curves": curves, "tp_rates": tp_rates, "pairs": pairs, "claims": claims,
              "headline": headline_table(curves, grouped)}
    from tpgrpo.comparison.store import is_compact

    folder = out / ("tables" if is_compact(out) else RESULTS)  # a compact archive's own results/ is its parent
    for name, frame in tables.items():
        with atomic_path(folder / f"{name}.csv") as tmp:
            # 12 significant digits: interval ends differed in the 16th between an Intel and an AMD CPU (the
            # same archives, the same code), so the full repr made the committed CSVs machine-dependent
            frame.to_csv(tmp, index=False, float_format="%.12g")
        if name in ("curves", "tp_rates"):
            with atomic_path(folder / f"{name}.parquet") as tmp:
                frame.to_parquet(tmp, index=False)
    return tables
