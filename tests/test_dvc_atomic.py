"""DVC killed inside the write of its own files (dvc.lock, .dvc/tmp/rwlock): through
``tpgrpo.pipeline.dvc_integration.dvc_atomic`` the file is the old one and the next repro works; through plain DVC
(the control, what ``tpgrpo run`` used before) the file is a part and the next repro fails. The kill lands at a
random byte of the write (seeded), from inside the real DVC process, by SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpgrpo.pipeline.dvc_integration.dvc_atomic import TMP_MARK, atomic_write_text, sweep_stale_temps

# Runs DVC's CLI in-process with a writer that, on the first write of the file named by argv[2], saves the whole
# text it was asked to write to argv[4], writes a fraction argv[3] of it, flushes that to the disk and SIGKILLs
# its own process. DVC's arguments follow.
DRIVER = textwrap.dedent(r"""
    import io, json, os, signal, sys
    mode, target, fraction, intended = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    if mode == "atomic":
        from tpgrpo.pipeline.dvc_integration import dvc_atomic
        dvc_atomic.install()

    def die_inside(stream, text):
        if target not in os.path.basename(getattr(stream, "name", "")):
            return False
        with open(intended, "w") as f:
            f.write(text)
        stream.write(text[: max(1, int(len(text) * fraction))])
        stream.flush()
        os.fsync(stream.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    from dvc.utils.serialize import _yaml
    real_dump = _yaml._dump
    def dump(data, stream, *args, **kwargs):
        text = io.StringIO()
        real_dump(data, text, *args, **kwargs)
        die_inside(stream, text.getvalue()) or stream.write(text.getvalue())
    _yaml._dump = dump
    if mode == "atomic":  # a stage's lock write goes through lock_blocks: its whole text is written here
        from tpgrpo.pipeline.dvc_integration import lock_blocks
        real_write = lock_blocks.write_stream
        lock_blocks.write_stream = lambda stream, text: die_inside(stream, text) or real_write(stream, text)

    real_json_dump = json.dump
    def json_dump(obj, fp, *args, **kwargs):
        die_inside(fp, json.dumps(obj, *args, **kwargs)) or real_json_dump(obj, fp, *args, **kwargs)
    json.dump = json_dump

    from dvc.cli import main
    sys.exit(main(sys.argv[5:]))
""")

PIPELINE = """\
stages:
  first:
    cmd: python -c "open('a.txt', 'w').write(open('in.txt').read() * 2)"
    deps: [in.txt]
    outs: [a.txt]
  second:
    cmd: python -c "open('b.txt', 'w').write(open('a.txt').read().upper())"
    deps: [a.txt]
    outs: [b.txt]
""".replace("cmd: python ", f"cmd: {sys.executable} ")  # a fresh machine may have no `python`


def _env() -> dict[str, str]:
    return dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")


def _atomic_dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpgrpo.pipeline.dvc_integration.dvc_atomic", *args], cwd=root,
                          env=_env(), capture_output=True, text=True)


def _killed_repro(root: Path, mode: str, target: str, fraction: float) -> subprocess.CompletedProcess:
    intended = root.parent / "intended.txt"
    return subprocess.run([sys.executable, "-c", DRIVER, mode, target, str(fraction), intended, "repro"],
                          cwd=root, env=_env(), capture_output=True, text=True)


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A two-stage DVC project, reproduced once (dvc.lock written), then its input changed."""
    root = tmp_path / "p"
    root.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=_env(), check=True)
    (root / "dvc.yaml").write_text(PIPELINE)
    (root / "in.txt").write_text("one\n")
    assert _atomic_dvc(root, "repro").returncode == 0
    (root / "in.txt").write_text("two\n")
    return root


_RNG = random.Random(46)  # the cut points, drawn once: the same three on every run
FRACTIONS = [round(_RNG.uniform(0.02, 0.98), 3) for _ in range(3)]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_repro_killed_while_dvc_writes_dvc_lock_leaves_the_old_lock(project: Path, fraction: float):
    before = (project / "dvc.lock").read_bytes()
    killed = _killed_repro(project, "atomic", "dvc.lock", fraction)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (project / "dvc.lock").read_bytes() == before
    temps = list(project.glob(f".*{TMP_MARK}*"))  # the killed writer's part is left beside the lock ...
    intended = (project.parent / "intended.txt").read_text()
    assert len(temps) == 1 and intended.startswith(temps[0].read_text()) and intended.encode() != before
    again = _atomic_dvc(project, "repro")
    assert again.returncode == 0, again.stderr[-2000:]
    assert not list(project.glob(f".*{TMP_MARK}*"))  # ... and swept by the next run
    status = _atomic_dvc(project, "status", "--json")
    assert json.loads(status.stdout) == {}
    assert (project / "b.txt").read_text() == "TWO\nTWO\n"


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_control_plain_dvc_killed_inside_the_write_leaves_a_part_of_the_lock(project: Path, fraction: float):
    """What tpgrpo run did before: the same kill through plain DVC leaves in dvc.lock a strict part of the text
    DVC was writing (which the next repro reads as a broken lock, or worse as a valid one with a cut value)."""
    before = (project / "dvc.lock").read_bytes()
    killed = _killed_repro(project, "plain", "dvc.lock", fraction)
    assert killed.returncode == -signal.SIGKILL
    part, intended = (project / "dvc.lock").read_text(), (project.parent / "intended.txt").read_text()
    assert part.encode() != before and len(part) < len(intended) and intended.startswith(part)


@pytest.mark.parametrize("mode, next_run_works", [("atomic", True), ("plain", False)])
def test_a_repro_killed_while_dvc_writes_its_rwlock(project: Path, mode: str, next_run_works: bool):
    killed = _killed_repro(project, mode, "rwlock", FRACTIONS[1])
    assert killed.returncode == -signal.SIGKILL
    again = _atomic_dvc(project, "repro")
    assert (again.returncode == 0) is next_run_works, again.stderr[-2000:]
    if not next_run_works:
        assert "rwlock" in (again.stderr + again.stdout).lower()


def test_atomic_write_keeps_the_target_when_the_writer_fails(tmp_path: Path):
    target = tmp_path / "dvc.lock"
    target.write_text("old\n")
    target.chmod(0o640)

    def fails(stream):
        stream.write("a part")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write_text(target, fails)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["dvc.lock"]
    atomic_write_text(target, lambda s: s.write("new\n"))
    assert target.read_text() == "new\n" and target.stat().st_mode & 0o777 == 0o640


def test_the_sweep_removes_only_the_temporaries_of_dead_writers(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = tmp_path / f".dvc.lock{TMP_MARK}{dead.pid}", tmp_path / f".dvc.lock{TMP_MARK}{os.getpid()}"
    stale.write_text("part")
    live.write_text("part")
    assert sweep_stale_temps(tmp_path) == [stale]
    assert live.exists() and not stale.exists()
