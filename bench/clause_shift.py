"""Which GenEval clauses a finished run's policies fix and which they leave: the clause table of each.

``python -m bench.clause_shift --run data/.. --iterations 0,20,40 [--threads 2]``: policy N (0 = the base model)
samples the held-out prompts exactly as the eval stage does (``eval.*`` params, the same seeds for every
policy), and ``tpgrpo.tasks.clauses.clause_table`` says, per prompt kind, the share of images that break each
clause, and for left/right prompts how often the pair is drawn on the asked side (0.5 = chance). Prints one
Markdown table per policy and writes them to ``--out`` as JSON. Nothing in the run folder is written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def policy_clauses(cfg, root: Path, iteration: int) -> dict:
    """The clause table of policy ``iteration`` (0: the base) on the held-out prompts at eval's settings."""
    from tpgrpo.policy.loading import policy_to_score
    from tpgrpo.reports.base_report import eval_settings_row

    return eval_settings_row(policy_to_score(cfg, root, iteration)[0], cfg, root / "data" / "prompts")["clauses"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished run folder (params.yaml, data/iters)")
    ap.add_argument("--iterations", default="0", help="comma-separated; 0 = the base model")
    ap.add_argument("--out", type=Path, help="JSON file for the tables (default: none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch

    from tpgrpo.config import load_config
    from tpgrpo.tasks.clauses import clause_markdown

    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.run / "params.yaml").is_file():
        raise SystemExit(f"error: --run {args.run}: no params.yaml there (expected a run folder)")
    cfg = load_config(args.run / "params.yaml")
    tables = {}
    for i in (int(x) for x in args.iterations.split(",") if x.strip()):
        tables[i] = policy_clauses(cfg, args.run.resolve(), i)
        print(f"\npolicy {i} ({'base' if i == 0 else f'iteration {i}'}), {tables[i]['all']['n']} held-out images:\n")
        print(clause_markdown(tables[i]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"run": str(args.run), "tables": tables}, indent=1) + "\n")


if __name__ == "__main__":
    main()
