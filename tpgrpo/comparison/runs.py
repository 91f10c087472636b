"""Run credit modes side by side: one ``tpgrpo run`` project folder per (variant, training seed).

Layout under the output root ``OUT``::

    OUT/code/                 stages/ and tpgrpo/ as they were when the comparison started (SNAPSHOT.json:
                              the repository's path relative to OUT, its git commit and the files that
                              differed from it); every run executes this copy
                              (PYTHONPATH), so code edited mid-comparison cannot split the runs
    OUT/<variant>/seed<k>/    a project `tpgrpo run` accepts: params.yaml (the base project's params, the
                              variant's overrides, credit.mode, train.seed), run.json (variant, mode, seed,
                              overrides, iteration budget), data/base and prompt files (hard links), the code
                              (hard links to OUT/code), run.log (every attempt appended)
    OUT/equal_wall.json       the equal-wall-clock passes, one record per (reference, target): measured seconds per
                              iteration, iterations given
    OUT/commands.txt          the command lines that built OUT (the report quotes them)

A variant is a credit mode plus param overrides (``tp``, ``tp-noise0.4``, ``flow_grpo-lr3e-4``). Resuming is
DVC's: a run whose summary is newer than all its iteration files is skipped, any other is handed to
``tpgrpo run`` again, which redoes only the stages whose outputs are missing or stale.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from tpgrpo.io.artifacts import atomic_path
from tpgrpo.comparison.store import stage_seconds  # noqa: F401 - read here by results, studies and tests
from tpgrpo.comparison.variants import BASELINE_MODE, RunSpec, Variant
from tpgrpo.config import ConfigError, config_from_dict, param_fields
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.status import dvc_up_to_date
from tpgrpo.stage_params import BASELINE_LOG, COMPARE, DONE, TREE_SHAPE, outputs_read_by

CODE_DIRS = ("stages", "tpgrpo")
# What makes an iteration finished (the logs tpgrpo.pipeline.status reads: not probe.json, which flow_grpo runs
# made before its model-free probe stage do not have) and the eval table the curves read.
ITER_FILES = outputs_read_by(DONE, COMPARE)
TRAIN_STAGES = ("rollout", "probe", "credit", "update")  # the training cost; eval is measurement, not training
SUMMARY = Path("data") / "metrics" / "summary.json"
# Keys a run folder may differ in from a re-planned comparison: the equal-wall pass raises train.iterations.
MUTABLE_KEYS = {"train.iterations"}
# Keys that change how a run executes or what it keeps, not what it computes: the knobs of tpgrpo.config but the
# placement ones (tests/test_knobs.py, test_stage_server.py, test_sealing.py: the same bytes). An existing folder
# keeps its own value, or its lack of the key (it may predate the key, and so may the code it was made with).
NEUTRAL_KEYS = {key for key, f in param_fields().items() if f.metadata["knob"] not in ("", "placement")}


def flatten(raw: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (params.yaml's two levels; deeper values stay whole)."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict) and not prefix:
            out.update(flatten(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def apply_overrides(base: dict, settings: dict[str, Any], what: str) -> dict:
    """A deep copy of the params mapping ``base`` with ``{"section.key": value}`` set; a key params.yaml does
    not have is a one-line ConfigError that starts with ``what``."""
    raw = json.loads(json.dumps(base))  # deep copy
    for dotted, value in settings.items():
        section, _, key = dotted.partition(".")
        if section not in raw or not isinstance(raw[section], dict) or key not in raw[section]:
            raise ConfigError(f"{what}: override {dotted!r}: no such key in params.yaml")
        raw[section][key] = value
    return raw


def run_params(base: dict, variant: Variant, seed: int, iterations: int) -> dict:
    """The run's params.yaml mapping: ``base`` with the overrides, credit.mode, train.seed and
    train.iterations set; validated (a bad override is a one-line ConfigError naming the variant). An arm
    that does not switch the tree on samples chains, whatever the base's default rollout."""
    settings = {"tree.enabled": False, **variant.overrides, "credit.mode": variant.mode, "train.seed": seed,
                "train.iterations": iterations}
    raw = apply_overrides(base, settings, f"variant {variant.name}")
    try:
        config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"variant {variant.name}: {exc}") from None
    return raw


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a file or folder as hard links (no extra disk), falling back to copies across file systems."""
    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        link(src, dst)


def snapshot_code(out: Path, repo: Path, refresh: bool = False) -> Path:
    """``OUT/code``: stages/ and tpgrpo/ copied from ``repo`` once (again with ``refresh``), with
    SNAPSHOT.json naming the git commit and the files that differed from it."""
    code = out / "code"
    if code.is_dir() and not refresh:
        return code
    tmp = out / ".code.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name in CODE_DIRS:
        shutil.copytree(repo / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True).stdout.strip()  # noqa: E731
    (tmp / "SNAPSHOT.json").write_text(json.dumps({  # source: the repository relative to OUT (no machine path)
        "source": os.path.relpath(repo.resolve(), out.resolve()), "commit": git("rev-parse", "HEAD"), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "changed_files": git("status", "--porcelain", "--", *CODE_DIRS).splitlines()}, indent=2) + "\n")
    shutil.rmtree(code, ignore_errors=True)
    tmp.replace(code)
    return code


def data_paths(raw: dict) -> list[str]:
    """The project-relative inputs a run needs besides code: the model, the prompt files, local reward
    model folders and an accelerate config file (absolute paths are used in place)."""
    from tpgrpo.tasks.rewards import reward_folders

    cfg = config_from_dict(raw)
    paths = [cfg.model.path, cfg.task.train_prompts, cfg.task.eval_prompts, cfg.launch.config_file,
             *reward_folders(cfg.task.reward, cfg), *reward_folders(cfg.task.eval_reward, cfg)]
    return [p for p in dict.fromkeys(paths) if p and not Path(p).is_absolute()]


def _check_same_run(spec: RunSpec, params: dict) -> None:
    """A folder made for another run or other params is an error (a different comparison: another OUT)."""
    meta_path, params_path = spec.folder / "run.json", spec.folder / "params.yaml"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if (meta.get("mode"), meta.get("seed")) != (spec.variant.mode, spec.seed):
            raise PipelineError(f"{meta_path}: holds mode {meta.get('mode')} seed {meta.get('seed')}, expected "
                                f"{spec.variant.mode} seed {spec.seed} (use another output folder)")
    if params_path.is_file():
        old, new = flatten(yaml.safe_load(params_path.read_text())), flatten(params)
        for key in sorted(set(old) | set(new)):
            if key not in MUTABLE_KEYS and old.get(key) != new.get(key):
                raise PipelineError(f"{params_path}: {key} is {old.get(key)!r} there but this comparison sets "
                                    f"{new.get(key)!r} (a different comparison: use another output folder)")


def _existing_params(folder: Path) -> dict:
    path = folder / "params.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def _keep_neutral(params: dict, old: dict) -> dict:
    """``params`` with an existing folder's own values (or lack) of :data:`NEUTRAL_KEYS`, and of the tree's
    shape where both sample chains (inert there: it may be another default's); as is if new."""
    out = json.loads(json.dumps(params))
    chains = all(p.get("tree", {}).get("enabled") is False for p in (params, old))
    kept = NEUTRAL_KEYS | (set(TREE_SHAPE) if chains else set())
    for section, _, key in (k.partition(".") for k in kept if old):
        if key in old.get(section, {}):
            out[section][key] = old[section][key]
        else:
            out[section].pop(key, None)
    return out


def check_run(spec: RunSpec, base_params: dict, budget: int, base_root: Path | None = None) -> dict:
    """The run's params (train.iterations = max(budget, what the folder has: the equal-wall pass may have
    raised it)), checked against the folder if it exists and, with ``base_root``, that its data exist.
    Writes nothing."""
    old = _existing_params(spec.folder)
    params = run_params(base_params, spec.variant, spec.seed, max(budget, old["train"]["iterations"] if old else 0))
    _check_same_run(spec, _keep_neutral(params, old))
    for rel in data_paths(params) if base_root is not None else ():
        if not (spec.folder / rel).exists() and not (base_root / rel).exists():
            raise PipelineError(f"{base_root / rel}: missing (named in {base_root / 'params.yaml'})")
    return params


def prepare_run(spec: RunSpec, base_root: Path, base_params: dict, code: Path, budget: int,
                refresh_code: bool = False) -> None:
    """Create or complete the run folder: params.yaml, run.json, data and code as hard links. Idempotent.
    ``refresh_code``: link the (re-snapshotted) code again in an existing folder not yet done."""
    folder = spec.folder
    params = check_run(spec, base_params, budget, base_root)
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(_keep_neutral(params, _existing_params(folder)), sort_keys=False)
    if not (folder / "params.yaml").is_file() or (folder / "params.yaml").read_text() != text:
        (folder / "params.yaml").write_text(text)
    for rel in data_paths(params):
        if not (folder / rel).exists():
            _link_tree(base_root / rel, folder / rel)
    refresh_code = refresh_code and run_state(folder)[0] != "done"  # a finished run keeps the code that made it
    for name in CODE_DIRS:
        if refresh_code and (folder / name).exists():
            shutil.rmtree(folder / name)  # hard links to the old snapshot's files
        if not (folder / name).exists():
            _link_tree(code / name, folder / name)
    v = spec.variant
    meta = {"variant": v.name, "mode": v.mode, "seed": spec.seed, "family": v.family, "reference": v.reference,
            "overrides": v.overrides, "budget": budget}
    (folder / "run.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def plan(out: Path, variants: Sequence[Variant]) -> list[RunSpec]:
    """The runs in launch order: seed by seed, main variants first, so a partial comparison has every
    mode of its first seeds."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"variant names repeat: {names}")
    order = {"main": 0, "lr_sweep": 1, "ablation": 2}
    specs = [RunSpec(v, s, out / v.name / f"seed{s}") for v in variants for s in v.seeds]
    return sorted(specs, key=lambda r: (order.get(r.variant.family, 3), r.seed))


def run_state(folder: Path) -> tuple[str, int, int]:
    """``(state, iterations done, iterations planned)``; state is ``done`` (summary.json covers the planned
    iterations and is newer than every iteration file or, where a log was written again after it with the
    same bytes, which re-runs nothing, DVC finds the folder up to date), ``partial`` or ``new``."""
    params = folder / "params.yaml"
    planned = int(yaml.safe_load(params.read_text())["train"]["iterations"]) if params.is_file() else 0
    done, newest = 0, 0.0
    for i in range(1, planned + 1):
        logs = [folder / "data" / "iters" / f"{i:04d}" / f for f in ITER_FILES]
        if not all(f.exists() for f in [*logs, logs[0].parent / "policy"]):
            break
        done, newest = i, max([newest, *(f.stat().st_mtime for f in logs)])  # logs: policy/ is relinked later
    summary = folder / SUMMARY
    if done == planned > 0 and summary.is_file() and json.loads(summary.read_text()).get("iterations") == planned:
        if summary.stat().st_mtime >= newest or dvc_up_to_date(folder):
            return "done", done, planned
    started = done > 0 or (folder / BASELINE_LOG).is_file()
    return ("partial" if started else "new"), done, planned


def run_env(folder: Path, threads: int) -> dict[str, str]:
    """The environment of one run: its own code first on PYTHONPATH (absolute: its processes start in the
    folder), ``threads`` BLAS/OpenMP threads, no bytecode files inside the code DVC hashes, no DVC analytics."""
    env = dict(os.environ, PYTHONPATH=str(Path(folder).resolve()), PYTHONDONTWRITEBYTECODE="1", DVC_NO_ANALYTICS="1",
               DVC_STUDIO_OFFLINE="true", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY="PASSIVE")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_one(spec: RunSpec, threads: int) -> tuple[int, float]:
    """``tpgrpo run`` in the run folder, output appended to its run.log and the machine to its machine.json
    (:mod:`tpgrpo.comparison.provenance`); returns (exit code, seconds)."""
    from tpgrpo.comparison.provenance import append_machine, machine_record

    start = time.time()
    append_machine(spec.folder, machine_record(threads))  # before it trains: a killed attempt counts too
    with open(spec.folder / "run.log", "a") as log:
        log.write(f"=== tpgrpo run {time.strftime('%Y-%m-%d %H:%M:%S')} threads={threads}\n")
        log.flush()
        code = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=spec.folder,
                              env=run_env(spec.folder, threads), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
        log.write(f"=== exit {code} after {time.time() - start:.0f} s\n")
    return code, time.time() - start


def launch(specs: Sequence[RunSpec], jobs: int, threads: int, echo: Callable[[str], None] = print) -> dict[str, str]:
    """Run every spec not yet done, ``jobs`` at a time; returns ``{folder: done | skipped | failed (exit N)}``."""
    if jobs < 1 or threads < 1:
        raise ConfigError(f"jobs = {jobs}, threads = {threads}: expected both >= 1")
    todo = [s for s in specs if run_state(s.folder)[0] != "done"]
    results = {str(s.folder): "skipped (done)" for s in specs if s not in todo}
    for s in specs:
        if s not in todo:
            echo(f"skip {s.variant.name}/seed{s.seed}: done")

    def work(spec: RunSpec) -> None:
        state, done, planned = run_state(spec.folder)
        echo(f"start {spec.variant.name}/seed{spec.seed} ({state}, {done}/{planned} iterations)")
        code, seconds = run_one(spec, threads)
        results[str(spec.folder)] = "done" if code == 0 else f"failed (exit {code}, see {spec.folder / 'run.log'})"
        echo(f"{'done' if code == 0 else 'FAILED'} {spec.variant.name}/seed{spec.seed} in {seconds:.0f} s")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))
    return results


def record_command(out: Path, argv: Sequence[str]) -> None:
    """Append the command line to OUT/commands.txt (once per distinct line): the report quotes it."""
    import shlex

    line = " ".join(shlex.quote(a) for a in argv)
    path = out / "commands.txt"
    lines = path.read_text().splitlines() if path.is_file() else []
    if line not in lines:
        path.write_text("\n".join([*lines, line]) + "\n")


def discover(out: Path) -> list[dict]:
    """Every run folder under OUT (``*/seed*/run.json``; OUT may be a compact archive,
    :mod:`tpgrpo.comparison.store`): its run.json plus ``folder`` and ``params``."""
    from tpgrpo.comparison import store

    runs = []
    for meta_path in store.run_files(out):
        meta = store.read_json(meta_path)
        params = yaml.safe_load(store.read_text(meta_path.parent / "params.yaml"))
        runs.append({**meta, "folder": meta_path.parent, "params": params})
    return runs


def train_seconds(folder: Path, iterations: int) -> list[float]:
    """Training wall seconds of iterations 1..``iterations`` (rollout + probe + credit + update, as the
    stages measured them; eval is left out: it measures, it does not train)."""
    iters = Path(folder) / "data" / "iters"
    return [sum(stage_seconds(iters / f"{i:04d}", s) for s in TRAIN_STAGES) for i in range(1, iterations + 1)]


def equal_wall_iterations(ref_seconds: Sequence[float], target_seconds: Sequence[float], budget: int,
                          every: int) -> int:
    """Iterations the target (cheaper) mode gets in the reference's time: ``budget`` x (mean reference
    seconds per iteration / mean target seconds per iteration), rounded UP to a multiple of ``every`` so
    its last iteration is evaluated (the rounding favours the target, i.e. the baseline). At least ``budget``."""
    if every < 1:
        raise ConfigError("eval.every = 0: the equal-wall pass needs evaluated iterations (eval.every >= 1)")
    if not ref_seconds or not target_seconds or min(*ref_seconds, *target_seconds) <= 0:
        raise PipelineError("equal wall clock: no positive per-iteration seconds measured (finish the runs first)")
    ratio = (sum(ref_seconds) / len(ref_seconds)) / (sum(target_seconds) / len(target_seconds))
    return max(budget, every * math.ceil(budget * ratio / every - 1e-9))


def spec_of(run: dict) -> RunSpec:
    """The RunSpec of a discovered run folder."""
    variant = Variant(run["variant"], run["mode"], run.get("overrides", {}), (run["seed"],),
                      run.get("family", "main"), run.get("reference", ""))
    return RunSpec(variant, run["seed"], Path(run["folder"]))


def equal_wall_plan(out: Path, reference: str = "tp", target: str = BASELINE_MODE) -> tuple[dict, list[RunSpec]]:
    """Raise ``target``'s runs to the iterations its cheaper iteration buys in ``reference``'s time.

    Reads the finished runs' measured training seconds over iterations 1..budget (all seeds pooled),
    writes OUT/equal_wall.json and each target run's params.yaml (train.iterations), and returns the plan
    and the target runs to launch. Unfinished runs are a one-line error.
    """
    runs = discover(out)
    sides = {name: [r for r in runs if r["variant"] == name] for name in (reference, target)}
    seconds = {}
    for name, group in sides.items():
        if not group:
            raise PipelineError(f"equal wall clock: no runs of variant {name!r} under {out}")
        budget = group[0]["budget"]
        for r in group:
            state, done, _ = run_state(r["folder"])
            if done < r["budget"]:
                raise PipelineError(f"equal wall clock: {r['folder']} has {done} of {r['budget']} iterations "
                                    "(finish the comparison first)")
        seconds[name] = [s for r in group for s in train_seconds(r["folder"], budget)]
    # the reference's own budget is what is matched (it may have been given a longer one than the target's)
    budget, target_budget = sides[reference][0]["budget"], sides[target][0]["budget"]
    every = int(sides[target][0]["params"]["eval"]["every"])
    iterations = max(target_budget, equal_wall_iterations(seconds[reference], seconds[target], budget, every))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    record = {"reference": reference, "target": target, "budget": budget, "target_budget": target_budget,
              "iterations": iterations, "reference_s_per_iter": round(mean(seconds[reference]), 2),
              "target_s_per_iter": round(mean(seconds[target]), 2),
              "ratio": round(mean(seconds[reference]) / mean(seconds[target]), 3)}
    specs = []
    for r in sides[target]:
        path = Path(r["folder"]) / "params.yaml"
        params = yaml.safe_load(path.read_text())
        if params["train"]["iterations"] < iterations:
            params["train"]["iterations"] = iterations
            path.write_text(yaml.safe_dump(params, sort_keys=False))
        specs.append(spec_of(r))
    # one record per (reference, target): a tree arm is given the iterations flow_grpo's time buys and, in a
    # second pass, those chain tp's time buys (its params keep the larger)
    others = [r for r in equal_wall_records(out) if (r.get("reference"), r["target"]) != (reference, target)]
    with atomic_path(out / "equal_wall.json") as tmp:
        tmp.write_text(json.dumps([*others, record], indent=2, sort_keys=True) + "\n")
    return record, specs


def equal_wall_records(out: Path) -> list[dict]:
    """The equal-wall passes recorded under OUT, one per (reference, target) (an older single record is read
    as a list of one); [] without a pass."""
    path = Path(out) / "equal_wall.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return [data] if isinstance(data, dict) else list(data)
