"""The ``tpgrpo`` command line (typer). Heavy imports (torch, diffusers) happen inside commands.

The stage commands (``tpgrpo stage ...``, ``tpgrpo block``) are defined and run by
:mod:`tpgrpo.pipeline.execution.stage_runner`; this module mounts them. No stage's code manifest contains this file.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Optional

import typer

# The stage commands and what runs them (imported first: it sets OMP_WAIT_POLICY before torch can load).
from tpgrpo.pipeline.execution.stage_runner import IterOpt, ParamsOpt, block_command, run_guarded, stage_app
from tpgrpo.pipeline.execution.stage_runner import fail as _fail

app = typer.Typer(help="TP-GRPO post-training of flow-matching text-to-image models.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(stage_app, name="stage")


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
    from tpgrpo.reports.history import history
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
    """Render dvc.yaml from params.yaml (one set of stages per iteration). Refused while `tpgrpo run` or a DVC
    command runs in the project."""
    with ExitStack() as held:
        _hold_rendering(held, Path(params).resolve().parent)
        _render_dvc_yaml(params)


def _hold_rendering(stack: ExitStack, root: Path) -> None:
    """Hold the project's run lock on ``stack`` (:func:`tpgrpo.pipeline.dvc_integration.dvclock.rendering`): a second
    ``tpgrpo run`` or ``tpgrpo dvc-yaml``, or one beside a running DVC command, stops with one line before it
    writes anything. A DVC project outside a git repository stops with one line first."""
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.dvc_integration.dvclock import rendering
    from tpgrpo.pipeline.rendering.project_checks import require_scm

    try:
        require_scm(root)
        stack.enter_context(rendering(root))
    except PipelineError as exc:
        _fail(str(exc))


def _render_dvc_yaml(params: Path) -> None:
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml
    from tpgrpo.pipeline.migrate import refuse_older_layout
    from tpgrpo.pipeline import long_run

    try:
        cfg = load_config(params)
        refuse_older_layout(Path(params).resolve().parent)
        long_run.sweep(Path(params).resolve().parent, typer.echo)  # an interrupted unsealing's leftovers first
        changed = write_dvc_yaml(cfg, Path(params).resolve().parent)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    typer.echo("dvc.yaml updated" if changed else "dvc.yaml up to date")


@app.command("run")
def run_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """The main job: render dvc.yaml and `dvc repro` (trains train.iterations iterations) block by block,
    sealing each finished block of train.block_size iterations into one DVC stage before the next. Refused
    while another `tpgrpo run` or a DVC command runs in the project."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.long_runs.blocks import read_as_dvc
    from tpgrpo.pipeline.dvc_integration.dvc_atomic import dvc_env, sweep_stale_temps
    from tpgrpo.io.dvc_versions import require_verified

    root = Path(params).resolve().parent
    try:
        require_verified()  # every DVC command of the run goes through tpgrpo's patches of DVC
        cfg = load_config(params)
        raw = read_as_dvc(Path(params))  # values as DVC reads them
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    env = dvc_env()
    if not (root / ".dvc").is_dir():
        _dvc_init(root, env)
    with ExitStack() as held:
        _hold_rendering(held, root)  # for the whole run: its renders between repros too
        sweep_stale_temps(root)  # a killed writer's temporary files (their writers are gone: the lock is ours)
        _run_held(params, root, cfg, raw, env)


def _run_held(params: Path, root: Path, cfg, raw: dict, env: dict) -> None:
    """:func:`run_command`'s work, with the project's run lock held."""
    from tpgrpo.config import ConfigError
    from tpgrpo.models import resident
    from tpgrpo.pipeline.execution import stage_server
    from tpgrpo.pipeline.rendering.dvcfile import RENDER_UPTO_ENV
    from tpgrpo.pipeline.dvc_integration.dvclock import clear_stale_lock
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline import long_run
    from tpgrpo.pipeline.rendering.code_manifest import manifests_refreshed
    from tpgrpo.pipeline.repro import repro_checked
    from tpgrpo.pipeline.migrate import refuse_older_layout

    try:
        refuse_older_layout(root)  # before the manifests are refreshed: a project made by an older version
        # a code edit (or a code path's switch) shows in the manifests: the blocks are checked against them,
        # and a refused run puts them back (a refused run changes nothing)
        with manifests_refreshed(root, cfg):
            pending = long_run.prepare(root, cfg, raw, typer.echo)  # structural changes at once, the rest later
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    # each repro renders dvc.yaml through its own end: no render of the whole run before the first
    note = clear_stale_lock(root)  # a killed, not yet reaped run's lock would block `dvc repro`
    if note:
        typer.echo(note)
    with stage_server.running(root, stage_server.wanted(cfg), resident.spec(cfg, root)) as server_env:
        # block by block: dvc.lock stays about one block long; the manifests were refreshed just above, so the
        # first repro does not hash the code again (a later one does: code edited while a block ran re-runs)
        for i, upto in enumerate(long_run.repro_ends(root, cfg, pending)):
            try:
                long_run.before_repro(root, cfg, raw, upto, typer.echo)
                repro_checked(root, cfg, upto, {**env, **server_env, RENDER_UPTO_ENV: str(upto)}, typer.echo,
                              refresh_code=i > 0)
                long_run.after_repro(root, cfg, upto, typer.echo)
            except PipelineError as exc:
                _fail(str(exc))


def _dvc_init(root: Path, env: dict) -> None:
    """``dvc init`` a project folder with this project's settings."""
    scm = [] if (root / ".git").exists() else ["--no-scm"]
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", *scm], cwd=root, env=env, check=True)
    # never a hard link or symlink: damage in place would damage the cache object too (DVC_CACHE_TYPE)
    from tpgrpo.io.artifacts import DVC_CACHE_TYPE

    for key, value in (("core.analytics", "false"), ("core.check_update", "false"),
                       ("cache.type", DVC_CACHE_TYPE)):
        subprocess.run([sys.executable, "-m", "dvc", "config", key, value], cwd=root, env=env, check=True)


app.command("block")(block_command)  # what a sealed block's DVC stage runs (tpgrpo.pipeline.execution.stage_runner)


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
    from tpgrpo.pipeline.long_runs.sealing import retain
    from tpgrpo.pipeline.migrate import refuse_older_layout

    try:
        refuse_older_layout(Path(params).resolve().parent)
        dropped = retain(Path(params).resolve().parent, load_config(params), gc=gc, note=typer.echo)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    typer.echo(f"dropped {len(dropped)} artifacts" + (f" (first: {dropped[0]})" if dropped else ""))


@app.command("migrate")
def migrate_command(params: ParamsOpt = Path("params.yaml")) -> None:
    """Bring a project made by an older version of tpgrpo to this version's layout, once: records of stages
    whose code is unchanged are kept (nothing re-runs); a line for each change. Holds the run lock and DVC's."""
    from tpgrpo.config import ConfigError, load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.migrate import migrate

    root = Path(params).resolve().parent
    with ExitStack() as held:
        _hold_rendering(held, root)
        try:
            notes = migrate(root, load_config(params))
        except (ConfigError, PipelineError) as exc:
            _fail(str(exc))
    for line in notes or ["already in this version's layout: nothing to do"]:
        typer.echo(line)


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
    # Imported here, not mounted with add_typer: `tpgrpo --help` and every stage command start without it.
    from tpgrpo.comparison.cli import app as compare_app

    compare_app(args=ctx.args, prog_name="tpgrpo compare")


def run_app(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """The CLI (``app``) inside the disk-error boundary of
    :func:`tpgrpo.pipeline.execution.stage_runner.run_guarded`."""
    run_guarded(app, args, prog_name)


def main() -> None:  # pragma: no cover - console entry point
    run_app()
