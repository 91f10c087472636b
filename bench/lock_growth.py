"""DVC's dvc.lock rewrite after every stage, as a run grows: one `dvc repro` of the whole run vs block by block.

Usage: ``python -m bench.lock_growth [--from PROJECT] [--flat 12,25,100,300] [--blocks 12,25,100,300,1000]
[--block-size 25] [--repeats 2]``.

After each stage it runs, DVC loads the whole dvc.lock (ruamel round-trip YAML), updates that stage's entry
and writes the file again (``dvc.dvcfile.Lockfile.dump_stages`` -> ``modify_yaml``). This bench times exactly
that call on lock files made of real entries:

- ``flat``: the whole run in one ``dvc repro`` (``tpgrpo run`` before block-by-block): while iteration N's
  stages run, the lock holds the entries of iterations 1..N;
- ``blocks``: ``tpgrpo run`` now reproduces block by block and seals each finished block before the next:
  the lock holds one entry per sealed block plus the open block's stages (measured at the open block's
  last iteration N, its largest point).

Each rewrite is also timed, alternately, as ``tpgrpo run``'s DVC now writes it
(``tpgrpo.pipeline.dvc_integration.lock_blocks``: the stage's own block emitted, the rest of the file kept): the
"one stage's block s" of each row.

Entries: a real finished iteration's (``--from`` a project whose iteration 1 finished, or one trained here as
bench/dvc_scale.py does), renumbered for iteration i; a sealed block's entry is built from its stages'
entries with the fields ``dvc commit`` writes (its stages' outside deps once, their params merged, every
output). Prints the measured seconds of one rewrite (best of --repeats, one process, whatever else shares
the cores) and lock size at iteration N; and, ESTIMATED from a least-squares line of those seconds against
lock bytes, the total rewrite seconds over a run of N iterations (the sum over its stages).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.dvc_scale import STEMS, renumbered, train_one
from tpgrpo.pipeline.long_runs.blocks import read_lock


def iteration_entries(src: dict, i: int, policy: dict) -> dict[str, dict]:
    """Iteration i's per-stage lock entries, renumbered from iteration 1's."""
    return {f"{s}-{i:04d}": renumbered(src[f"{s}-0001"], i, policy if i > 1 else None)
            for s in STEMS if f"{s}-0001" in src}


def block_entry(entries: list[dict], first: int, last: int) -> dict:
    """A sealed block's entry as `dvc commit` writes it: outside deps once, params merged, every out."""
    produced = {o["path"] for e in entries for o in e["outs"]}
    deps = {d["path"]: d for e in entries for d in e.get("deps", []) if d["path"] not in produced}
    params: dict = {}
    for e in entries:
        params.update(e.get("params", {}).get("params.yaml", {}))
    return {"cmd": f"tpgrpo block --first {first} --last {last}", "deps": [deps[p] for p in sorted(deps)],
            "params": {"params.yaml": params}, "outs": [o for e in entries for o in e["outs"]]}


def lock_at(src: dict, n: int, block_size: int, own_files: bool = False) -> dict:
    """The root lock while iteration n's last stage is written: flat (block_size 0) or block by block, the
    sealed blocks' entries in it (before) or, ``own_files``, each in its own lock file (not in this one)."""
    policy = next(o for o in src["update-0001"]["outs"] if o["path"].endswith("/policy"))
    sealed_through = (n - 1) // block_size * block_size if block_size else 0
    stages = {name: src[name] for name in ("code", "baseline") if name in src}  # `code`: since the manifests
    for first in range(1, 0 if own_files else sealed_through + 1, block_size or 1):
        last = first + block_size - 1
        inner = [e for i in range(first, last + 1) for e in iteration_entries(src, i, policy).values()]
        stages[f"iters-{first:04d}-{last:04d}"] = block_entry(inner, first, last)
    for i in range(sealed_through + 1, n + 1):
        stages.update(iteration_entries(src, i, policy))
    stages["summary"] = src["summary"]
    return {"schema": "2.0", "stages": stages}


def time_rewrite(lock: dict, repeats: int) -> tuple[float, float, int]:
    """(best seconds of DVC's load-update-dump of dvc.lock, best seconds of the same stage's write through
    ``tpgrpo.pipeline.dvc_integration.lock_blocks`` (read, cut, emit one block, write), file bytes), the two
    alternated, both written atomically as ``tpgrpo run``'s DVC writes them."""
    from dvc.utils.serialize import dump_yaml, modify_yaml, parse_yaml
    from dvc.utils.serialize._yaml import _dump

    from tpgrpo.pipeline.dvc_integration import dvc_atomic, lock_blocks

    dvc_atomic.install()  # DVC's own writes fsync and rename too, as in `tpgrpo run`
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dvc.lock")
        dump_yaml(path, lock)
        name = [k for k in lock["stages"] if k != "summary"][-1]
        best, best_blocks = float("inf"), float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            with modify_yaml(path) as data:  # what DVC's Lockfile.dump_stages does for one stage
                data["stages"].update({name: lock["stages"][name]})
            best = min(best, time.perf_counter() - start)
            start = time.perf_counter()
            with open(path, encoding="utf-8") as fd:  # what lock_blocks' dump_stages does instead
                new = lock_blocks.updated_text(fd.read(), {name: lock["stages"][name]}, _dump,
                                               lambda doc: parse_yaml(doc, path))
            dvc_atomic.atomic_write_text(path, lambda fd: fd.write(new[0]))
            best_blocks = min(best_blocks, time.perf_counter() - start)
        return best, best_blocks, os.path.getsize(path)


def run_total(src: dict, n: int, block_size: int, fit: tuple[float, float], own_files: bool = False) -> float:
    """Estimated rewrite seconds over a run of n iterations: per stage a + b * (lock bytes then); with
    ``own_files`` a sealed block adds nothing to the root lock."""
    sizes = {name: len(yaml.safe_dump({name: e})) for name, e in lock_at(src, 1, 0)["stages"].items()}
    per_iter = sum(v for k, v in sizes.items() if k.endswith("-0001"))
    per_stage = per_iter / len(STEMS)
    sealed_block = len(yaml.safe_dump(lock_at(src, block_size + 1, block_size)["stages"])) if block_size else 0
    sealed_block -= (sizes["baseline"] + sizes["summary"] + per_iter) if block_size else 0
    sealed_block = 0 if own_files else sealed_block
    total, a, b = 0.0, *fit
    for i in range(1, n + 1):
        sealed = (i - 1) // block_size if block_size else 0
        open_before = (i - 1 - sealed * block_size) * per_iter
        for s in range(1, len(STEMS) + 1):
            total += a + b * (sizes["baseline"] + sealed * sealed_block + open_before + s * per_stage)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path, help="project whose iteration 1 finished")
    ap.add_argument("--flat", default="12,25,100,300", help="iterations measured in the flat layout")
    ap.add_argument("--blocks", default="12,25,100,300,1000", help="iterations measured block by block, sealed "
                    "blocks in the root lock (before) and in their own lock files (now)")
    ap.add_argument("--block-size", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpgrpo_lock_growth"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"),
                    help="two projects of one finished iteration each (e.g. before and after a layout change): "
                         "flat locks of --flat iterations from each, timed alternately")
    args = ap.parse_args()
    if args.compare:
        return compare_layouts(*args.compare, [int(n) for n in args.flat.split(",")], args.repeats)
    source = args.source.resolve() if args.source else train_one(args.work)
    src = read_lock(source)["stages"]
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cpus {os.cpu_count()}; "
          f"entries from {source}", flush=True)
    rows, points = [], []
    worst = f"{args.block_size},{args.block_size * 40}"  # a block's last iteration, early and late in a run
    for layout, sizes, bs in (("flat", args.flat, 0), ("blocks", args.blocks, args.block_size),
                              ("own files", args.blocks, args.block_size), ("own files, block end", worst,
                                                                            args.block_size)):
        for n in map(int, sizes.split(",")):
            # own files: measured while iteration n + 1 runs after n finished (n a multiple of the block size:
            # every block sealed), and at a block's last iteration (its largest root lock) in the rows below
            at = n + 1 if layout == "own files" else n
            lock = lock_at(src, at, bs, own_files=layout.startswith("own files"))
            seconds, blocks_s, size = time_rewrite(lock, args.repeats if size_hint(lock) < 2e6 else 1)
            points.append((len(yaml.safe_dump(lock["stages"])), seconds))  # the bytes run_total counts
            rows.append({"layout": layout, "iterations": n, "entries": len(lock["stages"]), "lock KB": size / 1e3,
                         "one rewrite s": seconds, "one stage's block s": blocks_s})
            print(json.dumps(rows[-1]), flush=True)
    fit = least_squares(points)
    print(f"fit: rewrite s = {fit[0]:.4f} + {fit[1] * 1e6:.3f} s per MB of YAML (the totals below are estimates)")
    measured = {(r["layout"], r["iterations"]): r for r in rows}
    print("| iterations N | root dvc.lock KB: flat at N / blocks in the root lock at N / own files after N "
          "finished / own files at a block's end | one rewrite s, measured: same four | all rewrites of an "
          "N-iteration run, s, estimated: flat / blocks / own files |")
    print("|---|---|---|---|")
    layouts = ("flat", "blocks", "own files", "own files, block end")
    for n in sorted({r["iterations"] for r in rows}):
        found = [measured.get((layout, n)) for layout in layouts]
        kb = " / ".join(f"{r['lock KB']:.0f}" if r else "-" for r in found)
        one = " / ".join(f"{r['one rewrite s']:.2f}" if r else "-" for r in found)
        est = (run_total(src, n, 0, fit), run_total(src, n, args.block_size, fit),
               run_total(src, n, args.block_size, fit, own_files=True))
        print(f"| {n} | {kb} | {one} | {' / '.join(f'{e:.0f}' for e in est)} |")
    for layout in layouts[2:]:
        own = {r["iterations"]: r["one rewrite s"] for r in rows if r["layout"] == layout}
        if len(own) > 1:
            lo, hi = min(own), max(own)
            print(f"{layout}: one rewrite at {hi} iterations / at {lo}: {own[hi] / own[lo]:.2f}x (measured in this run)")
    flat12 = measured.get(("flat", min(r["iterations"] for r in rows)))
    if flat12:
        for layout in layouts[2:]:
            big = max((r for r in rows if r["layout"] == layout), key=lambda r: r["iterations"])
            print(f"{layout} at {big['iterations']} / flat at {flat12['iterations']}: "
                  f"{big['one rewrite s'] / flat12['one rewrite s']:.2f}x")


def compare_layouts(old: Path, new: Path, sizes: list[int], repeats: int) -> None:
    """One rewrite of a flat N-iteration lock made of OLD's entries and of NEW's, timed alternately (so the
    machine's load weighs on both alike), and the estimated rewrites of a whole N-iteration run of each."""
    srcs = {"old": read_lock(old.resolve())["stages"], "new": read_lock(new.resolve())["stages"]}
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cpus {os.cpu_count()}; "
          f"old = {old}, new = {new}", flush=True)
    best: dict = {}
    points: dict = {"old": [], "new": []}
    for _ in range(repeats):
        for n in sizes:
            for side, src in srcs.items():
                lock = lock_at(src, n, 0)
                seconds, _, size = time_rewrite(lock, 1)
                key = (side, n)
                best[key] = (min(seconds, best.get(key, (float("inf"), 0))[0]), size)
    for (side, n), (seconds, _) in best.items():
        points[side].append((len(yaml.safe_dump(lock_at(srcs[side], n, 0)["stages"])), seconds))
    print("| iterations N | dvc.lock KB at N: old / new | one rewrite s at N (best of "
          f"{repeats}): old / new | all rewrites of an N-iteration run, s (estimated): old / new | new / old |")
    print("|---|---|---|---|---|")
    for n in sizes:
        (so, ko), (sn, kn) = best[("old", n)], best[("new", n)]
        tot = [run_total(srcs[side], n, 0, least_squares(points[side])) for side in ("old", "new")]
        print(f"| {n} | {ko / 1e3:.0f} / {kn / 1e3:.0f} | {so:.2f} / {sn:.2f} | {tot[0]:.0f} / {tot[1]:.0f} "
              f"| {tot[1] / tot[0]:.2f} |")


def size_hint(lock: dict) -> int:
    return 3300 * len(lock["stages"])  # ~bytes: skip repeats on the slow, large files


def least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of seconds = a + b * bytes; through the origin when the free fit's a is negative (noise)."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-12)
    if my - b * mx >= 0:
        return my - b * mx, b
    return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)


if __name__ == "__main__":
    main()
