# The script that trained the probe study's runs (bench/results/probe_study*.json), kept as it ran then from a
# worktree's bench/; now: python -m bench.results.probe_study_train REV SEED [SEED ...]
import sys, json, time
from pathlib import Path
from bench.before_after import project, measure, passes_per_trajectory
work = Path("/tmp/probe-study/runs")
work.mkdir(parents=True, exist_ok=True)
rev = sys.argv[1]
for seed in sys.argv[2:]:
    folder = project(f"tp-seed{seed}", work, {"credit.mode": "tp", "train.seed": int(seed)}, 3, rev=rev)
    load = Path("/proc/loadavg").read_text().strip()
    r = measure(folder, 3, 1)
    r["passes_per_trajectory"] = passes_per_trajectory(folder)
    print(seed, rev, "load at start", load, "at end", Path("/proc/loadavg").read_text().strip(), json.dumps(r), flush=True)
