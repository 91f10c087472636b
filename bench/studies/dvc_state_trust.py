"""Does ``dvc repro`` take an md5 that the stage itself wrote into DVC's state database? ("hashing while
writing", tpgrpo/io/dvc_prehash.py, needs it.)

    python -m bench.studies.dvc_state_trust

Builds a throw-away DVC project (no git) in a temporary folder whose one stage writes three 1 MiB files into
``out/`` and then saves an md5 for each into DVC's state database (``Repo.state.save_many``: entries keyed by
path, inode, mtime and size), one of them deliberately wrong. After ``dvc repro`` it prints what DVC recorded:
if ``dvc.lock``'s directory object lists the wrong md5 and ``dvc status`` is clean, DVC trusted the stage's
entry and never read the file (so a stage that hashes its bytes while writing can spare DVC that pass, and a
wrong entry is a silent, cached corruption). Exits 0 either way; the last line is the answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STAGE = '''
import hashlib, os
from pathlib import Path
from dvc.repo import Repo
from dvc_data.hashfile.hash_info import HashInfo
tmp = Path("out.tmp"); tmp.mkdir()
digests = {}
for k in range(3):
    data = os.urandom(1 << 20)
    (tmp / f"f{k}.bin").write_bytes(data)
    digests[f"f{k}.bin"] = hashlib.md5(data).hexdigest()
tmp.rename("out")
digests["f0.bin"] = "0" * 32  # deliberately wrong
repo = Repo(".")
repo.state.save_many([(os.path.abspath(f"out/{n}"), HashInfo("md5", m), None) for n, m in digests.items()], repo.fs)
repo.close()
'''


def dvc(root: Path, *args: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_STUDIO_OFFLINE": "true"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env, check=True,
                          capture_output=True, text=True).stdout


def main() -> None:
    import dvc as dvc_package
    import yaml

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "stage.py").write_text(STAGE)
        (root / "dvc.yaml").write_text(yaml.safe_dump(
            {"stages": {"gen": {"cmd": f"{sys.executable} stage.py", "outs": ["out"]}}}))
        dvc(root, "init", "-q", "--no-scm")
        dvc(root, "repro", "-q")
        lock = yaml.safe_load((root / "dvc.lock").read_text())
        dir_md5 = lock["stages"]["gen"]["outs"][0]["md5"]
        listing = json.loads((root / ".dvc/cache/files/md5" / dir_md5[:2] / dir_md5[2:]).read_text())
        recorded = {entry["relpath"]: entry["md5"] for entry in listing}
        status = dvc(root, "status").strip()
        print(f"dvc {dvc_package.__version__}: recorded md5 of f0.bin {recorded['f0.bin']}; dvc status: {status}")
        trusted = recorded["f0.bin"] == "0" * 32
        print("DVC TRUSTED the stage's state entry (it did not hash the file)" if trusted
              else "DVC hashed the file itself (the stage's entry was not used)")


if __name__ == "__main__":
    main()
