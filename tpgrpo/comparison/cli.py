"""Command line of the mode comparison: ``tpgrpo compare`` (``bench/compare_modes.py`` is an alias).

    run         create the run folders and train them (resumable: re-run the same command)
    equal-wall  give flow_grpo the iterations its cheaper iteration buys in tp's time, and train them
    status      where each run stands
    load-cost   time one model load in a trained run folder (the equal-wall pair without loading uses it)
    report      collect the stored results and write the Markdown report with its figures
    archive     keep a root's results (no artifacts) as a compact archive small enough to commit; report reads it
    page        write the results page: every archive's verdicts on one page (results/README.md)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from tpgrpo.comparison.variants import MODES  # no heavy imports: yaml and the config only

app = typer.Typer(help="Compare credit modes over training seeds, by iteration and by wall clock.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

OutOpt = Annotated[Path, typer.Option("--out", help="comparison root: one folder per variant and seed")]
JobsOpt = Annotated[int, typer.Option("--jobs", help="runs trained at once (processes)")]
ThreadsOpt = Annotated[int, typer.Option("--threads", help="torch/OpenMP threads per run")]


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _list(text: str, kind: type, what: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"{what} {text!r}: expected a comma-separated list of {kind.__name__}")


def _command_line() -> list[str]:
    """The command as typed, for the report and commands.txt (``tpgrpo``, ``python -m tpgrpo`` or the alias)."""
    prog = Path(sys.argv[0])
    if prog.name == "tpgrpo":
        return ["tpgrpo", *sys.argv[1:]]
    if prog.name == "__main__.py" and prog.parent.name == "tpgrpo":
        return ["python", "-m", "tpgrpo", *sys.argv[1:]]
    return ["python", sys.argv[0], *sys.argv[1:]]


def _report_results(results: dict[str, str]) -> None:
    failed = {k: v for k, v in results.items() if v.startswith("failed")}
    typer.echo(f"{len(results) - len(failed)} of {len(results)} runs done")
    for folder, why in failed.items():
        typer.echo(f"  {folder}: {why}", err=True)
    if failed:
        raise typer.Exit(code=1)


def _variants(modes: str, seeds: str, set_: list[str], mode_set: list[str], lr_sweep: str, sweep_seeds: str,
              ablations: str, ablation_seeds: str, tree_modes: str = "") -> list:
    """The comparison's variants from the command line: the main modes, the lr sweep, the ablations."""
    from tpgrpo.comparison import variants as arms
    from tpgrpo.config import ConfigError

    per_mode: dict[str, dict] = {}
    for item in mode_set:
        mode, sep, assignment = item.partition(":")
        if not sep:
            raise ConfigError(f"--mode-set {item!r}: expected MODE:section.key=value")
        per_mode.setdefault(mode, {}).update(arms.parse_assignments([assignment], "--mode-set"))
    per_tree = {m: per_mode.pop(m) for m in list(per_mode) if m.startswith(arms.TREE_PREFIX)}
    main = arms.main_variants(_list(modes, str, "--modes"), _list(seeds, int, "--seeds"),
                             arms.parse_assignments(set_, "--set"), per_mode) if modes else []
    trees = arms.tree_variants(_list(tree_modes, str, "--tree-modes"), _list(seeds, int, "--seeds"),
                               arms.parse_assignments(set_, "--set"), per_tree) if tree_modes else []
    if per_tree and not tree_modes:
        raise ConfigError(f"--mode-set {next(iter(per_tree))}: no --tree-modes to apply it to")
    variants = [*main, *trees]
    if not variants:
        raise ConfigError("--modes and --tree-modes are both empty: nothing to train")
    if lr_sweep:
        variants += arms.lr_sweep_variants(main, _list(lr_sweep, float, "--lr-sweep"),
                                          _list(sweep_seeds, int, "--sweep-seeds"))
    if ablations:
        names = list(arms.ABLATIONS) if ablations == "all" else _list(ablations, str, "--ablations")
        reference = next((v for v in main if v.mode == "tp"), None)
        if reference is None:
            raise ConfigError("--ablations: they vary tp: add tp to --modes")
        variants += arms.ablation_variants(reference, names, _list(ablation_seeds, int, "--ablation-seeds"))
    return variants


@app.command("run")
def run_command(
    out: OutOpt = Path("runs/compare"),
    base: Annotated[Path, typer.Option("--base", help="project folder with params.yaml, the model and "
                                       "prompts")] = Path("."),
    modes: Annotated[str, typer.Option(help="credit modes, comma-separated")] = ",".join(MODES),
    seeds: Annotated[str, typer.Option(help="training seeds (train.seed), comma-separated")] = "0,1,2",
    iterations: Annotated[int, typer.Option(help="iteration budget of every run (train.iterations)")] = 12,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="params override for every run, "
                                                      "section.key=value (repeatable)")] = None,
    mode_set: Annotated[Optional[list[str]], typer.Option("--mode-set", help="override for one arm, "
                                                          "MODE:section.key=value or tree-MODE:... (repeatable)")] = None,
    lr_sweep: Annotated[str, typer.Option(help="extra update.lr values per mode, comma-separated")] = "",
    sweep_seeds: Annotated[str, typer.Option(help="training seeds of the lr sweep")] = "0,1,2",
    ablations: Annotated[str, typer.Option(help="paper ablations of tp: all or some of noise0.4,noise1.0,"
                                           "window8,window4,cps")] = "",
    ablation_seeds: Annotated[str, typer.Option(help="training seeds of the ablations")] = "0",
    tree_modes: Annotated[str, typer.Option(help="credit modes also trained on ODE-anchored trees "
                                            "(tree.enabled=true), as arms tree-MODE, comma-separated")] = "",
    jobs: JobsOpt = 2,
    threads: ThreadsOpt = 1,
    refresh_code: Annotated[bool, typer.Option(help="snapshot stages/ and tpgrpo/ again (DVC then re-runs "
                                               "what the code change touches)")] = False,
    dry_run: Annotated[bool, typer.Option(help="check and list the runs, create nothing")] = False,
) -> None:
    """Create the run folders (checked first, all or nothing) and train every run not yet done."""
    import yaml

    from tpgrpo.comparison import runs as cmp
    from tpgrpo.comparison.archive import refuse_archive
    from tpgrpo.config import ConfigError, config_from_dict
    from tpgrpo.errors import PipelineError

    try:
        params_path = base / "params.yaml"
        if not params_path.is_file():
            raise ConfigError(f"--base {base}: no params.yaml there (expected a project folder)")
        base_params = yaml.safe_load(params_path.read_text())
        config_from_dict(base_params)
        refuse_archive(out)
        variants = _variants(modes, seeds, set_ or [], mode_set or [], lr_sweep, sweep_seeds, ablations,
                             ablation_seeds, tree_modes)
        specs = cmp.plan(out.resolve(), variants)
        for spec in specs:  # all checked before anything is written
            cmp.check_run(spec, base_params, iterations, base.resolve())
        if dry_run:
            for spec in specs:
                state, done, planned = cmp.run_state(spec.folder)
                typer.echo(f"{spec.variant.name}/seed{spec.seed}: {state} ({done}/{max(planned, iterations)} "
                           f"iterations) -> {spec.folder}")
            return
        out.mkdir(parents=True, exist_ok=True)
        code = cmp.snapshot_code(out.resolve(), Path(cmp.__file__).resolve().parents[2], refresh=refresh_code)
        cmp.record_command(out, _command_line())
        for spec in specs:
            cmp.prepare_run(spec, base.resolve(), base_params, code, iterations, refresh_code=refresh_code)
        results = cmp.launch(specs, jobs, threads, echo=typer.echo)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    _report_results(results)


@app.command("equal-wall")
def equal_wall_command(
    out: OutOpt = Path("runs/compare"),
    reference: Annotated[str, typer.Option(help="the expensive variant whose time is matched")] = "tp",
    target: Annotated[str, typer.Option(help="the cheap variant given more iterations")] = "flow_grpo",
    jobs: JobsOpt = 2,
    threads: ThreadsOpt = 1,
) -> None:
    """Second pass: raise the target's train.iterations to match the reference's training time, train."""
    from tpgrpo.comparison import runs as cmp
    from tpgrpo.comparison.archive import refuse_archive
    from tpgrpo.config import ConfigError
    from tpgrpo.errors import PipelineError

    try:
        refuse_archive(out)
        record, specs = cmp.equal_wall_plan(out, reference, target)
        cmp.record_command(out, _command_line())
        typer.echo(f"{target}: {record['iterations']} iterations ({reference} {record['reference_s_per_iter']} s "
                   f"per iteration, {target} {record['target_s_per_iter']} s)")
        results = cmp.launch(specs, jobs, threads, echo=typer.echo)
    except (ConfigError, PipelineError) as exc:
        _fail(str(exc))
    _report_results(results)


@app.command("load-cost")
def load_cost_command(
    out: OutOpt = Path("runs/compare"),
    run: Annotated[str, typer.Option(help="run folder under OUT to measure in, VARIANT/seedK")] = "tp/seed0",
    iterations: Annotated[str, typer.Option(help="iterations whose policy is loaded, comma-separated")] = "2,6,12",
    repeats: Annotated[int, typer.Option(help="timed loads per iteration and kind")] = 3,
    threads: ThreadsOpt = 1,
) -> None:
    """Time one model load (load_policy) in a trained run folder; write OUT/load_cost.json (the report then
    gives the equal-wall pair with the loading taken out of both sides' seconds)."""
    import json

    from tpgrpo.comparison.archive import refuse_archive
    from tpgrpo.comparison.loadcost import LOAD_FILE, measure
    from tpgrpo.errors import PipelineError
    from tpgrpo.io.artifacts import atomic_path

    try:
        refuse_archive(out)
        folder = out / run
        if not (folder / "params.yaml").is_file():
            raise PipelineError(f"--run {run}: no run folder {folder} (expected VARIANT/seedK under --out)")
        record = measure(folder, _list(iterations, int, "--iterations"), repeats, threads)
        with atomic_path(out / LOAD_FILE) as tmp:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    except PipelineError as exc:
        _fail(str(exc))
    typer.echo(f"{out / LOAD_FILE}: {record['load_seconds']} s per load (median of {record['loads_timed']})")


@app.command("status")
def status_command(out: OutOpt = Path("runs/compare")) -> None:
    """One line per run: done / partial / new and its iterations."""
    from tpgrpo.comparison import runs as cmp

    runs = cmp.discover(out)
    if not runs:
        _fail(f"{out}: no run folders (*/seed*/run.json)")
    from tpgrpo.comparison.archive import archived_iterations, is_archive

    archive = is_archive(out)
    for r in runs:
        state, done, planned = cmp.run_state(Path(r["folder"]))
        if archive:  # no policies kept: run_state would call every run new
            state, done = "archived", archived_iterations(Path(r["folder"]))
            planned = int(r["params"]["train"]["iterations"])
        typer.echo(f"{r['variant']}/seed{r['seed']}: {state} ({done}/{planned} iterations)")


@app.command("report")
def report_command(
    results: Annotated[list[Path], typer.Option("--results", help="comparison root (repeatable)")],
    out: Annotated[Path, typer.Option("--out", help="Markdown file; figures go to the folder of its name")] =
        Path("results/report.md"),
    n_boot: Annotated[int, typer.Option(help="bootstrap resamples")] = 10_000,
) -> None:
    """Collect each root's stored results (OUT/results/*.csv) and write the report and its figures."""
    from tpgrpo.comparison.report import write_report
    from tpgrpo.errors import PipelineError

    import shlex

    try:
        path = write_report(results, out, command=" ".join(shlex.quote(a) for a in _command_line()), n_boot=n_boot)
    except (PipelineError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(str(path))


@app.command("page")
def page_command(
    results: Annotated[list[Path], typer.Option("--results", help="compact archive (repeatable)")],
    out: Annotated[Path, typer.Option("--out", help="the page; figures go to figures/ beside it")] =
        Path("results/README.md"),
    n_boot: Annotated[int, typer.Option(help="bootstrap resamples")] = 10_000,
) -> None:
    """Write one page with every archive's verdicts, runs and figures (without their command lines)."""
    import shlex

    from tpgrpo.comparison.page import write_page
    from tpgrpo.errors import PipelineError

    try:
        path = write_page(results, out, command=" ".join(shlex.quote(a) for a in _command_line()), n_boot=n_boot)
    except (PipelineError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(str(path))


@app.command("archive")
def archive_command(
    results: Annotated[Path, typer.Option("--results", help="comparison root to archive")],
    to: Annotated[Path, typer.Option("--to", help="archive folder (replaced whole), e.g. results/NAME")],
    add: Annotated[bool, typer.Option("--add", help="add the root's runs (more seeds, same params) to the existing "
                                      "archive TO instead of replacing it")] = False,
    accept: Annotated[str, typer.Option("--accept", help="with --add: the reason to add runs whose machine or "
                                        "numeric code differs from the archived runs', or is not recorded "
                                        "(refused without it; the report shows it)")] = "",
) -> None:
    """Keep the root's results as a compact archive TO: runs.parquet (every stage log, run.json, params.yaml,
    machine and code records, per run and iteration) and evals.parquet (every per-image eval row), beside
    commands.txt, equal_wall.json, load_cost.json and the code snapshot's record; checked to read back
    unchanged before TO is replaced. `report --results TO` gives the same report without the run folders. A
    root that is an archive in the older per-file layout is converted."""
    from tpgrpo.comparison.archive import add_to_archive, write_archive
    from tpgrpo.errors import PipelineError

    try:
        record = add_to_archive(results, to, accept) if add else write_archive(results, to)
    except PipelineError as exc:
        _fail(str(exc))
    typer.echo(f"{to}: {record['runs']} runs, {record['files']} files, {record['bytes'] / 1e6:.2f} MB")


if __name__ == "__main__":  # pragma: no cover
    app()
