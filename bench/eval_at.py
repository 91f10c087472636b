"""Re-score a finished run's stored policies under other eval params, each paired with the base model.

The eval stage samples the held-out prompts with eval.num_steps ODE steps (40, the paper's), while training
samples with sampling.num_steps (10). This asks whether what RL taught the policy shows under another
sampler: ``python -m bench.eval_at --run runs/compare/tp/seed0 --iterations 0,6,12 --set eval.num_steps=10``.
Per iteration (0 = the base model) it writes the per-image table ``OUT/iter_NNNN.parquet`` (the eval stage's
columns) and prints the mean held-out reward and strict accuracy and the paired difference against the base
model under the same params (10,000 bootstrap resamples of prompts, ``tpgrpo.comparison.stats.compare_tables``).
Nothing in the run folder is written. Threads: set OMP_NUM_THREADS / --threads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path



def scored_table(cfg, root: Path, iteration: int):
    """Per-image eval table of policy ``iteration`` (0: the base model) under ``cfg``'s eval params."""
    from tpgrpo.policy.evaluation import eval_images
    from tpgrpo.policy.loading import policy_to_score

    backend = policy_to_score(cfg, root, iteration)[0]
    with tempfile.TemporaryDirectory() as tmp:  # chunk part files: never inside the run folder
        return eval_images(cfg, root, backend, f"iteration {iteration}", Path(tmp) / "eval.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished run folder (params.yaml, data/iters)")
    ap.add_argument("--iterations", default="0", help="comma-separated; 0 = the base model (always scored)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="section.key=value (eval.*)")
    ap.add_argument("--out", type=Path, help="folder for the per-image tables (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    import yaml

    from tpgrpo.comparison.stats import compare_tables
    from tpgrpo.comparison.runs import apply_overrides
    from tpgrpo.comparison.variants import parse_assignments
    from tpgrpo.config import ConfigError, config_from_dict

    if args.threads:
        torch.set_num_threads(args.threads)
    params = args.run / "params.yaml"
    if not params.is_file():
        raise SystemExit(f"error: --run {args.run}: no params.yaml there (expected a run folder)")
    try:
        cfg = config_from_dict(apply_overrides(yaml.safe_load(params.read_text()),
                                               parse_assignments(args.sets, "--set"), "--set"))
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    iterations = sorted({0, *(int(i) for i in args.iterations.split(",") if i.strip())})
    out = args.out or Path(tempfile.mkdtemp(prefix="eval_at-"))
    out.mkdir(parents=True, exist_ok=True)
    tables = {}
    for i in iterations:
        tables[i] = scored_table(cfg, args.run.resolve(), i)
        tables[i].to_parquet(out / f"iter_{i:04d}.parquet", index=False)
    rows = []
    for i in iterations:
        t = tables[i]
        d = compare_tables(t, tables[0]) if i else None
        rows.append({"iteration": i, "reward": float(t["eval_reward"].mean()),
                     "strict": float(t["eval_strict"].mean()),
                     **({"vs_base": d["mean_diff"], "lo": d["lo"], "hi": d["hi"]} if d else {})})
        print(f"iteration {i:>3}: held-out {rows[-1]['reward']:.4f}, strict {rows[-1]['strict']:.4f}"
              + (f"; vs base {d['mean_diff']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d else ""))
    (out / "summary.json").write_text(json.dumps({"run": str(args.run), "set": args.sets, "rows": rows},
                                                 indent=2) + "\n")
    print(f"tables: {out}")


if __name__ == "__main__":
    main()
