"""The project files tpgrpo writes: modes that honour the umask, killed writers' temporaries swept and ignored
by git, and a permission error as one line."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from tpgrpo.pipeline.long_runs.blocks import SEALS, write_text_atomic, write_yaml
from tpgrpo.pipeline.dvc_integration.dvc_atomic import TMP_MARK, atomic_write_text, sweep_stale_temps, temporary_sibling

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask():
    """Set the process umask for one test (returns the setter); the old one comes back after it."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_written_yaml_files_honour_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    write_yaml(tmp_path / "dvc.lock", {"schema": "2.0", "stages": {}})
    write_text_atomic(tmp_path / "data" / "seals" / "0001-0002" / "dvc.yaml", "stages: {}\n")
    assert (tmp_path / "dvc.lock").stat().st_mode & 0o777 == mode
    assert (tmp_path / "data" / "seals" / "0001-0002" / "dvc.yaml").stat().st_mode & 0o777 == mode
    (tmp_path / "dvc.lock").chmod(0o600)  # as the mkstemp writer left it: the next write makes it readable
    write_yaml(tmp_path / "dvc.lock", {"schema": "2.0", "stages": {}})
    assert (tmp_path / "dvc.lock").stat().st_mode & 0o777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "dvc.lock"]  # no temporary left


def test_dvc_writes_a_new_file_with_the_umask_and_keeps_an_existing_mode(tmp_path, umask):
    umask(0o022)
    atomic_write_text(tmp_path / "new", lambda f: f.write("x"))
    (tmp_path / "old").write_text("x")
    (tmp_path / "old").chmod(0o640)
    atomic_write_text(tmp_path / "old", lambda f: f.write("y"))
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("new", "old")] == [0o644, 0o640]


def dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_the_sweep_covers_every_folder_tpgrpo_writes_and_spares_live_writers(tmp_path):
    seal_folder = tmp_path / SEALS / "0001-0005"
    folders = [tmp_path, tmp_path / ".dvc" / "tmp", tmp_path / ".dvc" / "tmp" / "tpgrpo_seals", tmp_path / SEALS,
               seal_folder]
    dead, stale, live = dead_pid(), [], []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        stale.append(folder / f".x.yaml{TMP_MARK}{dead}-0123abcd")
        live.append(temporary_sibling(folder / "x.yaml"))  # this process's: a writer at work
    stale.append(tmp_path / f".dvc.lock{TMP_MARK}{dead}")  # the older name, without the random part
    for path in stale + live:
        path.write_text("part")
    assert sorted(sweep_stale_temps(tmp_path)) == sorted(stale)
    assert all(p.exists() for p in live) and not any(p.exists() for p in stale)


def test_temporary_names_are_ignored_by_git():
    names = [temporary_sibling(Path("data/seals/0001-0005.yaml")), Path(f".dvc.lock{TMP_MARK}12"),
             Path("data/iters/0001/.probe.parquet.tmp-12-0a1b2c3d"), Path("data/base/pretrain.ckpt.tmp-77"),
             Path("data/prompts/.train.jsonl.k2j3.tmp")]
    done = subprocess.run(["git", "check-ignore", "--no-index", *map(str, names)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.stdout.split() == [str(n) for n in names]


def test_tpgrpo_run_sweeps_a_killed_writers_temporaries_first(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tpgrpo import cli

    if subprocess.run(["git", "init", "-q", str(tmp_path)]).returncode != 0:
        pytest.skip("no git")
    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    stale = tmp_path / f".dvc.yaml{TMP_MARK}{dead_pid()}-00000000"
    stale.write_text("part")
    from conftest import tiny_params
    import yaml

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    seen = []
    monkeypatch.setattr(cli, "_run_held", lambda *args: seen.append(stale.exists()))
    result = CliRunner().invoke(cli.app, ["run", "--params", str(tmp_path / "params.yaml")])
    assert result.exit_code == 0, result.output
    assert seen == [False]  # gone before the run's work started


def permission_app(error: OSError) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def write() -> None:
        raise error

    @app.command()
    def other() -> None:  # a second command: typer then takes the command's name
        pass

    return app


def test_a_permission_error_is_one_line(capsys):
    from tpgrpo.pipeline.execution.stage_runner import run_guarded

    error = PermissionError(errno.EACCES, "Permission denied", "/p/dvc.lock")
    with pytest.raises(SystemExit) as exited:
        run_guarded(permission_app(error), ["write"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: /p/dvc.lock: Permission denied (EACCES): this user may not write or read it; fix its owner or "
        "mode (ls -l, chmod, chown) and run again"]
    with pytest.raises(ValueError):  # anything else still shows its traceback
        run_guarded(permission_app(ValueError("x")), ["write"])  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions: the read-only file is writable")
def test_a_read_only_project_file_is_one_line_from_the_cli(tmp_path):
    script = ("import sys, typer\nfrom pathlib import Path\nfrom tpgrpo.pipeline.long_runs.blocks import write_yaml\n"
              "from tpgrpo.pipeline.execution.stage_runner import run_guarded\napp = typer.Typer()\n@app.command()\n"
              "def go(p: Path):\n    write_yaml(p, {'a': 1})\n@app.command()\ndef other():\n    pass\n"
              "run_guarded(app, ['go', sys.argv[1]])\n")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    done = subprocess.run([sys.executable, "-c", script, str(folder / "dvc.lock")], capture_output=True, text=True)
    folder.chmod(0o755)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "(EACCES)" in done.stderr
