"""The comparison's report: Markdown plus PNG figures, drawn from the stored run folders only.

``write_report([OUT, ...], docs/replication.md)`` collects each comparison root (:func:`collect`), draws its
figures into ``docs/replication/`` and writes one Markdown page with a section per root. Figures follow
:mod:`tpgrpo.reports.plots`: matplotlib imported lazily, the Agg canvas, a fixed pixel size, atomic writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from tpgrpo.io.artifacts import atomic_path
from tpgrpo.comparison.runs import discover, equal_wall_records
from tpgrpo.comparison.archive import MARKER as ARCHIVE_MARKER
from tpgrpo.comparison.claims import collect
from tpgrpo.comparison.loadcost import load_record
from tpgrpo.comparison.method import method_text
from tpgrpo.comparison.results import LEVEL, N_BOOT
from tpgrpo.reports.plots import _new_figure, _save

FIGURES = ("reward_vs_iteration.png", "reward_vs_wall.png", "paired_differences.png", "tp_rate_per_step.png")
ABLATION_FIGURE = "ablations_vs_iteration.png"
METRICS = (("eval_reward", "held-out reward"), ("strict_accuracy", "strict accuracy"))


def seed_band(curves: pd.DataFrame, variant: str, column: str) -> pd.DataFrame:
    """Per iteration of ``variant``: mean, min and max of ``column`` over training seeds, and the mean
    cumulative training seconds (the wall-clock x). Iterations without an evaluation are dropped; an
    iteration counts only where every seed has it."""
    rows = curves[curves["variant"] == variant].dropna(subset=[column])
    seeds = rows["seed"].nunique()
    g = rows.groupby("iteration")
    band = pd.DataFrame({"mean": g[column].mean(), "lo": g[column].min(), "hi": g[column].max(),
                         "seconds": g["cum_seconds"].mean(), "n": g["seed"].nunique()})
    return band[band["n"] == seeds].reset_index()


def reward_figure(curves: pd.DataFrame, variants: Sequence[str], path: Path, x: str = "iteration",
                  figsize=(10.0, 3.8), dpi: int = 100):
    """Held-out reward and strict accuracy of each variant against ``x`` (``iteration`` or ``seconds``):
    the mean over training seeds as a line, the min-max over seeds as a band. Returns the Figure."""
    fig = _new_figure(figsize, dpi)
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    for ax, (column, name) in zip(fig.subplots(1, 2), METRICS):
        for v in variants:
            band = seed_band(curves, v, column)
            if band.empty:
                continue
            xs = band["iteration"] if x == "iteration" else band["seconds"]
            ax.plot(xs, band["mean"], marker="o", markersize=3, color=colours[v],
                    label=f"{v} ({band['n'].iloc[0]} seeds)")
            ax.fill_between(xs, band["lo"], band["hi"], color=colours[v], alpha=0.18, linewidth=0)
        if x == "iteration":
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        xlabel = "iteration (0 = base model)" if x == "iteration" else "training seconds (mean over seeds)"
        ax.set(xlabel=xlabel, ylabel=name, title=f"{name} vs {'iteration' if x == 'iteration' else 'wall clock'}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="x-small")
    fig.suptitle("line: mean over training seeds; band: their min to max", fontsize="small")
    _save(fig, path)
    return fig


KIND_LABELS = {"equal_wall": "equal wall", "equal_wall_net": "equal wall, loading out"}


def pair_label(row) -> str:
    where = KIND_LABELS.get(row["kind"], f"iter {row['iteration_a']}")
    return f"{row['a']} - {row['b']} ({where})"


def differences_figure(pairs: pd.DataFrame, path: Path, dpi: int = 100):
    """Forest plot: each computed pair's mean held-out reward difference with its bootstrap interval, a
    line at 0. Returns the Figure (or None with nothing to draw)."""
    rows = pairs[np.isfinite(pairs["reward_diff"].astype(float))]
    if rows.empty:
        return None
    fig = _new_figure((8.0, 1.0 + 0.42 * len(rows)), dpi)
    ax = fig.subplots()
    ys = np.arange(len(rows))[::-1]
    diff, lo, hi = (rows[c].to_numpy(dtype=float) for c in ("reward_diff", "reward_lo", "reward_hi"))
    seed_lo, seed_hi = (rows[c].to_numpy(dtype=float) for c in ("reward_seed_lo", "reward_seed_hi"))
    ax.errorbar(diff, ys, xerr=[diff - seed_lo, seed_hi - diff], fmt="none", color="tab:orange", capsize=5,
                linewidth=1.0, label="over seeds and prompts (t)")
    ax.errorbar(diff, ys, xerr=[diff - lo, hi - diff], fmt="o", color="tab:blue", capsize=3, linewidth=2.0,
                label="over prompts")
    ax.legend(fontsize=8, loc="best")
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(ys, labels=[pair_label(r) for _, r in rows.iterrows()], fontsize=8)
    ax.set(xlabel=f"held-out reward difference A - B ({LEVEL:.0%} bootstrap intervals)",
           title="paired differences (seeds pooled per image)")
    ax.grid(alpha=0.3, axis="x")
    _save(fig, path)
    return fig


def tp_rate_figure(tp_rates: pd.DataFrame, path: Path, dpi: int = 100):
    """Where turning points fall: per main variant that has any, a heat map of the rate by window step
    (rows) and iteration (columns), mean over seeds; a last panel with each variant's rate per step (mean
    over iterations and seeds). Returns the Figure (or None without turning points)."""
    from matplotlib.ticker import MaxNLocator

    main = tp_rates[tp_rates["family"] == "main"]
    variants = [v for v, g in main.groupby("variant", sort=True) if g["tp_rate"].max() > 0]
    if not variants:
        return None
    fig = _new_figure((4.2 * (len(variants) + 1) + 0.8, 3.6), dpi)
    axes = np.atleast_1d(fig.subplots(1, len(variants) + 1))
    grids = {v: main[main["variant"] == v].pivot_table(index="step", columns="iteration", values="tp_rate",
                                                        aggfunc="mean") for v in variants}
    vmax = max(max(float(g.to_numpy().max()) for g in grids.values()), 1e-9)
    for ax, (v, grid) in zip(axes, grids.items()):
        cols, rows = grid.columns.to_numpy(), grid.index.to_numpy()
        image = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax,
                          interpolation="nearest",
                          extent=(cols.min() - 0.5, cols.max() + 0.5, rows.max() + 0.5, rows.min() - 0.5))
        ax.set(xlabel="iteration", ylabel="window step k", title=f"{v} (mean over seeds)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=list(axes[:-1]), label="turning-point rate")
    last = axes[-1]
    for i, (v, grid) in enumerate(grids.items()):
        last.plot(grid.index, grid.mean(axis=1), marker="o", color=f"C{i}", label=v)
    last.set(xlabel="window step k", ylabel="turning-point rate", title="per step, mean over iterations")
    last.xaxis.set_major_locator(MaxNLocator(integer=True))
    last.grid(alpha=0.3)
    last.legend(loc="best", fontsize="x-small")
    _save(fig, path)
    return fig


def _ci(row, name: str = "reward") -> str:
    d, lo, hi = (row.get(f"{name}_{k}") for k in ("diff", "lo", "hi"))
    if d is None or not np.isfinite(float(d)):
        return "-"
    return f"{float(d):+.4f} [{float(lo):+.4f}, {float(hi):+.4f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def setup_table(runs: list[dict], curves: pd.DataFrame) -> list[str]:
    rows = []
    for v in dict.fromkeys(r["variant"] for r in runs):
        group = [r for r in runs if r["variant"] == v]
        trained = curves[(curves["variant"] == v) & (curves["iteration"] > 0)]
        seconds, kl = trained["train_seconds"], trained["approx_kl"].dropna()
        over = ", ".join(f"{k}={val}" for k, val in sorted(group[0]["overrides"].items())) or "-"
        planned = sorted({int(r["params"]["train"]["iterations"]) for r in group})
        done = curves[curves["variant"] == v].groupby("seed")["iteration"].max()
        rows.append((v, group[0]["mode"], over, ",".join(str(r["seed"]) for r in group), group[0]["budget"],
                     "/".join(map(str, planned)), ",".join(str(int(d)) for d in done) or "0",
                     f"{seconds.mean():.1f}" if len(seconds) else "-", f"{kl.mean():.2e}" if len(kl) else "-"))
    # approx KL: the update's own estimate between the policy before and after it, mean over iterations and
    # seeds; the step size each mode actually took (Flow-GRPO's copied reward pushes harder at the same lr)
    return _table(("variant", "credit.mode", "overrides", "seeds", "budget", "iterations planned",
                   "done (per seed)", "train s / iteration", "approx KL / iteration"), rows)


def final_table(runs: list[dict], curves: pd.DataFrame) -> list[str]:
    rows = []
    for v in dict.fromkeys(r["variant"] for r in runs):
        budget = min(int(r["budget"]) for r in runs if r["variant"] == v)
        band = {c: seed_band(curves, v, c) for c, _ in METRICS}
        b = band["eval_reward"][band["eval_reward"]["iteration"] <= budget]
        if b.empty:
            continue
        last, s = b.iloc[-1], band["strict_accuracy"].set_index("iteration").loc[b.iloc[-1]["iteration"]]
        base = b.iloc[0] if b.iloc[0]["iteration"] == 0 else None
        rows.append((v, int(last["iteration"]), f"{last['mean']:.4f} ({last['lo']:.4f}-{last['hi']:.4f})",
                     f"{s['mean']:.4f}", "-" if base is None else f"{base['mean']:.4f}", int(last["n"])))
    return _table(("variant", "iteration", "held-out reward mean (min-max over seeds)", "strict accuracy",
                   "base model", "seeds"), rows)


def pairs_table(pairs: pd.DataFrame) -> list[str]:
    rows = [(r["set"], f"{r['a']} - {r['b']}", KIND_LABELS.get(r["kind"], r["kind"]),
             f"{r['iteration_a']} vs {r['iteration_b']}",
             f"{r['seconds_a']:.0f} vs {r['seconds_b']:.0f}", r["seeds"], _ci(r), _seed_ci(r),
             r["per_seed_reward_diff"], _ci(r, "strict"))
            for _, r in pairs.iterrows() if np.isfinite(float(r["reward_diff"]))]
    return _table(("set", "A - B", "kind", "iterations", "train seconds", "seeds",
                   f"reward diff [{LEVEL:.0%} CI over prompts]", "[CI over seeds and prompts]", "per seed",
                   "strict accuracy diff [CI over prompts]"), rows)


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or not np.isfinite(float(value)) else fmt.format(float(value))


def headline_lines(headline: pd.DataFrame) -> list[str]:
    """The iterations-to-reward table and a sentence naming the target."""
    first = headline.iloc[0]
    rows = [(r["variant"], r["seeds"], _num(r["iteration"]), _num(r["first_evaluated"], "{:.0f}"),
             f"{_num(r['iteration_lo'])} - {_num(r['iteration_hi'])}", f"{r['seeds_reaching']} ({r['per_seed_iteration']})",
             _num(r["fraction_of_flow_iterations"], "{:.2f}"), _num(r["seconds"], "{:.0f}"),
             f"{_num(r['seconds_lo'], '{:.0f}')} - {_num(r['seconds_hi'], '{:.0f}')}", _num(r["net_seconds"], "{:.0f}"))
            for _, r in headline.iterrows()]
    return [f"Target: flow_grpo's best held-out reward within the budget, {first['target']:.4f} (mean over its seeds, "
            f"at iteration {int(first['target_iteration'])}). \"-\": not reached within the budget. Seconds: mean over "
            f"seeds {first['time_seeds']} (every mode's).", "",
            *_table(("variant", "seeds", "iteration reaching it", "first evaluated", "95% CI over seeds",
                     "seeds reaching it (their iterations)", "x flow_grpo's iterations", "train seconds",
                     "95% CI over seeds", "train seconds, loading out"), rows)]


def _seed_ci(row) -> str:
    lo, hi = row.get("reward_seed_lo"), row.get("reward_seed_hi")
    return "-" if lo is None or not np.isfinite(float(lo)) else f"[{float(lo):+.4f}, {float(hi):+.4f}]"


def _claim_note(row) -> str:
    only, boot = row.get("verdict_prompts_only"), row.get("verdict_bootstrap")
    parts = [f"per seed: {row['per_seed_reward_diff']}" if isinstance(row.get("per_seed_reward_diff"), str) else "",
             f"over prompts only: {only}" if isinstance(only, str) and only != row["verdict"] else "",
             f"the percentile bootstrap over seeds said: {boot}" if isinstance(boot, str) and boot != row["verdict"]
             else "",
             row.get("note") if isinstance(row.get("note"), str) else ""]
    return "; ".join(p for p in parts if p)


def claims_table(claims: pd.DataFrame) -> list[str]:
    rows = [(r["claim"], r["paper"], f"{r['a']} vs {r['b']} ({r['kind']})", _ci(r), _seed_ci(r),
             f"**{r['verdict']}**", _claim_note(r)) for _, r in claims.iterrows()]
    return _table(("claim", "paper", "comparison", "held-out reward diff [CI over prompts]",
                   "[CI over seeds and prompts]", "verdict", "note"), rows)


def _label(out: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(out).resolve().name)


def draw_figures(tables: dict, runs: list[dict], fig_dir: Path, label: str) -> list[Path]:
    """The root's figures in ``fig_dir`` (names prefixed with ``label``); returns the ones drawn."""
    curves, drawn = tables["curves"], []
    main = list(dict.fromkeys(r["variant"] for r in runs if r["family"] == "main"))
    jobs = [(FIGURES[0], lambda p: reward_figure(curves, main, p, "iteration")),
            (FIGURES[1], lambda p: reward_figure(curves, main, p, "seconds")),
            (FIGURES[2], lambda p: differences_figure(tables["pairs"], p)),
            (FIGURES[3], lambda p: tp_rate_figure(tables["tp_rates"], p))]
    ablations = [r for r in runs if r["family"] == "ablation"]
    if ablations:
        seeds = {r["seed"] for r in ablations}
        names = list(dict.fromkeys([*(r["reference"] for r in ablations), *(r["variant"] for r in ablations)]))
        subset = curves[curves["seed"].isin(seeds)]
        jobs.append((ABLATION_FIGURE, lambda p: reward_figure(subset, names, p, "iteration")))
    for name, draw in jobs:
        path = fig_dir / f"{label}-{name}"
        if draw(path) is not None:
            drawn.append(path)
    return drawn


def machine_lines(runs: list[dict]) -> list[str]:
    """Which machines the runs trained on (``machine.json``: every attempt), or that they were not recorded."""
    from tpgrpo.comparison.provenance import describe, read_machines

    kinds: dict[str, int] = {}
    for run in runs:
        for desc in dict.fromkeys(describe(m) for m in read_machines(Path(run["folder"]))) or ["not recorded"]:
            kinds[desc] = kinds.get(desc, 0) + 1
    if list(kinds) == ["not recorded"]:
        return ["Machines: not recorded (these runs predate `machine.json`).", ""]
    return ["Machines: " + "; ".join(f"{k} ({n} runs)" for k, n in kinds.items())
            + (" -- more than one: pairs across them are flagged *not comparable*."
               if len([k for k in kinds if k != "not recorded"]) > 1 else "."), ""]


def section(out: Path, fig_dir: Path, md_dir: Path, n_boot: int = N_BOOT, lab: bool = True) -> list[str]:
    """The Markdown section of one comparison root (and its figures); ``lab``: with its command lines and code
    commits (the results page links them instead)."""
    import os

    out = Path(out)
    tables, runs = collect(out, n_boot), discover(out)
    label = _label(out)
    task = runs[0]["params"]["task"]
    lines = [f"## `{out}`: training reward `{task['reward']}`"
             + (f", held-out reward `{task['eval_reward']}`" if task["eval_reward"] != "geneval" else ""), ""]
    if not (tables["curves"]["strict_accuracy"].fillna(0) != 0).any():
        # e.g. jpeg_compressibility: no strict result is defined, so every strict column would read 0
        lines += [f"No held-out image of any run is strictly right under `{task['eval_reward']}` (it may define "
                  "no strict result): the strict-accuracy columns below say nothing.", ""]
    lines += provenance_lines(out, runs, lab, md_dir)
    lines += ["### Runs", "", *setup_table(runs, tables["curves"]), "", "### Held-out reward at the last evaluated "
              "iteration", "", *final_table(runs, tables["curves"]), "", "### Figures", ""]
    for path in draw_figures(tables, runs, fig_dir, label):
        lines += [f"![{path.stem}]({os.path.relpath(path, md_dir)})", ""]
    if len(tables["headline"]):
        lines += ["### How soon each mode reaches Flow-GRPO's best", "", *headline_lines(tables["headline"]), ""]
    elif any(r["variant"] == "flow_grpo" for r in runs):
        lines += ["### How soon each mode reaches Flow-GRPO's best", "", "No target: flow_grpo's held-out reward "
                  "(mean over its seeds) never rose above the base model's within the budget.", ""]
    lines += ["### Paired differences", "", *pairs_table(tables["pairs"]), "", "### The paper's claims", "",
              *claims_table(tables["claims"]), ""]
    return lines


def provenance_lines(out: Path, runs: list[dict], lab: bool = True, md_dir: Path = Path(".")) -> list[str]:
    """Where a root's numbers come from: its archive record, command lines and code snapshots (``lab``; else
    a link to its commands.txt and the base model it trained from), machines, equal-wall passes, loading."""
    import os

    lines = []
    commands = (out / "commands.txt").read_text().splitlines() if (out / "commands.txt").is_file() else []
    a = json.loads((out / ARCHIVE_MARKER).read_text()) if (out / ARCHIVE_MARKER).is_file() else None
    if a:
        lines += [f"Read from an archive of `{a['source']}` made {a['time']} (`tpgrpo compare archive`: the "
                  f"runs' result files only, {a['runs']} runs, {a['bytes'] / 1e6:.2f} MB)."]
        lines += [f"Added to it: {x['runs']} runs of `{x['source']}` made {x['time']} (`tpgrpo compare archive --add`, "
                  f"{x['bytes'] / 1e6:.2f} MB)." + (f" Accepted despite another machine or code: {x['accepted']}"
                                                   if x.get("accepted") else "") for x in a.get("added", [])]
        lines += [""]
    if commands and not lab:
        lines += [f"Base model: {base_model(a, runs)}. Built by the command lines in "
                  f"[commands.txt]({os.path.relpath(out / 'commands.txt', md_dir)}), with the code snapshot records in `code/`.", ""]
    elif commands:
        lines += ["Built by:", "", "```", *commands, "```", ""]
    snapshots = [("code/SNAPSHOT.json", "")] + [(x["snapshot"], f" (the runs of `{x['source']}`)")
                                                for x in (a or {}).get("added", [])] if lab else []
    for rel, whose in snapshots:
        snapshot = json.loads((out / rel).read_text()) if (out / rel).is_file() else {}
        if snapshot:
            changed = len(snapshot.get("changed_files", []))
            lines += [f"Code{whose}: commit `{snapshot.get('commit', '?')[:12]}`"
                      + (f" with {changed} changed files" if changed else "")
                      + f", snapshot taken {snapshot.get('time', '?')}.", ""]
    lines += machine_lines(runs)
    for w in equal_wall_records(out):
        own = w.get("target_budget", w["budget"])  # older records: both sides had one budget
        longer = f" over its budget of {w['budget']} iterations" if own != w["budget"] else ""
        lines += [f"Equal wall clock: {w['reference']} took {w['reference_s_per_iter']} s per iteration{longer}, "
                  f"{w['target']} {w['target_s_per_iter']} s (ratio {w['ratio']}), so {w['target']} ran "
                  f"{w['iterations']} iterations instead of {own}." + (f" {w['note']}" if w.get("note") else ""), ""]
    load = load_record(out)
    if load:
        lines += [f"Model loading: {load['load_seconds']} s per load (median of {load['loads_timed']} timed loads of "
                  f"`load_policy` in `{load['folder']}`, {load['min']}-{load['max']} s, {load['threads']} thread, "
                  f"1-minute load average {load['load_average_1min']}, {load['time']}; `tpgrpo compare load-cost`).", ""]
    return lines


def base_model(record: dict | None, runs: list[dict]) -> str:
    """The base model a root trained from: its archive's record of it, else ``model.path`` of its params."""
    paths = sorted({str(r["params"]["model"]["path"]) for r in runs})
    recorded = (record or {}).get("base_model") or {}
    text = f"`{recorded.get('path') or ', '.join(paths)}`"
    return text + (f", {recorded['note']}" if recorded.get("note") else "") + (
        f" (weights md5 {recorded['md5']})" if recorded.get("md5") else "")


def write_report(roots: Sequence[Path], md_path: Path, command: str = "", n_boot: int = N_BOOT) -> Path:
    """Write ``md_path`` and its figures (folder ``md_path`` without suffix) for the comparison roots."""
    md_path = Path(md_path)
    fig_dir = md_path.with_suffix("")
    fig_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Replication: does turning-point credit pay off?", "",
             "Generated from the stored runs only" + (f" by `{command}`" if command else "") + "; every number and "
             "figure below is recomputed from the run folders named in each section.", "",
             "## How the numbers are made", "", method_text(n_boot)]
    for root in roots:
        lines += section(Path(root), fig_dir, md_path.parent, n_boot)
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines).rstrip() + "\n")
    return md_path
