"""The long-run machinery behind tpgrpo.pipeline.long_run: a short run (train.block_size 0, nothing sealed)
renders and repros without importing sealing, the seal cache or retention; blocks to seal,
or a seal file on disk, switch it on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import tiny_params
from tpgrpo.config import config_from_dict
from tpgrpo.pipeline import long_run
from tpgrpo.pipeline.long_runs.blocks import SEALS

MACHINERY = ("tpgrpo.pipeline.long_runs.sealing", "tpgrpo.pipeline.long_runs.seal_cache",
             "tpgrpo.pipeline.long_runs.retention")

# What `tpgrpo run` calls for a project, in a fresh interpreter: the machinery modules it imported.
SHORT_RUN = """
import json, sys
from pathlib import Path
from tpgrpo import cli  # noqa: F401 - the command line's own imports count too
from tpgrpo.config import config_from_dict
from tpgrpo.pipeline import long_run, repro
from tpgrpo.pipeline.migrate import refuse_older_layout
root, cfg, notes = Path(sys.argv[1]), config_from_dict(json.loads(sys.argv[2])), []
pending = long_run.prepare(root, cfg, {}, notes.append)
ends = long_run.repro_ends(root, cfg, pending)
for upto in ends:
    long_run.before_repro(root, cfg, {}, upto, notes.append)
    args = repro.repro_args(root, upto)
    long_run.after_repro(root, cfg, upto, notes.append)
refuse_older_layout(root)
print(json.dumps({"ends": ends, "args": args, "notes": notes,
                  "loaded": sorted(m for m in sys.modules if m in %r)}))
""" % (MACHINERY,)


def _short_run(root: Path, raw: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", SHORT_RUN, str(root), json.dumps(raw)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_short_run_loads_none_of_the_machinery(tmp_path):
    raw = tiny_params(train={"iterations": 3, "block_size": 0})
    got = _short_run(tmp_path, raw)
    assert got == {"ends": [3], "args": ["repro"], "notes": [], "loaded": []}


def test_blocks_to_seal_or_a_seal_on_disk_switch_it_on(tmp_path):
    assert long_run.active(tmp_path, config_from_dict(tiny_params(train={"iterations": 5, "block_size": 2})))
    short = config_from_dict(tiny_params(train={"iterations": 5, "block_size": 0}))
    assert not long_run.active(tmp_path, short)
    (tmp_path / SEALS).mkdir(parents=True)
    (tmp_path / SEALS / "0001-0002.yaml").write_text("first: 1\n")  # left by an earlier block size
    assert long_run.active(tmp_path, short)
    assert long_run.repro_ends(tmp_path, config_from_dict(tiny_params(train={"iterations": 5, "block_size": 2})),
                               set()) == [4, 5]  # block 1-2 sealed: the next block's end, then the run's
