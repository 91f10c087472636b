"""What each stage reads from params.yaml, and the names stage code and orchestration share.

Stage-side facts, kept out of :mod:`tpgrpo.pipeline` so that stage code (which records the params it read in
its artifacts' ``config_hash``) does not import the orchestration that renders ``dvc.yaml`` from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_type_hints

from tpgrpo.config import Config, param_fields

# Execution knobs: params the stages read that say where and in what memory the work runs, not what it
# computes: each declared with its kind in tpgrpo.config (``param(..., knob=...)``). No stage declares them, so
# DVC does not record them (changing one re-runs nothing) and no artifact's config_hash carries them
# (tpgrpo.stage_common.provenance); docs/long-runs.md ("Execution knobs") has the measurements. A key is one only
# if, on one machine, changing it leaves every table byte-identical at equal torch thread counts and moves the
# adapter by float round-off at most (tests/test_knobs.py); another kind of device rounds differently, as another
# machine does. The batch sizes are not knobs: batched passes round differently at some batch shapes on a CPU
# (measured). Nor is update.micro_batch: it sums the same mean gradient in another order, and AdamW's per-weight
# step amplifies that round-off (the shipped model's adapter: 1.9e-3 apart at 8 vs 1, more than update.lr).
STAGE_KNOB_KINDS = ("placement", "memory", "hashing", "caching")  # "bookkeeping": no stage reads it
EXECUTION_KNOBS = {key: f.metadata["knob"] for key, f in param_fields().items()
                   if f.metadata["knob"] in STAGE_KNOB_KINDS}


def section_keys(section: str) -> list[str]:
    """Every key of a params section, in params.yaml's order (``["sampling.num_steps", ...]``)."""
    return [f"{section}.{f.name}" for f in dataclasses.fields(get_type_hints(Config)[section])]


def inputs(section: str) -> list[str]:
    """Every key of a params section but its execution knobs (``["model.kind", "model.path", ...]``), in
    params.yaml's order: a key added to the section later is an input unless it is listed as a knob. A section
    without a knob stays whole (``["credit"]``), as dvc.yaml listed it."""
    keys = section_keys(section)
    return [k for k in keys if k not in EXECUTION_KNOBS] if any(k in EXECUTION_KNOBS for k in keys) else [section]


MODEL_PARAMS = inputs("model")  # also the key of cached prompt embeddings (tpgrpo.stage_common, eval_embeds)
# The keys of the forward-process objectives (update.objective nft / awm, docs/objectives.md): read only while
# the objective is not grpo, so a grpo project lists and hashes what it did before they existed.
OBJECTIVE_KEYS = ("update.objective", *(k for k in section_keys("update")
                                        if k.startswith(("update.nft_", "update.awm_")) or k == "update.split_levels"))
GRPO_ONLY = ("update.clip_range", "update.kl_beta")  # the PPO clip and its KL: unread under nft / awm
REWARD_PARAMS = [*inputs("reward_models"), "remote_reward"]  # read by every stage that scores images

SUMMARY, DONE, COMPARE = "summary", "done", "compare"  # readers of an output beyond the stages after it


@dataclass(frozen=True)
class Output:
    """A file or folder an iteration stage writes into ``data/iters/NNNN/``."""

    name: str  # its name in the iteration folder
    attr: str  # the attribute of tpgrpo.io.artifacts.IterationPaths that gives its path
    cached: bool = True  # False: DVC hashes it and git keeps it, DVC's cache does not (eval's small outputs)
    droppable: str = ""  # the retention group `tpgrpo retain` may delete it with once sealed; "": kept forever
    # SUMMARY: the summary stage reads it (and so a sealed block's log digest hashes it); DONE: every finished
    # iteration has it (tpgrpo status, tpgrpo compare); COMPARE: tpgrpo compare's curves read it
    read_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class IterationStage:
    """One stage of an iteration, declared once. dvc.yaml's entry (tpgrpo.pipeline.rendering.dvcfile), the paths stage
    code uses (IterationPaths), its code manifest (tpgrpo.pipeline.rendering.code_manifest), what retention may drop,
    the block log digest, tpgrpo status, tpgrpo compare and its archives all derive from this."""

    name: str  # `tpgrpo stage NAME --iter I`; NAME-NNNN in dvc.yaml; its log is NAME.json
    code: tuple[str, ...]  # the scripts whose import closure is its kind's code manifest
    params: tuple[str, ...]  # the params it reads in every configuration (with CONDITIONAL/UNREAD_PARAMS below)
    external: tuple[str, ...]  # deps from outside the iteration folder, in dvc.yaml's order (dvcfile.EXTERNAL)
    inputs: tuple[str, ...]  # outputs of the same iteration's earlier stages that it reads
    previous_policy: bool  # reads iteration i - 1's adapter (policy 0 is the base model: no dep at i = 1)
    outputs: tuple[Output, ...]
    multi_process: bool = True  # runs on the processes the launch params ask for (else one: the credit)

    @property
    def kind(self) -> str:
        """The code manifest it depends on: its own (``data/code/<name>.json``)."""
        return self.name


# The params each stage reads in every configuration (DVC re-runs a stage when one of these changes); with
# CONDITIONAL_PARAMS below, stage_inputs() gives the full list for a config. No stage lists `launch`, and
# dvc.yaml's commands do not carry it: the process count never changes an artifact (nor the config hash
# artifacts carry); `tpgrpo stage` reads it when it starts (tpgrpo.pipeline.execution.launch). Nor an execution knob.
# The probe reads credit.mode only to know whether it is flow_grpo (PATH_SWITCHES below), so it does not list
# the mode: switching among the scored modes re-runs no probe.
ITERATION_STAGES = (
    IterationStage(
        "rollout", ("stages/rollout.py",),
        (*MODEL_PARAMS, "task.train_prompts", "task.reward", "sampling", "rollout", "probe.completion",
         "update.lora_rank", "update.lora_alpha", "train.seed", *REWARD_PARAMS),
        external=("scorers", "model", "train_prompts"), inputs=(), previous_policy=True,
        outputs=(Output("trajectories.zarr", "trajectories", droppable="trajectories"),
                 Output("prompt_embeds.safetensors", "prompt_embeds", droppable="trajectories"),
                 Output("rollout.json", "rollout_metrics", read_by=(SUMMARY, DONE)))),
    IterationStage(
        "probe", ("stages/probe.py",),
        (*MODEL_PARAMS, "probe", "update.lora_rank", "update.lora_alpha", "train.seed", *REWARD_PARAMS),
        external=("scorers", "model"), inputs=("trajectories.zarr", "prompt_embeds.safetensors"),
        previous_policy=True,
        outputs=(Output("probe.parquet", "probe"), Output("probe.json", "probe_metrics", read_by=(SUMMARY,)))),
    IterationStage(
        "credit", ("stages/credit.py",), ("credit",), external=(), inputs=("probe.parquet",), previous_policy=False,
        outputs=(Output("credit.parquet", "credit", read_by=(SUMMARY,)),
                 Output("credit.json", "credit_metrics", read_by=(SUMMARY, DONE))), multi_process=False),
    IterationStage(
        "update", ("stages/update.py",),
        (*MODEL_PARAMS, *(k for k in inputs("update") if k not in OBJECTIVE_KEYS), "train.seed"),
        external=("model",), inputs=("trajectories.zarr", "prompt_embeds.safetensors", "credit.parquet"),
        previous_policy=True,
        outputs=(Output("policy", "policy", droppable="adapter"),
                 Output("update.json", "update_metrics", read_by=(SUMMARY, DONE)))),
    IterationStage(  # its manifest also covers the baseline (the base model's eval: RUN_STAGES)
        "eval", ("stages/eval.py",),
        (*MODEL_PARAMS, "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank", "update.lora_alpha",
         "update.ema", "train.seed", *REWARD_PARAMS),
        external=("eval_scorers", "model", "eval_prompts", "eval_embeds"), inputs=("policy",),
        previous_policy=False,
        outputs=(Output("eval.parquet", "eval_table", cached=False, read_by=(SUMMARY, COMPARE)),
                 Output("eval.json", "eval_metrics", cached=False, read_by=(SUMMARY, DONE)))),
)
STAGE_LOGS = tuple(stage.name for stage in ITERATION_STAGES)  # each writes data/iters/NNNN/<stage>.json
ITERATION_OUTPUTS = {out.attr: out for stage in ITERATION_STAGES for out in stage.outputs}


def outputs_read_by(*readers: str) -> tuple[str, ...]:
    """The iteration outputs' names that any of ``readers`` reads, in pipeline order."""
    return tuple(out.name for out in ITERATION_OUTPUTS.values() if set(out.read_by) & set(readers))


# The run-level stages' files, beside the iterations' folders: each path is spelt here only.
EVAL_EMBEDS = "data/iters/eval_prompt_embeds"  # the eval_prompts stage's output (a folder, DVC-cached)
EVAL_EMBEDS_LOG = "data/iters/eval_prompts.json"  # its log (an output too, uncached like the baseline's log)
BASELINE_TABLE = "data/iters/baseline_eval.parquet"  # the base model's eval table (eval.parquet's rows)
BASELINE_LOG = "data/iters/baseline_eval.json"  # its metrics (eval.json's)
EVAL_CURVE = "data/metrics/eval_curve.csv"  # base model + every evaluated iteration
TRAIN_CURVE = "data/metrics/train_curve.csv"  # one row per iteration


@dataclass(frozen=True)
class RunOutput:
    """A file or folder a run-level stage writes (its path from the project root)."""

    path: str
    cached: bool = True  # False: DVC hashes it and git keeps it, DVC's cache does not (small tables, logs)


@dataclass(frozen=True)
class RunStage:
    """A stage that runs once per run (``tpgrpo stage NAME``, no ``--iter``), declared once: its command
    (tpgrpo.pipeline.execution.stage_runner), dvc.yaml's entry (tpgrpo.pipeline.rendering.dvcfile; the summary's
    deps on the iterations are added there, as they grow with the run), its params and its code manifest derive
    from it.
    The ``code`` stage, which writes the manifests from all of the code, is no record: it runs no stage module
    and lists the params dvc.yaml's rendering reads (tpgrpo.pipeline.rendering.code_manifest.code_stage)."""

    name: str  # `tpgrpo stage NAME`; NAME in dvc.yaml
    # the help line of `tpgrpo stage NAME` (help text: in no manifest's hash, tpgrpo.pipeline.rendering.code_hash)
    help: str
    code: tuple[str, ...]  # its scripts, in its kind's code manifest
    params: tuple[str, ...]  # the params it reads in every configuration (with UNREAD_PARAMS below)
    external: tuple[str, ...]  # deps from outside the run's stages, in dvc.yaml's order (dvcfile.EXTERNAL)
    inputs: tuple[str, ...]  # outputs of other run-level stages it reads (paths), after ``external``
    outputs: tuple[RunOutput, ...]
    multi_process: bool  # runs on the processes the launch params ask for
    manifest: str = ""  # the kind whose code manifest covers it; "": its own (named after it)
    after_iterations: bool = False  # reads every iteration: dvc.yaml lists it last, and only with the whole run

    @property
    def kind(self) -> str:
        """The code manifest it depends on (``data/code/<kind>.json``)."""
        return self.manifest or self.name


RUN_STAGES = (  # in dvc.yaml's order
    # The held-out prompts' embeddings, once per run (tpgrpo.policy.eval_embeds): every eval and the baseline
    # read them (their text encoders never load); a DVC-cached folder, large at real size (T5-XXL). The chunks
    # eval encodes are cut by rollout.batch_size (so it changes this stage's files, not only floats).
    RunStage(
        "eval_prompts", f"Encode the held-out prompts once ({EVAL_EMBEDS}), for every eval and the baseline.",
        ("stages/eval_prompts.py",),
        (*MODEL_PARAMS, "task.eval_prompts", "eval.num_prompts", "eval.samples_per_prompt", "rollout.batch_size"),
        external=("model", "eval_prompts"), inputs=(),
        outputs=(RunOutput(EVAL_EMBEDS), RunOutput(EVAL_EMBEDS_LOG, cached=False)), multi_process=False),
    RunStage(  # the eval's work with no adapter: the eval's manifest covers it
        "baseline", "Evaluate the base model (the curves' starting point).", ("stages/baseline.py",),
        (*MODEL_PARAMS, "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank", "update.lora_alpha",
         *REWARD_PARAMS),
        external=("eval_scorers", "model", "eval_prompts", "eval_embeds"), inputs=(),
        outputs=(RunOutput(BASELINE_TABLE, cached=False), RunOutput(BASELINE_LOG, cached=False)),
        multi_process=True, manifest="eval"),
    RunStage(
        "summary", "Collect every iteration's metrics into data/metrics/history.csv and summary.json.",
        ("stages/summary.py",),
        (*MODEL_PARAMS, "task.eval_prompts", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
         "update.lora_alpha", "credit.mode", "train.iterations"),
        external=(), inputs=(BASELINE_LOG, BASELINE_TABLE),
        outputs=tuple(RunOutput(path, cached=False) for path in (
            "data/metrics/summary.json", "data/metrics/history.csv", EVAL_CURVE, TRAIN_CURVE)),
        multi_process=False, after_iterations=True),
)
STAGE_PARAMS = {stage.name: list(stage.params) for stage in (*ITERATION_STAGES, *RUN_STAGES)}
# Keys a stage reads only in some configurations, each group with the switch that says when. With the switch
# off the stage never reads them, so they are not inputs: editing them re-runs nothing, and a key added to the
# section leaves every existing stage's recorded params and config_hash as they were (a long run's history
# stays done).
# The tree's shape is the rollout's; how its advantages are centred is the credit stage's, so editing
# tree.baseline re-runs credit and update, not the rollout.
TREE_SHAPE = ("tree.split_steps", "tree.children", "tree.roots")
CONDITIONAL_PARAMS = {  # stage: [(the keys, the bool key that switches them on)]
    "rollout": [(("tree.enabled", *TREE_SHAPE), "tree.enabled")],
    "probe": [(("tree.enabled",), "tree.enabled")],  # all a tree's probe lists (below)
    "credit": [(("tree.baseline",), "tree.enabled")],
}
# Under nft / awm the rollout keeps the clean samples (and under nft samples with the old adapter), the update
# trains the objective: both list update.objective (the update its keys too) only then.
CONDITIONAL_PARAMS["rollout"].append((("update.objective",), "update.objective"))
CONDITIONAL_PARAMS["update"] = [(OBJECTIVE_KEYS, "update.objective")]
# A switch that is no bool: on unless it holds this value (update.objective: on under nft and awm).
OFF_VALUES = {"update.objective": "grpo"}
# Keys of STAGE_PARAMS' lists that a stage does not read while a switch is on, each group with its switch. The tree
# rollout samples roots x (children + 1)^splits leaves per prompt at its split steps: it reads neither the chain's
# group size nor its SDE window (its store records its own group and window, which probe, credit and update read from
# there: tpgrpo.rollout_shape.tree_rollout._store), nor probe.completion (the chain keeps x0 estimates or velocities
# for the probe; a tree's probe completes nothing, and the config loader refuses any mode but exact). Listed, an edit
# of one would re-run every tree rollout and all after it for nothing. Eval, baseline and summary list the sampling
# section whole but never read the window (eval samples by ODE in eval.num_steps): a tree project lists them without
# it. With the switch off nothing is dropped, so a chain project lists and hashes what it did (its window edits re-run
# the rollout, and through it every eval, anyway).
CHAIN_WINDOW = ("sampling.window_start", "sampling.window_size")
CHAIN_ONLY = (*CHAIN_WINDOW, "rollout.group_size", "probe.completion")
# A tree's probe (tpgrpo.rollout_shape.tree_probe) loads no model, scores nothing and completes nothing: its table is
# the store's leaf rewards rearranged, so it reads none of the probe's keys (an edit of probe.batch_size re-ran every
# tree probe, and through its table's config_hash every credit and update after it).
UNREAD_PARAMS = {  # stage: [(the keys, the switch that drops them)]
    "rollout": [(CHAIN_ONLY, "tree.enabled")],
    "probe": [(tuple(STAGE_PARAMS["probe"]), "tree.enabled")],
    **{stage: [(CHAIN_WINDOW, "tree.enabled")] for stage in ("eval", "baseline", "summary")},
    "update": [(GRPO_ONLY, "update.objective")],
}


# Params a stage reads only to pick one of two code paths, each with the value that picks the other path and
# that path's name. The probe reads credit.mode only to know whether it is flow_grpo (no model loaded, Q_k =
# R_fin from the rollout). dvc.yaml cannot list the choice (every credit mode renders the same stages, so that
# `dvc exp run -S credit.mode=...` runs what `tpgrpo run` renders), so the stage's code manifest records it
# (tpgrpo.pipeline.rendering.code_manifest: a "path" entry, absent on the default path, so a tp run's manifests stay
# as they were) and its config_hash hashes the key on that path only. Switching among the other values
# re-runs nothing; switching to or from the named value re-runs the stage (its manifest changed).
PATH_SWITCHES = {"probe": ("credit.mode", "flow_grpo", "final_reward")}  # stage: (key, value, path name)


def code_path(stage: str, cfg: Config | dict) -> str | None:
    """The name of the other code path ``stage`` takes under ``cfg`` (``"final_reward"`` for the probe under
    ``credit.mode: flow_grpo``), or None on its default path (and for a stage without one)."""
    if stage not in PATH_SWITCHES:
        return None
    key, value, name = PATH_SWITCHES[stage]
    return name if _value(cfg, key) == value else None


def hashed_inputs(stage: str, cfg: Config | dict) -> list[str] | None:
    """What an artifact's ``config_hash`` hashes: :func:`stage_inputs`, plus a path switch's key while it
    picks the other path (the probe under flow_grpo hashes ``credit.mode``; under tp, incremental and
    tp_unconstrained the same list, hence the same hash)."""
    keys = stage_inputs(stage, cfg)
    if keys is None or code_path(stage, cfg) is None:
        return keys
    return [*keys, PATH_SWITCHES[stage][0]]


def _value(cfg: Config | dict, key: str):
    """``key`` (``"section.name"``) of a :class:`Config` (or anything with its attributes), or of params.yaml
    parsed as a mapping (None where the section or key is missing)."""
    section, _, name = key.partition(".")
    if not isinstance(cfg, dict):
        return getattr(getattr(cfg, section), name)
    values = cfg.get(section)
    return values.get(name) if isinstance(values, dict) else None


def _switched_on(cfg: Config | dict, key: str) -> bool:
    """``key`` (``"tree.enabled"``) of a :class:`Config` (or anything with its attributes), or of params.yaml
    parsed as a mapping (what :func:`tpgrpo.pipeline.status.stage_params` reads: a missing section is off)."""
    value = _value(cfg, key)
    if key in OFF_VALUES:
        return value is not None and value != OFF_VALUES[key]
    if not isinstance(cfg, dict):
        return bool(value)
    # DVC parses YAML 1.2, where `yes` and `on` are strings; the config loader (PyYAML, YAML 1.1) reads
    # them as true, and the stage then runs with the section switched on: so must this answer be.
    return value is True or value in YAML11_TRUE


YAML11_TRUE = ("yes", "Yes", "YES", "on", "On", "ON", "true", "True", "TRUE")  # PyYAML's bool resolver


def switches(stage: str) -> list[str]:
    """The keys that switch a stage's conditional keys on or off (``["tree.enabled"]`` for the rollout and the
    eval) or pick its code path (``["credit.mode"]`` for the probe): read by the stage in every configuration
    (its config_hash at least), recorded through what they decide (which keys are listed; the probe manifest's
    path)."""
    groups = [*CONDITIONAL_PARAMS.get(stage, []), *UNREAD_PARAMS.get(stage, [])]
    return [*dict.fromkeys(switch for _, switch in groups)] + (
        [PATH_SWITCHES[stage][0]] if stage in PATH_SWITCHES else [])


def stage_inputs(stage: str, cfg: Config | dict) -> list[str] | None:
    """The params stage ``stage`` reads under ``cfg`` (a :class:`Config` or parsed params.yaml):
    :data:`STAGE_PARAMS`' list plus each conditional group switched on (the rollout lists the tree's shape keys
    and the credit stage ``tree.baseline`` only while ``tree.enabled``), less each :data:`UNREAD_PARAMS` group
    switched on (with a tree no stage lists the window; the rollout no group size or probe completion either).
    What dvc.yaml lists and
    what a stage notes it read; ``config_hash`` hashes :func:`hashed_inputs`.
    None for a name no stage has."""
    keys = STAGE_PARAMS.get(stage)
    if keys is None:
        return None
    unread = {key for group, switch in UNREAD_PARAMS.get(stage, []) if _switched_on(cfg, switch) for key in group}
    extra = [key for group, switch in CONDITIONAL_PARAMS.get(stage, []) if _switched_on(cfg, switch) for key in group]
    return [*_without(keys, unread), *extra]


def _without(keys: list[str], unread: set[str]) -> list[str]:
    """``keys`` less the ``unread`` ones; a whole section holding one is listed key by key instead
    (``"sampling"`` -> ``"sampling.num_steps", ...`` without ``sampling.window_start``), in params.yaml's order."""
    if not unread:
        return list(keys)
    kept = []
    for key in keys:
        if "." not in key and any(u.startswith(f"{key}.") for u in unread):
            kept += [k for k in section_keys(key) if k not in unread and k not in EXECUTION_KNOBS]
        elif key not in unread:
            kept.append(key)
    return kept


# Stages that run on the processes the launch params ask for (their records' multi_process).
MULTI_PROCESS_STAGES = tuple(stage.name for stage in (*ITERATION_STAGES, *RUN_STAGES) if stage.multi_process)
GLANCE = ("held_out", "strict", "train_reward", "tp_rate", "approx_kl_x1e6", "seconds_per_iter")  # dvc metrics
