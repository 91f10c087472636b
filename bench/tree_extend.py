"""Equal-wall pass for tree-tp, stopped at ITER iterations to fit the session (the plan asks for more).

Usage: python -m bench.tree_extend ITER [OUT]. Ran as runs/tree_extend.py for the archive
results/tree_jpeg (its commands.txt quotes that path; the same file).

Computes and records the pass exactly as `tpgrpo compare equal-wall --reference flow_grpo --target tree-tp`
(tpgrpo.comparison.runs.equal_wall_plan), then lowers each tree-tp run's train.iterations to ITER, notes it in
equal_wall.json and trains them. The report pairs flow_grpo at its last iteration with tree-tp at its evaluated
iteration nearest the planned one: ITER, i.e. the tree with less training time than flow_grpo had.
"""
import json
import sys
from pathlib import Path

import yaml

from tpgrpo.comparison import runs as cmp

out, stop = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/tree_jpeg"), int(sys.argv[1])
cmp.record_command(out, ["python", "bench/tree_extend.py", str(stop), "# equal-wall flow_grpo -> tree-tp, stopped"])
record, specs = cmp.equal_wall_plan(out, "flow_grpo", "tree-tp")
for spec in specs:
    path = spec.folder / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["train"]["iterations"] = stop
    path.write_text(yaml.safe_dump(params, sort_keys=False))
records = json.loads((out / "equal_wall.json").read_text())
for r in records:
    if r["target"] == "tree-tp":
        r["note"] = (f"The pass planned {r['iterations']}; the tree-tp runs were trained to {stop} only, to fit the "
                     f"session, so at 'equal wall' tree-tp has {stop} iterations' training seconds against "
                     f"flow_grpo's {r['budget']} (less time than flow_grpo, not equal).")
(out / "equal_wall.json").write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
print(records)
print(cmp.launch(specs, 2, 1))
