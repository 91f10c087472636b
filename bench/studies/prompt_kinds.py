"""Held-out reward by the kind of held-out prompt (position, two_objects, counting, single), per arm and iteration:
where a tree gains or loses against Flow-GRPO on ``geneval_soft``.

    python -m bench.studies.prompt_kinds ROOT/ARM@ITER [ROOT/ARM@ITER ...] [--seeds 0,1,2]

Each ``ROOT/ARM`` is a folder of ``seedK`` run folders (a ``tpgrpo compare run`` root's arm or an archive's);
``@0`` is the base model (``baseline_eval.parquet``). Prints one column per argument: the mean ``eval_reward``
over the seeds x that kind's held-out prompts x eval seeds, the kinds read from ``task.eval_prompts``'s ``kind``
field (``data/prompts/compositional_eval.jsonl`` unless ``--prompts``). No model runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import REPO
from bench.studies.arm_pairs import eval_tables, seed_list


def prompt_kinds(path: Path) -> dict[str, str]:
    """``{prompt id: kind}`` of a prompts JSONL file (read and validated by the project's loader)."""
    from tpgrpo.tasks.prompts import load_prompts

    return {row["id"]: row["kind"] for row in load_prompts(path)}


def kind_column(arm: Path, iteration: int, seeds: list[int], kinds: dict[str, str]):
    """Mean held-out reward per prompt kind (and ``all``) of ``arm`` at ``iteration`` over ``seeds``."""
    import pandas as pd

    tables = eval_tables(arm, seeds)
    missing = [s for s in seeds if iteration not in tables[s]]
    if missing:
        raise SystemExit(f"{arm}: iteration {iteration} not evaluated in seed(s) {missing}")
    table = pd.concat([tables[s][iteration] for s in seeds])
    by_kind = table.groupby(table["prompt_id"].map(kinds))["eval_reward"].mean()
    by_kind["all"] = table["eval_reward"].mean()
    by_kind.index.name = "kind"
    return by_kind


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("columns", nargs="+", help="ROOT/ARM@ITERATION")
    parser.add_argument("--seeds", default="", help="seeds (default: those every arm has)")
    parser.add_argument("--prompts", type=Path, default=REPO / "data" / "prompts" / "compositional_eval.jsonl")
    args = parser.parse_args(argv)
    specs = [(Path(c.rsplit("@", 1)[0]), int(c.rsplit("@", 1)[1])) for c in args.columns]
    seeds = ([int(s) for s in args.seeds.split(",")] if args.seeds
             else sorted(set.intersection(*(set(seed_list(arm)) for arm, _ in specs))))
    kinds = prompt_kinds(args.prompts)
    columns = {f"{arm.name}@{it}": kind_column(arm, it, seeds, kinds) for arm, it in specs}
    print(f"seeds {','.join(map(str, seeds))}; held-out prompts per kind: "
          + ", ".join(f"{k} {n}" for k, n in sorted(pd.Series(kinds).value_counts().items())))
    print(pd.DataFrame(columns).round(4).to_string())


if __name__ == "__main__":
    main()
