"""Attack "up to date means correct" with many seeded random sequences of user actions.

Each sequence builds a tiny project (3 iterations, blocks of 2), runs it, then applies ``--length`` random
actions (param and code edits, touches, hand re-runs, deletions, retention, iteration changes, SIGKILLs,
in-place damage, ...), each followed by ``tpgrpo run`` and three checks: every artifact equals a run from
scratch (reference runs cached by params + code in ``--cache``), ``dvc status`` is clean, and what ran is
what the action affects. Prints how many sequences held and, per failure, the sequence and its first
failed assertion.

    OMP_NUM_THREADS=1 python -m bench.up_to_date --sequences 50 --seed 0
    python -m bench.up_to_date --only 7 --seed 0   # re-run sequence 7 alone (its seed is seed * 1000 + 7)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import REPO, reexec_with_tests_helpers

# The harness's modules are tests helpers that import each other by bare name (tests/ first, as under pytest):
# this script starts again with tests/ on PYTHONPATH when they do not import here.
reexec_with_tests_helpers("bench.up_to_date", "up_to_date_harness")
import up_to_date_runner as ur  # noqa: E402
import up_to_date_harness as h  # noqa: E402


def build_model(folder: Path) -> Path:
    """The tests' tiny model (tests/conftest.py's tiny_model_dir), saved once into ``folder``."""
    from tpgrpo.models.tiny import TinyConfig, build_tiny

    if not (folder / "tpgrpo_model.json").is_file():
        config = TinyConfig(image_size=32, patch_size=8, num_layers=1, num_heads=2, head_dim=16, text_layers=1,
                            text_hidden=32, text_heads=2, text_intermediate=64)
        build_tiny(config, seed=0).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=int, default=6, help="actions per sequence")
    parser.add_argument("--only", type=int, default=None, help="run only this sequence index")
    parser.add_argument("--actions", default=",".join(ur.ACTIONS), help="comma-separated action names")
    parser.add_argument("--code", choices=("head", "worktree"), default="head",
                        help="the code projects copy: the last commit (default) or the working tree")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tpgrpo_up_to_date",
                        help="folder of cached reference digests and the tiny model")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--keep-failed", action="store_true", help="leave a failed sequence's project on disk "
                        "(its path is printed) to look into")
    args = parser.parse_args()
    actions = args.actions.split(",")
    unknown = [a for a in actions if a not in ur.ACTIONS]
    if unknown:
        parser.error(f"unknown actions {unknown}; known: {', '.join(ur.ACTIONS)}")
    work = Path(tempfile.mkdtemp(prefix="up_to_date_"))
    code_src = h.export_code(work / "code", args.code)
    model = build_model(args.cache / "model" / "base")
    # keyed by the project code and by the harness's own digests (a change of how artifacts are digested
    # must not compare against references digested the old way)
    harness = hashlib.sha256(Path(h.__file__).read_bytes()).hexdigest()[:8]
    refs = h.References(args.cache / f"refs-{h.code_key(code_src)[:12]}-{harness}", model)
    started, results = time.time(), []
    template = work / "template"
    failure = ur.new_project(template, model, code_src, refs)
    h.end_processes(template)
    if failure:
        sys.exit(f"the tiny project did not run from scratch: {failure}")
    indices = [args.only] if args.only is not None else range(args.sequences)
    for k in indices:
        root = work / f"seq{k}"
        result = ur.run_sequence(root, template, refs, args.seed * 1000 + k, args.length, actions)
        results.append(result)
        print(ur.describe(result), flush=True)
        print(f"[so far: {sum(r.held for r in results)} of {len(results)} held, "
              f"{sum(len(r.steps) for r in results)} actions, {time.time() - started:.0f} s]", flush=True)
        if args.keep_failed and not result.held:
            kept = Path(tempfile.mkdtemp(prefix="up_to_date_failed_")) / root.name
            shutil.move(root, kept)
            print(f"  kept the failed project: {kept}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    wall = time.time() - started
    held = sum(r.held for r in results)
    steps = sum(len(r.steps) for r in results)
    kinds = Counter(r.failure.split(":")[0][:60] for r in results if r.failure)
    print(f"\n{held} of {len(results)} sequences held ({steps} actions, {len(results) - held} failed); "
          f"wall {wall:.0f} s; threads {h.THREADS}; code {args.code}; references computed {refs.computed}")
    for kind, count in kinds.most_common():
        print(f"  {count} x {kind}")
    if args.json:
        args.json.write_text(json.dumps([{"seed": r.seed, "held": r.held, "steps": r.steps, "failure": r.failure,
                                          "seconds": round(r.seconds, 1)} for r in results], indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
