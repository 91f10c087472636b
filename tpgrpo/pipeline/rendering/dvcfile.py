"""Render ``dvc.yaml`` from ``params.yaml``: the four stages (plus eval) once per iteration.

DVC's ``foreach`` cannot do arithmetic (iteration i needs iteration i - 1's policy), so the iteration
list is written out here; ``tpgrpo run`` re-renders it before ``dvc repro``, so raising
``train.iterations`` adds stages and DVC runs only the new ones. Each stage lists exactly the params it
reads (a test checks this against the code) and its code, through its kind's manifest written by the
``code`` stage (:mod:`tpgrpo.pipeline.rendering.code_manifest`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tpgrpo.pipeline.long_runs.block_logs import digest_path
from tpgrpo.pipeline.rendering.code_manifest import code_deps, code_stage
from tpgrpo.config import Config, ConfigError
from tpgrpo.reports import figure_names  # not .figures: it imports stage_common, which imports this
from tpgrpo.pipeline.long_runs.blocks import Block, full_blocks, seal_files, sealed_outs, write_text_atomic
from tpgrpo.stage_params import (EVAL_CURVE, EVAL_EMBEDS, GLANCE, MULTI_PROCESS_STAGES, REWARD_PARAMS,  # noqa: F401
                                 STAGE_LOGS, ITERATION_STAGES, PATH_SWITCHES, RUN_STAGES, STAGE_PARAMS,  # re-exported
                                 TRAIN_CURVE, RunOutput, RunStage, stage_inputs)

HEADER = ("# Generated from params.yaml by `tpgrpo dvc-yaml` (`tpgrpo run` does it before `dvc repro`).\n"
          "# Edit params.yaml, not this file.\n")


def iterations(cfg: Config) -> range:
    """The run's iterations, 1..train.iterations: iteration i samples from policy i - 1 (policy 0 is the base
    model) and its update writes policy i."""
    return range(1, cfg.train.iterations + 1)


def _iter_dir(i: int) -> str:
    return f"data/iters/{i:04d}"


def reward_folders(cfg: Config, *specs) -> list[str]:
    """The configured local reward-model folders the given reward specs load."""
    from tpgrpo.tasks.rewards import reward_folders as folders_of

    return list(dict.fromkeys(f for spec in specs for f in folders_of(spec, cfg)))


# The deps from outside an iteration's folder that tpgrpo.stage_params.ITERATION_STAGES and RUN_STAGES name,
# each the paths it stands for under a config.
EXTERNAL = {
    "scorers": lambda cfg: reward_folders(cfg, cfg.task.reward),  # the training reward's model folders
    "eval_scorers": lambda cfg: reward_folders(cfg, cfg.task.reward, cfg.task.eval_reward),
    "model": lambda cfg: [cfg.model.path],
    "train_prompts": lambda cfg: [cfg.task.train_prompts],
    "eval_prompts": lambda cfg: [cfg.task.eval_prompts],
    "eval_embeds": lambda cfg: [EVAL_EMBEDS],
}


def _uncached(path: str) -> dict:
    """A small output kept in git rather than in DVC's cache (tables and figures users read)."""
    return {path: {"cache": False}}


# `dvc plots show`: named charts with chosen axes (top-level `plots:` in dvc.yaml).
PLOTS = [
    {"held_out_reward": {"title": "Held-out reward (eval reward, ODE at eval.num_steps)", "x": "iteration",
                         "y": {EVAL_CURVE: ["eval_reward"]}, "x_label": "iteration (0 = base model)",
                         "y_label": "reward"}},
    {"held_out_strict_accuracy": {"title": "Held-out strict accuracy", "x": "iteration",
                                  "y": {EVAL_CURVE: ["strict_accuracy"]}, "x_label": "iteration (0 = base model)",
                                  "y_label": "strict accuracy"}},
    {"train_reward": {"title": "Training reward of the rollout (policy i-1's samples)", "x": "iteration",
                      "y": {TRAIN_CURVE: ["train_reward"]}, "y_label": "reward"}},
    {"turning_point_rate": {"title": "Turning-point rate (share of window steps)", "x": "iteration",
                            "y": {TRAIN_CURVE: ["turning_point_rate"]}, "y_label": "rate"}},
    {"approx_kl": {"title": "Approx KL of the update (last pass)", "x": "iteration",
                   "y": {TRAIN_CURVE: ["approx_kl_after"]}, "y_label": "approx KL"}},
]


def stage_command(cfg: Config, name: str, iteration: int | None = None) -> str:  # noqa: ARG001 - cfg: the API
    """The shell command of one stage: ``tpgrpo stage NAME --iter I``, whatever the ``launch`` params: a model
    stage starts the processes they ask for itself (:mod:`tpgrpo.pipeline.execution.launch`), so changing the process
    count or the launcher changes no stage."""
    return "tpgrpo stage " + name + ("" if iteration is None else f" --iter {iteration}")


def iteration_stages(cfg: Config, i: int) -> dict[str, dict]:
    """The rollout, probe, credit, update and eval stages of iteration ``i``; each depends on its kind's
    code manifest."""
    d = _iter_dir(i)
    # A stage's JSON log is an output (small; eval's uncached like its table): DVC's run cache, which restores
    # a stage it has seen with these deps and params instead of running it, restores the log with the tables
    # (it kept the last real run's log before, which the summary read), and a stage re-run by hand with other
    # params is re-run by DVC (its log changed) even when its table came out the same. A stage re-run by hand
    # with the same params writes the same log bytes: its seconds and process count go to an untracked
    # sidecar (tpgrpo.io.stage_logs), so DVC sees nothing changed.
    # Every credit mode has the same stages, so that `dvc exp run -S credit.mode=...` runs what `tpgrpo run`
    # renders: Flow-GRPO's probe loads no model and writes Q_k = R_fin from the rollout (stages/probe.py). The
    # probe does not list credit.mode: its manifest records whether the mode is flow_grpo.
    stages: dict[str, dict] = {}
    for stage in ITERATION_STAGES:
        previous = [f"{_iter_dir(i - 1)}/policy"] if stage.previous_policy and i > 1 else []  # 0: the base model
        deps = [*code_deps(stage.name), *(p for name in stage.external for p in EXTERNAL[name](cfg)),
                *(f"{d}/{name}" for name in stage.inputs), *previous]
        outs = [f"{d}/{out.name}" if out.cached else _uncached(f"{d}/{out.name}") for out in stage.outputs]
        stages[f"{stage.name}-{i:04d}"] = {"cmd": stage_command(cfg, stage.name, i),
                                           "params": stage_inputs(stage.name, cfg), "deps": deps,
                                           "outs": outs}
    return stages  # in pipeline order


def _out_path(out) -> str:
    return next(iter(out)) if isinstance(out, dict) else out


def _covered(key: str, keys: list[str]) -> bool:
    return any(key.startswith(k + ".") for k in keys)


def block_stage(cfg: Config, block: Block, outs: list[str] | None = None) -> dict:
    """One stage for a sealed block: the union of its iterations' params and of their deps from outside
    the block, the block's artifacts (only ``outs`` when given: what retention kept) as outputs, and a
    command that re-runs the block's stages in order (``tpgrpo block``)."""
    inner = [st for i in block.iterations for st in iteration_stages(cfg, i).values()]
    produced = {_out_path(o) for st in inner for o in st["outs"]}
    params = list(dict.fromkeys(p for st in inner for p in st["params"]))
    deps = dict.fromkeys(d for st in inner for d in st["deps"] if d not in produced)
    all_outs = {_out_path(o): o for st in inner for o in st["outs"]}  # path -> entry, dvc.yaml order
    kept = set(produced if outs is None else outs)
    digest = _uncached(digest_path(block))  # the logs the summary reads (tpgrpo.pipeline.long_runs.block_logs)
    return {"cmd": f"tpgrpo block --first {block.first} --last {block.last}",
            "params": [p for p in params if not _covered(p, params)], "deps": list(deps),
            "outs": [*[o for path, o in all_outs.items() if path in kept], digest]}


def block_out_paths(cfg: Config, block: Block) -> list[str]:
    """Every artifact path the block's stages write, in dvc.yaml order."""
    return [_out_path(o) for o in block_stage(cfg, block)["outs"]]


def _refuse_misfit_seals(cfg: Config, root: Path, last: int) -> None:
    """A sealed block inside iterations 1..last that is not a full block of this run (train.iterations lowered
    into it, another train.block_size) would render as stages without lock entries, which DVC re-runs:
    ``tpgrpo run`` unseals such a block first (its entries come back); anything else rendering stops here."""
    full = set(full_blocks(cfg.train.block_size, cfg.train.iterations))
    for block, path in seal_files(root).items():
        if block.first <= last and block not in full:
            raise ConfigError(f"params: train.iterations = {cfg.train.iterations} / train.block_size = "
                              f"{cfg.train.block_size} do not fit sealed block {block.name} ({path.relative_to(root)}): "
                              "run `tpgrpo run`, which unseals it first")


def render(cfg: Config, root: Path | None = None, upto: int | None = None) -> dict:
    """The whole ``dvc.yaml`` as a mapping; blocks sealed under ``root`` are left out: each is one stage in its
    own pipeline file (:func:`write_block_dvcfile`), which DVC collects with this one. With
    ``upto`` < train.iterations: only iterations 1..upto and no summary (``tpgrpo run`` trains block by
    block, sealing each before the next, so that DVC's dvc.lock, rewritten after every stage, stays small)."""
    last = cfg.train.iterations if upto is None else upto
    stages: dict[str, dict] = {"code": code_stage()}
    stages.update({stage.name: run_stage_entry(cfg, stage) for stage in RUN_STAGES
                   if not stage.after_iterations})  # the held-out prompts' embeddings, the baseline
    blocks = [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b.last <= last]
    if root:
        _refuse_misfit_seals(cfg, root, last)
    sealed = sealed_outs(root, blocks) if root else {}
    in_sealed = {i for block in sealed for i in block.iterations}  # each in its own pipeline file (block_dvcfile)
    open_iters = [i for i in iterations(cfg) if i not in in_sealed and i <= last]
    for i in open_iters:
        stages.update(iteration_stages(cfg, i))
    if last == cfg.train.iterations:
        stages["summary"] = summary_stage(cfg, open_iters, list(sealed))
    return {"stages": stages, "plots": PLOTS}


def _run_output(out: RunOutput) -> str | dict:
    return out.path if out.cached else _uncached(out.path)


def run_stage_entry(cfg: Config, stage: RunStage) -> dict:
    """dvc.yaml's entry of a run-level stage, from its record (:data:`tpgrpo.stage_params.RUN_STAGES`): its
    command, params, deps (its kind's code manifest, its external deps, the other run-level stages' outputs it
    reads) and outputs."""
    deps = [*code_deps(stage.kind), *(p for name in stage.external for p in EXTERNAL[name](cfg)),
            *stage.inputs]
    return {"cmd": stage_command(cfg, stage.name), "params": stage_inputs(stage.name, cfg),
            "deps": deps, "outs": [_run_output(out) for out in stage.outputs]}


def _record(name: str) -> RunStage:
    """The run-level stage ``name``'s record."""
    return next(stage for stage in RUN_STAGES if stage.name == name)


def summary_stage(cfg: Config, open_iters: list[int], sealed: list[Block]) -> dict:
    """Metrics, curves and figures of the whole run. It reads every iteration's stage JSON and eval table;
    as DVC deps it lists them for open iterations only and, per sealed block, the block's log digest (the md5
    of each of those files, rewritten whenever the block runs), so its dependency count does not grow with the
    run."""
    entry = run_stage_entry(cfg, _record("summary"))  # its record's parts, then the run's
    # The stage JSONs: outputs of their stages (see iteration_stages).
    per_iter = [f"{_iter_dir(i)}/{name}.json" for i in open_iters for name in STAGE_LOGS]
    evals = [f"{_iter_dir(i)}/eval.parquet" for i in open_iters]
    blocks = [digest_path(b) for b in sealed]  # every log and table of the block, through its digest
    last = _iter_dir(cfg.train.iterations)  # the figures draw its tables and its policy's images
    last_iteration = [f"{last}/{name}" for name in ("probe.parquet", "credit.parquet", "policy")]
    deps = [*entry["deps"], *per_iter, *evals, *blocks, *last_iteration]
    return {**entry, "deps": list(dict.fromkeys(deps)),
            "outs": [*entry["outs"], *[_uncached(f"data/reports/{name}") for name in figure_names(cfg)]],
            "metrics": [{f"data/metrics/{name}.json": {"cache": False}} for name in GLANCE]}


class _NoAliasDumper(yaml.SafeDumper):
    """Write repeated lists out in full (no YAML anchors) so dvc.yaml reads plainly."""

    def ignore_aliases(self, data) -> bool:
        return True


RENDER_UPTO_ENV = "TPGRPO_RENDER_UPTO"  # set by `tpgrpo run` for its block-by-block repros


def dvc_yaml_text(cfg: Config, root: Path, upto: int | None = None) -> str:
    """The text of ``dvc.yaml`` for these params (through iteration ``upto``: see :func:`render`)."""
    return HEADER + yaml.dump(render(cfg, root, upto), Dumper=_NoAliasDumper, sort_keys=False,
                              default_flow_style=False, width=120)


def write_dvc_yaml(cfg: Config, root: Path, upto: int | None = None) -> bool:
    """Write ``dvc.yaml`` (through iteration ``upto``: see :func:`render`) if its content changed, and each
    sealed block's pipeline file (:func:`write_block_dvcfile`); returns whether ``dvc.yaml`` changed."""
    text = dvc_yaml_text(cfg, root, upto)
    last = cfg.train.iterations if upto is None else upto
    blocks = [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b.last <= last]
    for block, outs in sealed_outs(root, blocks).items():
        write_block_dvcfile(cfg, root, block, outs)
    path = root / "dvc.yaml"
    if path.exists() and path.read_text() == text:
        return False
    write_text_atomic(path, text)
    return True


# The first lines of every sealed block's dvc.yaml. They name this module as it was named before tpgrpo/pipeline/
# had wings (now tpgrpo.pipeline.rendering.dvcfile): kept, so that the blocks' files keep their bytes.
BLOCK_HEADER = ("# A sealed block of iterations, written by `tpgrpo run` (tpgrpo.pipeline.dvcfile); its own dvc.lock\n"
                "# lies beside it. Paths are the project root's (wdir).\n")


def block_dvcfile_text(cfg: Config, block: Block, outs: list[str] | None = None) -> str:
    """The pipeline file of a sealed block: its one stage (:func:`block_stage`), run from the project root."""
    stage = {"wdir": "../../..", **block_stage(cfg, block, outs)}
    return BLOCK_HEADER + yaml.dump({"stages": {block.name: stage}}, Dumper=_NoAliasDumper, sort_keys=False,
                                    default_flow_style=False, width=120)


def write_block_dvcfile(cfg: Config, root: Path, block: Block, outs: list[str] | None = None) -> bool:
    """Write ``data/seals/NNNN-MMMM/dvc.yaml`` if its content changed; returns whether it did."""
    text = block_dvcfile_text(cfg, block, outs)
    path = block.dvcfile(root)
    if path.is_file() and path.read_text() == text:
        return False
    write_text_atomic(path, text)
    return True


def check_rendered(cfg: Config, root: Path) -> None:
    """Refuse a ``dvc repro`` / ``dvc exp run`` whose dvc.yaml is not what these params render (the code
    stage, which depends on params.yaml, runs this first): e.g. ``-S train.iterations=20`` changes params.yaml
    but not the stages DVC runs. Under ``tpgrpo run`` the rendering is through its current block."""
    import os

    upto = os.environ.get(RENDER_UPTO_ENV)
    path = root / "dvc.yaml"
    if path.is_file() and path.read_text() != dvc_yaml_text(cfg, root, int(upto) if upto else None):
        raise ConfigError("dvc.yaml was rendered from other params than params.yaml's (train.iterations, "
                          "eval.every, train.block_size or paths): run `tpgrpo run`, or `tpgrpo dvc-yaml` "
                          "before `dvc repro` / `dvc exp run`")
