"""How one stage command runs: ``tpgrpo stage NAME`` and ``tpgrpo block``, with their checks and notes.

Why a module of its own (orchestration, not stage code): the command line (:mod:`tpgrpo.cli`) and the stage
server's forked child (:mod:`tpgrpo.pipeline.execution.stage_server`) both run stages. When this lived in ``cli.py`` the
server imported the CLI and the CLI the server (an import cycle), and every stage's code manifest followed the
runner into ``cli.py``, so editing the help text of ``tpgrpo status`` re-ran every stage. A stage's manifest is
the code that computes its artifacts (:mod:`tpgrpo.pipeline.rendering.code_manifest`): this module, the params checks,
the status notes and the launcher are in none.

Around the stage module's ``run`` it: starts the launched processes (``launch``), checks the iteration and the
params, notes the stage for ``tpgrpo status``, refuses code that does not match its manifest under DVC
(before and after), and turns expected errors and a full disk into one line and exit code 2.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from tpgrpo.stage_params import RUN_STAGES, STAGE_LOGS

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads of
# concurrent processes slowed a training step from 1.2 s to 17 s. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

STAGES = STAGE_LOGS  # the stages of one iteration (--iter): tpgrpo.stage_params.ITERATION_STAGES

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
IterOpt = Annotated[int, typer.Option("--iter", help="iteration 1..train.iterations (iteration i samples from "
                                     "policy i-1, the base model for i = 1, and writes policy i)")]

stage_app = typer.Typer(help="Run one pipeline stage of one iteration (what dvc.yaml calls).",
                        no_args_is_help=True)
# What the stage server's child runs: the stage commands and `block`, nothing else of the CLI.
runner_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
runner_app.add_typer(stage_app, name="stage")


def fail(message: str) -> None:
    """Print a one-line error and exit non-zero (no traceback for expected errors)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def run_stage(name: str, iteration: int | None, params: Path) -> None:
    """Run ``stages.<name>.run`` with the checks around it (see the module docstring)."""
    from tpgrpo import distributed
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.stage_params import MULTI_PROCESS_STAGES
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.rendering.code_manifest import check_stage_code
    from tpgrpo.pipeline.dvc_integration.params_read import note_params_read
    from tpgrpo.pipeline.status import (check_iteration, check_params_unchanged, describe_done, record_stage,
                                        stage_params)

    root, cfg = Path(params).resolve().parent, None
    label = f"{name}" + ("" if iteration is None else f" --iter {iteration}")
    try:
        read = stage_params(params, name, missing_ok=True)  # before the stage reads them: an edit from now is seen
        cfg = load_config(params)  # names what is wrong with params.yaml, if anything
        read = read if read is not None else stage_params(params, name)
        check_iteration(cfg, root, iteration)
        if name in MULTI_PROCESS_STAGES:  # the launch params may ask for more processes: start them
            from tpgrpo.pipeline.execution.launch import exec_launcher, launch_argv

            argv = launch_argv(cfg, root, stage_args(name, iteration, params))
            if argv is not None:
                exec_launcher(argv)  # does not return: each launched process runs this same command
        module = stage_module(name)
        if name in MULTI_PROCESS_STAGES:  # launched: join the process group (gloo on CPU); else one process
            distributed.init(cfg.model.device, cfg.launch.timeout_s, f"stage {label}")
        main = distributed.current().is_main  # one process notes the stage for `tpgrpo status`
        record_stage(root, name, iteration, "running", enabled=main)
        check_stage_code(root, name, cfg)  # the code DVC will record is the code that runs (before and after)
        module.run(cfg, iteration, root=root)
        check_stage_code(root, name, cfg)  # against the params it ran with
        check_params_unchanged(params, name, label, read)  # DVC records params.yaml as it is when we exit
        if main:  # ... after it has hashed our outputs: `tpgrpo run` compares this note with what it recorded
            note_params_read(root, name if iteration is None else f"{name}-{iteration:04d}", read)
        record_stage(root, name, iteration, "done", enabled=main)
    except (ConfigError, PipelineError, FileNotFoundError) as exc:
        message = str(exc)
        if iteration is not None and message.startswith("missing input") and cfg is not None:
            message += f"; finished iterations: {describe_done(root, cfg.train.iterations)}"
        record_stage(root, name, iteration, "failed", message, enabled=distributed.is_main_process())
        fail(message)
    except Exception as exc:  # an unexpected error still shows in `tpgrpo status`, then its traceback
        record_stage(root, name, iteration, "failed", f"{type(exc).__name__}: {exc}",
                     enabled=distributed.is_main_process())
        raise
    finally:
        distributed.shutdown()


def stage_module(name: str):
    """The stage module ``stages.<name>``, imported: the one door to the stage shells (nothing but the stage
    runner imports ``stages``; ``tests/test_stage_imports.py`` checks it)."""
    import importlib

    return importlib.import_module(f"stages.{name}")


def run_stage_module(name: str, cfg, iteration: int | None, root: Path) -> dict:
    """``stages.<name>.run(cfg, iteration, root)`` in this process, without the command's checks (benches run
    stages through it)."""
    return stage_module(name).run(cfg, iteration, root=root)


def stage_args(name: str, iteration: int | None, params: Path) -> list[str]:
    """The arguments of ``tpgrpo`` that run this stage again (in each launched process)."""
    return ["stage", name, *([] if iteration is None else ["--iter", str(iteration)]), "--params", str(params)]


def _make_stage_command(name: str):
    def command(iteration: IterOpt, params: ParamsOpt = Path("params.yaml")) -> None:
        run_stage(name, iteration, params)

    command.__doc__ = f"Run the {name} stage of iteration --iter."
    return command


def _make_run_stage_command(name: str, help_text: str):
    def command(params: ParamsOpt = Path("params.yaml")) -> None:
        run_stage(name, None, params)

    command.__doc__ = help_text
    return command


for _name in STAGES:
    stage_app.command(_name)(_make_stage_command(_name))
for _stage in RUN_STAGES:  # once per run, no --iter: tpgrpo.stage_params.RUN_STAGES
    stage_app.command(_stage.name)(_make_run_stage_command(_stage.name, _stage.help))


# The code stage runs no stage module: it writes the manifests the other stages depend on (no record).
@stage_app.command("code")
def code_stage(params: ParamsOpt = Path("params.yaml")) -> None:
    """Write data/code/<kind>.json: the md5 of every code file each kind of stage runs (its dependency)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.pipeline.rendering.code_manifest import write_manifests
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.migrate import refuse_older_layout
    from tpgrpo.pipeline.rendering.dvcfile import check_rendered

    root = Path(params).resolve().parent
    try:
        cfg = load_config(params)
        refuse_older_layout(root)  # rewriting its manifests would re-run every stage
        check_rendered(cfg, root)
        write_manifests(root, cfg)
    except (FileNotFoundError, ConfigError, PipelineError) as exc:
        fail(str(exc))


@runner_app.command("block")
def block_command(first: Annotated[int, typer.Option("--first", help="first iteration of the block")],
                  last: Annotated[int, typer.Option("--last", help="last iteration of the block")],
                  params: ParamsOpt = Path("params.yaml")) -> None:
    """Re-run a sealed block: each iteration's stages in order, one process each (what dvc.yaml calls)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.long_runs.sealing import run_block
    from tpgrpo.pipeline.long_runs.blocks import Block, full_blocks

    try:
        cfg = load_config(params)
        block = Block(first, last)
        if block not in full_blocks(cfg.train.block_size, cfg.train.iterations):
            raise PipelineError(f"--first {first} --last {last}: not a block of train.block_size = "
                                f"{cfg.train.block_size} inside 1..{cfg.train.iterations}")
        run_block(Path(params).resolve().parent, cfg, block)
    except (ConfigError, PipelineError) as exc:
        fail(str(exc))


# What a full or read-only disk raises: the environment, not a bug, so one line naming the file, no traceback.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
ACCESS_ERRNOS = {errno.EACCES, errno.EPERM}


def run_guarded(app: typer.Typer, args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run a typer ``app`` with one boundary for disk and permission errors: ``error: PATH: No space left on
    device (ENOSPC) ...`` or ``error: PATH: Permission denied (EACCES) ...``, exit code 2. Every entry point
    goes through here (the console script, the stage server's child)."""
    try:
        app(args=args, prog_name=prog_name)
    except OSError as exc:
        code = exc.errno
        if code is None:  # an I/O error wrapped by a library may carry its errno in the message only
            found = re.search(r"\[errno (\d+)\]", str(exc), re.IGNORECASE)
            code = int(found.group(1)) if found else None
        where = exc.filename or "a file of the project"
        if code in ACCESS_ERRNOS:  # a file of another user (a shared project) or made read-only
            typer.echo(f"error: {where}: {os.strerror(code)} ({errno.errorcode[code]}): this user may not "
                       "write or read it; fix its owner or mode (ls -l, chmod, chown) and run again", err=True)
            raise SystemExit(2) from None
        if code not in DISK_ERRNOS:
            raise
        typer.echo(f"error: {where}: {os.strerror(code)} ({errno.errorcode[code]}): nothing was recorded for "
                   "it; free disk space (or make it writable) and run again", err=True)
        raise SystemExit(2) from None


def run_stage_command(args: list[str], prog_name: str = "tpgrpo") -> None:
    """``tpgrpo stage ...`` / ``tpgrpo block ...`` (``args`` without the program name), as the CLI runs them:
    what the stage server's forked child calls."""
    run_guarded(runner_app, args, prog_name)
