"""What users do to a project, as seeded random actions, and the check after each.

Each action changes the project (a param, code, files, a hand-run stage, a killed run, damage) and says
what the next ``tpgrpo run`` may run (``allowed``), must run (``required``) and whether it may refuse
with one line. :func:`run_sequence` applies a seeded sequence of them, each followed by ``tpgrpo run`` and
the three checks of :mod:`up_to_date_harness`; it stops at the first failure and returns it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import up_to_date_harness as h

BASE_TRAIN = {"iterations": 3, "block_size": 2}  # block 1-2 sealed, iteration 3 open: both paths exercised
# tree.children: inert while tree.enabled is off (no stage lists the tree section), upstream while it is on.
# sampling.window_size, rollout.group_size: a chain's only, so with the tree on an edit runs nothing.
UPSTREAM = {"update.lr": [0.01, 0.005], "sampling.noise_level": [0.7, 0.5], "tree.enabled": [False, True],
            "tree.children": [1, 2], "update.micro_batch": [8, 3], "sampling.window_size": [3, 2],
            "rollout.group_size": [4, 2]}
LEAF = {"eval.num_steps": [4, 3], "eval.samples_per_prompt": [2, 1], "task.eval_reward": ["geneval", "geneval_soft"],
        "credit.mode": ["tp", "incremental", "flow_grpo"], "update.ema": [False, True]}
# The stage kinds that read each param (written here from the stages' code, not from dvcfile.STAGE_PARAMS,
# so that a wrong declaration there shows up as a wrong re-run).
READERS = {"update.lr": {"update"}, "sampling.noise_level": {"rollout", "eval", "baseline"},
           "eval.num_steps": {"eval", "baseline"}, "eval.samples_per_prompt": {"eval", "baseline", "eval_prompts"},
           "task.eval_reward": {"eval", "baseline"}, "credit.mode": {"credit"}, "update.ema": {"update"},
           # the probe follows the store's shape; the baseline lists the window on a chain only
           "probe.completion": {"probe"}, "tree.enabled": {"rollout", "baseline"},
           "tree.children": {"rollout"}, "update.micro_batch": {"update"},
           # eval, baseline and summary list the sampling section whole on a chain (its window too), not on a tree
           "sampling.window_size": {"rollout", "eval", "baseline"}, "rollout.group_size": {"rollout"}}
TREE_SWITCH = "tree.enabled"  # the rollout reads the other tree keys only while it is on
CHAIN_ONLY = {"sampling.window_size", "rollout.group_size"}  # no stage reads them while it is on
ALL_KINDS = {"rollout", "probe", "credit", "update", "eval", "eval_prompts", "baseline", "summary"}
ONCE = {"eval_prompts", "baseline", "summary"}  # the stages a run has once, not per iteration
# Code files each kind certainly runs on the tiny project (a line of code appended must re-run those stages).
CODE_TARGETS = {
    "stages/rollout.py": {"rollout"}, "stages/probe.py": {"probe"}, "stages/credit.py": {"credit"},
    "stages/update.py": {"update"}, "stages/eval.py": {"eval", "baseline"}, "stages/baseline.py": {"baseline"},
    "stages/summary.py": {"summary"}, "stages/eval_prompts.py": {"eval_prompts"},
    "tpgrpo/policy/eval_embeds.py": {"eval_prompts", "eval", "baseline"}, "tpgrpo/algo/seeds.py": {"rollout", "update"},
    "tpgrpo/algo/loss.py": {"update"}, "tpgrpo/algo/credit.py": {"credit"},
    "tpgrpo/algo/advantages.py": {"credit", "update"}, "tpgrpo/config.py": ALL_KINDS,
    "tpgrpo/distributed.py": ALL_KINDS - {"credit"}, "tpgrpo/io/artifacts.py": ALL_KINDS,
    "tpgrpo/__init__.py": ALL_KINDS,
}
PRODUCER = {"trajectories.zarr": "rollout", "prompt_embeds.safetensors": "rollout", "probe.parquet": "probe",
            "credit.parquet": "credit", "policy": "update", "eval.parquet": "eval"}
ALWAYS = {"summary", "code"}  # re-run after any change that reaches a result
GRACE_S = 10  # seconds a killed run's processes get to end


@dataclass
class Plan:
    """What an action did and what the next ``tpgrpo run`` may and must run."""

    what: str
    allowed: set[str] | None  # None: anything may run
    required: set[str] = field(default_factory=set)
    may_refuse: bool = False
    restore: dict | None = None  # params to put back when the run refuses (a refused edit)
    damaged: Path | None = None  # the artifact to delete when the run refuses (a refused damage)
    marks: dict | None = None  # stage marks from before a run the action itself started
    failure: str | None = None  # the action itself broke the property (e.g. a stage ran on after a kill)


@dataclass
class Seq:
    root: Path
    refs: h.References
    rng: random.Random
    retained: bool = False


# ---------------------------------------------------------------- the stage graph of a config

def n_iters(raw: dict) -> int:
    return raw["train"]["iterations"]


def stages_of(raw: dict, kinds: set[str], iters=None) -> set[str]:
    """Stage names of ``kinds`` over ``iters`` (default: the run's) under ``raw``."""
    iters = range(1, n_iters(raw) + 1) if iters is None else iters
    per = kinds - ONCE  # every credit mode has a probe stage
    return {f"{k}-{i:04d}" for k in per for i in iters} | (kinds & ONCE)


def _children(raw: dict, name: str) -> set[str]:
    kind, _, num = name.partition("-")
    if name == "eval_prompts":  # every eval and the baseline read its embeddings
        return stages_of(raw, {"eval", "baseline", "summary"})
    if not num:
        return {"summary"} if name == "baseline" else set()
    i = int(num)
    nxt = {f"rollout-{i + 1:04d}", f"update-{i + 1:04d}", f"probe-{i + 1:04d}"}
    kids = {"rollout": {f"update-{i:04d}", f"probe-{i:04d}"},
            "probe": {f"credit-{i:04d}"}, "credit": {f"update-{i:04d}"},
            "update": {f"eval-{i:04d}", *(nxt if i < n_iters(raw) else set())}, "eval": set()}[kind]
    return kids | {"summary"}


def downstream(raw: dict, seeds: set[str]) -> set[str]:
    """``seeds`` and every stage that reads what they write, transitively."""
    todo, seen = list(seeds), set(seeds)
    while todo:
        for child in _children(raw, todo.pop()) - seen:
            seen.add(child)
            todo.append(child)
    return seen


def block_stages(seq: Seq, raw: dict, i: int) -> set[str]:
    """All stages of the sealed block holding iteration ``i`` (a changed output re-runs a sealed block
    whole, by design), or none."""
    for first, last in h.sealed_blocks(seq.root):
        if first <= i <= last:
            return stages_of(raw, ALL_KINDS - ONCE, range(first, last + 1))
    return set()


# ---------------------------------------------------------------- actions

def _change(seq: Seq, table: dict) -> tuple[dict, dict, str, object, object]:
    """Set a random key of ``table`` to another of its values; returns (params now, params before, key, old,
    new)."""
    raw = h.read_params(seq.root)
    key = seq.rng.choice(sorted(table))
    old = h.get_param(raw, key)
    new = seq.rng.choice([v for v in table[key] if v != old])
    before = {s: dict(v) for s, v in raw.items()}
    h.write_params(seq.root, h.set_param(raw, key, new))
    return raw, before, key, old, new


def _edit(seq: Seq, table: dict, label: str) -> Plan:
    raw, before, key, old, new = _change(seq, table)
    if key.startswith("tree.") and key != TREE_SWITCH and not h.get_param(raw, TREE_SWITCH):
        return Plan(f"{label} {key}: {old!r} -> {new!r} (tree off: inert)", set(), restore=before)
    if key in CHAIN_ONLY and h.get_param(raw, TREE_SWITCH):
        return Plan(f"{label} {key}: {old!r} -> {new!r} (tree on: not read)", set(), restore=before)
    kinds = set(READERS[key])
    if key == "credit.mode" and "flow_grpo" in (old, new):
        kinds.add("probe")  # the probe stage appears or goes
    allowed = downstream(raw, stages_of(raw, kinds)) | stages_of(before, kinds) | ALWAYS
    return Plan(f"{label} {key}: {old!r} -> {new!r}", allowed, may_refuse=seq.retained, restore=before)


def edit_upstream(seq: Seq) -> Plan:
    return _edit(seq, UPSTREAM, "edit upstream param")


def edit_leaf(seq: Seq) -> Plan:
    return _edit(seq, LEAF, "edit leaf param")


def manifest_kinds(root: Path, path: str, part: str = "files") -> set[str]:
    """The stage kinds whose code manifest (``data/code/<kind>.json``, as the project's code stage wrote it)
    lists ``path`` among its ``part`` (``"files"``, or ``"libraries"``: a distribution's name), as stage kinds
    of this harness (the eval manifest also serves the baseline)."""
    import json

    kinds = set()
    for manifest in sorted((root / "data" / "code").glob("*.json")):
        if path in json.loads(manifest.read_text()).get(part, {}):
            kinds |= {"eval", "baseline"} if manifest.stem == "eval" else {manifest.stem}
    return kinds


def edit_code(seq: Seq) -> Plan:
    """Append a fresh line of code (h.MARK) to a file stages import: the stages whose manifest lists it must re-run (at least
    those CODE_TARGETS says certainly run it), and nothing but them, what reads their outputs, the code stage
    and the summary (a sealed block is unsealed, not re-run whole)."""
    raw = h.read_params(seq.root)
    path = seq.rng.choice([p for p in sorted(CODE_TARGETS) if (seq.root / p).is_file()])
    kinds = manifest_kinds(seq.root, path)
    token = f"{seq.rng.getrandbits(48):012x}"
    with open(seq.root / path, "a") as f:
        f.write(f"\n{h.MARK} {token}\n")
    allowed = downstream(raw, stages_of(raw, kinds)) | ALWAYS
    return Plan(f"edit code {path} (comment {token}; in the manifests of {sorted(kinds)})", allowed,
                stages_of(raw, CODE_TARGETS[path]), may_refuse=seq.retained)


# Execution knobs (tpgrpo.stage_params.EXECUTION_KNOBS), with values this CPU machine can run. A knob is not
# recorded: changing it must re-run nothing (not even the code stage, unless it renders dvc.yaml from it).
# Toggling launch.hash_while_writing, later rollouts hand DVC their md5s or leave DVC to hash; toggling
# launch.cache_while_writing, they put the store's objects into DVC's cache themselves or leave DVC to copy.
KNOBS = {"model.device": ["cpu", "cpu:0"], "reward_models.device": ["cpu", "cpu:0"],
         "update.gradient_checkpointing": [False, True], "launch.hash_while_writing": [True, False],
         "launch.cache_while_writing": [True, False]}


def edit_knob(seq: Seq) -> Plan:
    """Change an execution knob: nothing may run but the code stage (which reads reward_models' keys)."""
    _, _, key, old, new = _change(seq, KNOBS)
    return Plan(f"edit execution knob {key}: {old!r} -> {new!r}", {"code"})


# A pure-Python library that the rollout, probe, credit and update import and eval and summary do not; a copy of it
# in the project root (first on every run's PYTHONPATH: h.env) shadows the installed one, as a user's patched
# checkout on PYTHONPATH or an editable install would.
LIBRARY, LIBRARY_CERTAIN = "zarr", {"rollout", "update"}  # those two write and read the trajectory store with it


def edit_dependency(seq: Seq) -> Plan:
    """Edit a library where its version does not say so: the first time, put a copy of it in the project root
    (it shadows the installed one), and append a fresh statement to the copy's ``__init__.py``. The stages whose
    manifests record the library must re-run (at least LIBRARY_CERTAIN's), and nothing but them, what reads
    their outputs, the code stage and the summary."""
    import importlib

    raw = h.read_params(seq.root)
    kinds, copy = manifest_kinds(seq.root, LIBRARY, "libraries"), seq.root / LIBRARY
    what = "edit the shadowing copy of"
    if not copy.is_dir():
        installed = Path(importlib.import_module(LIBRARY).__file__).parent
        shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
        what = "shadow the installed library with a copy in the project root and edit"
    token = f"{seq.rng.getrandbits(48):012x}"
    with open(copy / "__init__.py", "a") as f:
        f.write(f"\n_up_to_date_harness_edit = '{token}'\n")
    allowed = downstream(raw, stages_of(raw, kinds)) | ALWAYS
    return Plan(f"{what} {LIBRARY} ({token}; in the manifests of {sorted(kinds)})", allowed,
                stages_of(raw, LIBRARY_CERTAIN), may_refuse=seq.retained)


def touch(seq: Seq) -> Plan:
    """Change mtimes only (artifacts, code, params, prompts, model): nothing may run."""
    files = [p for p in seq.root.rglob("*") if p.is_file() and ".git" not in p.parts and ".dvc" not in p.parts
             and "__pycache__" not in p.parts]
    picked = seq.rng.sample(sorted(files), min(6, len(files)))
    stamp = time.time() + seq.rng.choice([-3600, 5, 3600])
    for p in picked:
        os.utime(p, (stamp, stamp))
    return Plan("touch " + ", ".join(p.relative_to(seq.root).as_posix() for p in picked), set())


def _hand_stage(seq: Seq, raw: dict) -> tuple[str, int]:
    return seq.rng.choice(["credit", "eval", "probe", "rollout", "update"]), seq.rng.randint(1, n_iters(raw))


def _hand_run(seq: Seq, stage: str, i: int) -> str | None:
    """Run ``tpgrpo stage`` by hand; None, or why it failed (a one-line missing-input refusal is fine)."""
    done = h.tpgrpo(seq.root, "stage", stage, "--iter", str(i))
    # a one-line refusal is fine: after retention (missing inputs), or a param the stored artifacts cannot
    # serve (probe.completion x0 on a rollout that kept no x0 estimates): nothing was written
    if done.returncode == 0 or h.one_line_error(done):
        return None
    return f"hand re-run of {stage} --iter {i} failed (rc {done.returncode}): {done.stderr.strip()[-600:]}"


def hand_inputs(root: Path, raw: dict, stage: str, i: int) -> list[Path]:
    """The artifacts ``tpgrpo stage STAGE --iter i`` reads under ``raw`` (written here from the stages' code):
    the policy it samples or trains from, the rollout's store, the tables before it."""
    it = lambda n: root / "data" / "iters" / f"{n:04d}"  # noqa: E731
    policy = [it(i - 1) / "policy"] if i > 1 else []  # iteration 1 starts from the base model
    # a chain probe completes states with the model; a tree's or flow_grpo's loads none
    probe_model = not h.get_param(raw, TREE_SWITCH) and raw["credit"]["mode"] != "flow_grpo"
    every = int(raw["eval"]["every"])
    return {"rollout": policy,
            "probe": [it(i) / "trajectories.zarr", *(policy if probe_model else [])],
            "credit": [it(i) / "probe.parquet"],
            "update": [it(i) / "trajectories.zarr", it(i) / "credit.parquet", *policy],
            "eval": [it(i) / "policy"] if every > 0 and i % every == 0 else []}[stage]


def rerun_same(seq: Seq) -> Plan:
    """Re-run a stage by hand with the current params (any stage, open or in a sealed block, eval included).
    What the product promises (docs/up-to-date.md, docs/long-runs.md on retention): with its inputs present
    it rewrites its artifacts and log byte for byte (its seconds go to an untracked sidecar); with
    an input retention dropped it refuses in one line naming that input and writes nothing. Either way
    `dvc status` is clean right after it and the next run runs nothing."""
    raw = h.read_params(seq.root)
    stage, i = _hand_stage(seq, raw)
    missing = [p for p in hand_inputs(seq.root, raw, stage, i) if not p.exists()]
    before = h.digests(seq.root)
    done = h.tpgrpo(seq.root, "stage", stage, "--iter", str(i))
    failure = _hand_outcome(seq, done, f"{stage} --iter {i}", missing, before)
    if failure is None:
        status = h.dvc_status(seq.root)
        if status != "{}":
            failure = f"dvc status after a hand re-run of {stage} --iter {i} with the same params: {status[:600]}"
    dropped = f" (refused: {missing[0].relative_to(seq.root)} dropped)" if missing else ""
    return Plan(f"hand re-run {stage} --iter {i} (same params){dropped}", set(), failure=failure)


def _hand_outcome(seq: Seq, done: subprocess.CompletedProcess, what: str, missing: list[Path],
                  before: dict) -> str | None:
    """None if a hand run did as promised: ran (all inputs present), or refused in one line naming a missing
    input and changed no artifact; else what went wrong."""
    if not missing:
        return None if done.returncode == 0 else (
            f"hand re-run of {what} failed (rc {done.returncode}): {done.stderr.strip()[-600:]}")
    names = [p.relative_to(seq.root).as_posix() for p in missing]
    if not h.one_line_error(done) or not any(n in done.stderr for n in names):
        return f"hand re-run of {what} without {names}: expected one line naming it, got rc {done.returncode}: " \
               f"{done.stderr.strip()[-600:]}"
    after = h.digests(seq.root)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    return f"hand re-run of {what} refused but changed {changed[:4]}" if changed else None


OTHER = {"rollout": ("sampling.noise_level", [0.7, 0.5]), "probe": ("probe.completion", ["exact", "x0"]),
         "credit": ("credit.mode", ["tp", "incremental"]), "update": ("update.lr", [0.01, 0.005]),
         "eval": ("eval.num_steps", [4, 3])}


def rerun_other(seq: Seq) -> Plan:
    """Re-run a stage by hand under another value of a param it reads, then put params.yaml back: the run
    must bring the artifact (and what reads it) back to the current params."""
    raw = h.read_params(seq.root)
    stage, i = _hand_stage(seq, raw)
    if stage == "credit" and raw["credit"]["mode"] == "flow_grpo":
        stage = "update"
    key, values = OTHER[stage]
    old = h.get_param(raw, key)
    new = seq.rng.choice([v for v in values if v != old])
    before = {s: dict(v) for s, v in raw.items()}
    h.write_params(seq.root, h.set_param(raw, key, new))
    failure = _hand_run(seq, stage, i)
    h.write_params(seq.root, before)
    name = f"{stage}-{i:04d}"
    allowed = downstream(before, {name}) | block_stages(seq, before, i) | ALWAYS
    return Plan(f"hand re-run {stage} --iter {i} with {key}={new!r}, params restored", allowed,
                may_refuse=seq.retained, failure=failure)


EVAL_EMBEDS = "data/iters/eval_prompt_embeds"  # eval_prompts' output, once per run


def _artifacts(seq: Seq, raw: dict) -> list[Path]:
    found = [seq.root / EVAL_EMBEDS] if (seq.root / EVAL_EMBEDS).is_dir() else []
    for i in range(1, n_iters(raw) + 1):
        folder = seq.root / "data" / "iters" / f"{i:04d}"
        found += [folder / name for name in sorted(PRODUCER) if (folder / name).exists()]
    return found


def _affected(seq: Seq, raw: dict, artifact: Path) -> set[str]:
    if artifact == seq.root / EVAL_EMBEDS:  # made again byte for byte (or restored): nothing reading it re-runs
        return {"eval_prompts"} | ALWAYS
    i = int(artifact.parent.name)
    name = f"{PRODUCER[artifact.name]}-{i:04d}"
    return downstream(raw, {name}) | block_stages(seq, raw, i) | ALWAYS


def delete(seq: Seq) -> Plan:
    raw = h.read_params(seq.root)
    artifact = seq.rng.choice(_artifacts(seq, raw))
    shutil.rmtree(artifact) if artifact.is_dir() else artifact.unlink()
    return Plan(f"delete {artifact.relative_to(seq.root)}", _affected(seq, raw, artifact), may_refuse=seq.retained)


def damage(seq: Seq) -> Plan:
    """Damage a file of an artifact in place; the run must repair it, or refuse with one line naming it
    (the harness then deletes the artifact, as a user would, and the run after must repair it)."""
    raw = h.read_params(seq.root)
    artifact = seq.rng.choice(_artifacts(seq, raw))
    if artifact.is_dir():
        files = sorted(p for p in artifact.rglob("*") if p.is_file() and p.name != "zarr.json"
                       and p.name != "adapter_config.json")
        target = seq.rng.choice(files)
    else:
        target = artifact
    how = seq.rng.choice(["truncate", "flip"])
    what = h.damage(target, how, seq.rng)
    return Plan(f"damage {target.relative_to(seq.root)} ({what})", _affected(seq, raw, artifact),
                may_refuse=True, damaged=artifact)


def retain(seq: Seq) -> Plan:
    """Set a retention policy and apply it (`tpgrpo retain`): nothing may run afterwards."""
    raw = h.read_params(seq.root)
    raw["retention"] = {"keep_trajectories": seq.rng.choice([1, 2]), "keep_adapter_every": seq.rng.choice([2, 3])}
    h.write_params(seq.root, raw)
    done = h.tpgrpo(seq.root, "retain")
    seq.retained = True
    failure = None if done.returncode == 0 or h.one_line_error(done) else (
        f"tpgrpo retain failed (rc {done.returncode}): {done.stderr.strip()[-600:]}")
    return Plan(f"retain {raw['retention']}: {done.stdout.strip()}", {"code"}, failure=failure)


def iterations(seq: Seq) -> Plan:
    raw = h.read_params(seq.root)
    old = n_iters(raw)
    new = seq.rng.choice([n for n in (2, 3, 4) if n != old])
    before = {s: dict(v) for s, v in raw.items()}
    h.write_params(seq.root, h.set_param(raw, "train.iterations", new))
    allowed = set(ALWAYS)
    if new > old:  # the new iterations only
        allowed |= stages_of(raw, ALL_KINDS - ONCE, range(old + 1, new + 1))
    return Plan(f"train.iterations {old} -> {new}", allowed, may_refuse=seq.retained, restore=before)


def yaml12(seq: Seq) -> Plan:
    """Write params.yaml's floats as YAML 1.2 reads them (``1e-02``; a string for YAML 1.1): same values,
    nothing may run (item 5)."""
    text = (seq.root / "params.yaml").read_text()

    def exp(m: re.Match) -> str:
        v = float(m.group(2))
        e = f"{v:.0e}"
        return m.group(1) + (e if float(e) == v else m.group(2))

    (seq.root / "params.yaml").write_text(re.sub(r"^(\s*\w+: )(-?\d+\.\d+(?:e-?\d+)?)$", exp, text, flags=re.M))
    return Plan("rewrite params.yaml floats as 1e-02 (YAML 1.2)", {"code"})  # the code stage reads params.yaml


# The actions that change the project without interrupting a run; tests/up_to_date_interrupts.py adds the
# kills and the edits during a run, and tests/up_to_date_runner.py's ACTIONS holds both.
CHANGES = {f.__name__: f for f in (edit_upstream, edit_leaf, edit_code, edit_knob, edit_dependency, touch, rerun_same,
                                   rerun_other, delete, damage, retain, iterations, yaml12)}
