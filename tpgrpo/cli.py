"""The ``tpgrpo`` command line (typer). Heavy imports (torch, diffusers) happen inside commands."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads of
# concurrent processes slowed a training step from 1.2 s to 17 s. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = typer.Typer(help="TP-GRPO post-training of flow-matching text-to-image models.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
stage_app = typer.Typer(help="Run one pipeline stage of one iteration (what dvc.yaml calls).",
                        no_args_is_help=True)
app.add_typer(stage_app, name="stage")

STAGES = ("rollout", "probe", "credit", "update", "eval")

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
IterOpt = Annotated[int, typer.Option("--iter", help="iteration 1..train.iterations (iteration i samples from "
                                     "policy i-1, the base model for i = 1, and writes policy i)")]


def _fail(message: str) -> None:
    """Print a one-line error and exit non-zero (no traceback for expected errors)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _run_stage(name: str, iteration: int | None, params: Path) -> None:
    from tpgrpo import distributed
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.stage_params import MULTI_PROCESS_STAGES
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.code_manifest import check_stage_code
    from tpgrpo.pipeline.params_read import note_params_read
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
            from tpgrpo.pipeline.launch import exec_launcher, launch_argv

            argv = launch_argv(cfg, root, _stage_args(name, iteration, params))
            if argv is not None:
                exec_launcher(argv)  # does not return: each launched process runs this same command
        import importlib

        module = importlib.import_module(f"stages.{name}")
        if name in MULTI_PROCESS_STAGES:  # launched: join the process group (gloo on CPU); else one process
            distributed.init(cfg.model.device, cfg.launch.timeout_s, f"stage {label}")
        main = distributed.current().is_main  # one process notes the stage for `tpgrpo status`
        record_stage(root, name, iteration, "running", enabled=main)
        check_stage_code(root, name)  # the code DVC will record is the code that runs (before and after)
        module.run(cfg, iteration, root=root)
        check_stage_code(root, name)
        check_params_unchanged(params, name, label, read)  # DVC records params.yaml as it is when we exit
        if main:  # ... after it has hashed our outputs: `tpgrpo run` compares this note with what it recorded
            note_params_read(root, name if iteration is None else f"{name}-{iteration:04d}", read)
        record_stage(root, name, iteration, "done", enabled=main)
    except (ConfigError, PipelineError, FileNotFoundError) as exc:
        message = str(exc)
        if iteration is not None and message.startswith("missing input") and cfg is not None:
            message += f"; finished iterations: {describe_done(root, cfg.train.iterations)}"
        record_stage(root, name, iteration, "failed", message, enabled=distributed.is_main_process())
        _fail(message)
    except Exception as exc:  # an unexpected error still shows in `tpgrpo status`, then its traceback
        record_stage(root, name, iteration, "failed", f"{type(exc).__name__}: {exc}",
                     enabled=distributed.is_main_process())
        raise
    finally:
        distributed.shutdown()


def _stage_args(name: str, iteration: int | None, params: Path) -> list[str]:
    """The arguments of ``tpgrpo`` that run this stage again (in each launched process)."""
    return ["stage", name, *([] if iteration is None else ["--iter", str(iteration)]), "--params", str(params)]


def _make_stage_command(name: str):
    def command(iteration: IterOpt, params: ParamsOpt = Path("params.yaml")) -> None:
        _run_stage(name, iteration, params)

    command.__doc__ = f"Run the {name} stage of iteration --iter."
    return command


for _name in STAGES:
    stage_app.command(_name)(_make_stage_command(_name))


@stage_app.command("baseline")
def baseline_stage(params: ParamsOpt = Path("params.yaml")) -> None:
    """Evaluate the base model (the curves' starting point)."""
    _run_stage("baseline", None, params)


@stage_app.command("eval_prompts")
def eval_prompts_stage(params: ParamsOpt = Path("params.yaml")) -> None:
    """Encode the held-out prompts once (data/iters/eval_prompt_embeds), for every eval and the baseline."""
    _run_stage("eval_prompts", None, params)


@stage_app.command("summary")
def summary_stage(params: ParamsOpt = Path("params.yaml")) -> None:
    """Collect every iteration's metrics into data/metrics/history.csv and summary.json."""
    _run_stage("summary", None, params)


@stage_app.command("code")
def code_stage(params: ParamsOpt = Path("params.yaml")) -> None:
    """Write data/code/<kind>.json: the md5 of every code file each kind of stage runs (its dependency)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.pipeline.code_manifest import write_manifests
    from tpgrpo.pipeline.dvcfile import check_rendered

    root = Path(params).resolve().parent
    try:
        check_rendered(load_config(params), root)
        write_manifests(root)
    except (FileNotFoundError, ConfigError) as exc:
        _fail(str(exc))


@app.command("status")
def status_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """One screen: iterations done, the stage running or failed last, held-out reward vs base, disk."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.pipeline.status import status_text

    try:
        cfg = load_config(params)
    except ConfigError as exc:
        _fail(str(exc))
    typer.echo(status_text(Path(params).resolve().parent, cfg.train.iterations))


@app.command("plot")
def plot_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """Draw the run's figures into data/reports/ (reward curves, turning points, heat map, before/after)."""
    from stages.summary import history
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.reports.figures import make_figures

    root = Path(params).resolve().parent
    try:
        cfg = load_config(params)
        for path in make_figures(cfg, root, history(cfg, root)):
            typer.echo(str(path))
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))


@app.command("dvc-yaml")
def dvc_yaml_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """Render dvc.yaml from params.yaml (one set of stages per iteration)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.pipeline.dvcfile import write_dvc_yaml

    try:
        cfg = load_config(params)
        changed = write_dvc_yaml(cfg, Path(params).resolve().parent)
    except ConfigError as exc:
        _fail(str(exc))
    typer.echo("dvc.yaml updated" if changed else "dvc.yaml up to date")


@app.command("run")
def run_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """The main job: render dvc.yaml and `dvc repro` (trains train.iterations iterations) block by block,
    sealing each finished block of train.block_size iterations into one DVC stage before the next."""
    from tpgrpo.pipeline import stage_server
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.pipeline.dvcfile import RENDER_UPTO_ENV
    from tpgrpo.pipeline.dvclock import clear_stale_lock
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.sealing import dvc_env, repro_ends, seal_finished, unseal_changed
    from tpgrpo.pipeline.blocks import read_as_dvc
    from tpgrpo.pipeline.repro import repro_checked

    root = Path(params).resolve().parent
    try:
        cfg = load_config(params)
        unsealed = unseal_changed(root, cfg, read_as_dvc(Path(params)))  # values as DVC reads them
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    if unsealed:
        typer.echo(f"unsealed {', '.join(b.name for b in unsealed)} (params changed since sealing)")
    dvc_yaml_command(params)
    note = clear_stale_lock(root)  # a killed, not yet reaped run's lock would block `dvc repro`
    if note:
        typer.echo(note)
    env = dvc_env()
    if not (root / ".dvc").is_dir():
        scm = [] if (root / ".git").exists() else ["--no-scm"]
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q", *scm], cwd=root, env=env, check=True)
        # never a hard link or symlink: damage in place would damage the cache object too (DVC_CACHE_TYPE)
        from tpgrpo.io.artifacts import DVC_CACHE_TYPE

        for key, value in (("core.analytics", "false"), ("core.check_update", "false"),
                           ("cache.type", DVC_CACHE_TYPE)):
            subprocess.run([sys.executable, "-m", "dvc", "config", key, value], cwd=root, env=env, check=True)
    with stage_server.running(root, stage_server.wanted(cfg)) as server_env:
        for upto in repro_ends(root, cfg):  # block by block: dvc.lock stays about one block long
            try:
                repro_checked(root, cfg, upto, {**env, **server_env, RENDER_UPTO_ENV: str(upto)}, typer.echo)
                sealed = seal_finished(root, cfg, upto, note=typer.echo)
            except PipelineError as exc:
                _fail(str(exc))
            if sealed:
                typer.echo(f"sealed {', '.join(b.name for b in sealed)} (one DVC stage per block from now on)")



@app.command("block")
def block_command(first: Annotated[int, typer.Option("--first", help="first iteration of the block")],
                  last: Annotated[int, typer.Option("--last", help="last iteration of the block")],
                  params: ParamsOpt = Path("params.yaml")) -> None:
    """Re-run a sealed block: each iteration's stages in order, one process each (what dvc.yaml calls)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.sealing import run_block
    from tpgrpo.pipeline.blocks import Block, full_blocks

    try:
        cfg = load_config(params)
        block = Block(first, last)
        if block not in full_blocks(cfg.train.block_size, cfg.train.iterations):
            raise PipelineError(f"--first {first} --last {last}: not a block of train.block_size = "
                                f"{cfg.train.block_size} inside 1..{cfg.train.iterations}")
        run_block(Path(params).resolve().parent, cfg, block)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))


@app.command("retain")
def retain_command(params: ParamsOpt = Path("params.yaml"),
                   gc: Annotated[bool, typer.Option(help="remove the dropped outputs' cache objects that nothing else "
                                                         "in this project references (not `dvc gc`: experiments' "
                                                         "and other commits' objects stay)")] = True,
                   ) -> None:
    """Apply params.yaml's retention to the sealed blocks; `dvc status` stays clean. Holds DVC's lock (refused
    while a DVC command runs in the project)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.sealing import retain

    try:
        dropped = retain(Path(params).resolve().parent, load_config(params), gc=gc, note=typer.echo)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    typer.echo(f"dropped {len(dropped)} artifacts" + (f" (first: {dropped[0]})" if dropped else ""))


@app.command("prompts")
def prompts_command(
    out_dir: Annotated[Path, typer.Option(help="folder for the prompt JSONL files")] = Path("data/prompts"),
) -> None:
    """Generate the task prompt files (deterministic)."""
    from tpgrpo.tasks.prompts import write_prompt_files

    for path in write_prompt_files(out_dir):
        typer.echo(str(path))


def _register_pretrain() -> None:
    # pretrain.py imports torch lazily, so registering its command keeps `tpgrpo --help` fast.
    from tpgrpo.models.pretrain import pretrain_command

    app.command("pretrain")(pretrain_command)


_register_pretrain()


@app.command("export")
def export_command(
    iteration: IterOpt,
    out: Annotated[Path, typer.Option("--out", help="folder to write pytorch_lora_weights.safetensors into")],
    ema: Annotated[Optional[bool], typer.Option(
        "--ema/--no-ema", help="the EMA adapter or the raw one (default: the EMA when params has update.ema "
        "true, as eval scores it)")] = None,
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Export iteration --iter's LoRA adapter for a stock diffusers pipeline's load_lora_weights(--out)."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.policy.export import export_adapter

    try:
        if ema is None:  # spec section 7: the EMA is what evaluation and export use
            ema = load_config(params).update.ema
        done = export_adapter(Path(params).resolve().parent, iteration, out, ema=ema)
    except (PipelineError, ConfigError) as exc:
        _fail(str(exc))
    typer.echo(f"exported {done['tensors']} LoRA tensors from {done['source']} to {done['out']}")


@app.command("report-base")
def report_base_command(
    params: ParamsOpt = Path("params.yaml"),
    out_dir: Annotated[Path, typer.Option(help="folder for the report files")] = Path("data/reports"),
) -> None:
    """Evaluate the base model: held-out rewards at 10/40 ODE steps, zero-increment fractions, a grid."""
    from tpgrpo.reports.base_report import write_base_report
    from tpgrpo.config import ConfigError, load_config

    try:
        cfg = load_config(params)
    except ConfigError as exc:
        _fail(str(exc))
    write_base_report(cfg, Path(params).resolve().parent, out_dir)


@app.command("serve-reward")
def serve_reward_command(
    reward: Annotated[str, typer.Option("--reward", help="reward name to serve (tpgrpo.tasks.rewards)")],
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0 = any free port)")] = 8765,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Serve a reward over HTTP for the `remote` reward (POST /score; reward models from params.yaml)."""
    from tpgrpo.config import Config, ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.rewards.server import serve
    from tpgrpo.tasks.rewards import build_reward

    try:  # without a params file, rewards that need no reward_models folders still serve
        cfg = load_config(params) if Path(params).is_file() else Config()
        scorer = build_reward(reward, cfg, Path(params).resolve().parent)
    except (ConfigError, PipelineError, ValueError) as exc:
        _fail(str(exc))
    try:
        serve(scorer, host, port)
    except OSError as exc:
        _fail(f"cannot serve on {host}:{port}: {exc}")


@app.command("compare", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare_command(ctx: typer.Context) -> None:
    """The credit-mode comparison: run | equal-wall | status | report | archive (`tpgrpo compare --help`)."""
    # Imported here, not mounted with add_typer: the stage commands' code manifests follow this module's
    # top level, and the comparison's code is no stage's.
    from tpgrpo.comparison.cli import app as compare_app

    compare_app(args=ctx.args, prog_name="tpgrpo compare")


# What a full or read-only disk raises: the environment, not a bug, so one line naming the file, no traceback.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def run_app(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """The CLI (``app``) with one boundary for disk errors: ``error: PATH: No space left on device (ENOSPC)
    ...``, exit code 2. Every entry point goes through here (the console script, the stage server's child)."""
    try:
        app(args=args, prog_name=prog_name)
    except OSError as exc:
        code = exc.errno
        if code is None:  # an I/O error wrapped by a library may carry its errno in the message only
            found = re.search(r"\[errno (\d+)\]", str(exc), re.IGNORECASE)
            code = int(found.group(1)) if found else None
        if code not in DISK_ERRNOS:
            raise
        where = exc.filename or "a file of the project"
        typer.echo(f"error: {where}: {os.strerror(code)} ({errno.errorcode[code]}): nothing was recorded for "
                   "it; free disk space (or make it writable) and run again", err=True)
        raise SystemExit(2) from None


def main() -> None:  # pragma: no cover - console entry point
    run_app()
