"""Seeded sequences of user actions (``up_to_date_actions``), each followed by ``tpgrpo run`` and the
three checks of "up to date means correct": (a) artifacts equal a run from scratch, (b) ``dvc status``
clean, (c) what ran is what the action affects. A sequence stops at its first failure and reports it.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import up_to_date_harness as h
from up_to_date_actions import BASE_TRAIN, CHANGES, Plan, Seq
from up_to_date_interrupts import INTERRUPTS

ACTIONS = {**CHANGES, **INTERRUPTS}  # every action a sequence may draw, by name

def _undo(seq: Seq, plan: Plan) -> bool:
    """After an accepted refusal: put the edit back, or delete the damaged artifact. False: nothing to undo
    (the sequence stops there, held)."""
    if plan.restore is not None:
        h.write_params(seq.root, plan.restore)
        return True
    if plan.damaged is not None:
        shutil.rmtree(plan.damaged) if plan.damaged.is_dir() else plan.damaged.unlink(missing_ok=True)
        return True
    return False


def check(seq: Seq, plan: Plan, depth: int = 0) -> tuple[str | None, bool]:
    """``tpgrpo run``, then (a) artifacts = reference, (b) ``dvc status`` clean, (c) what ran. Returns
    (the first failure or None, whether the sequence may go on)."""
    if plan.failure:
        return plan.failure, False
    marks, before = plan.marks or h.stage_marks(seq.root), h.digests(seq.root)
    done = h.tpgrpo(seq.root, "run")
    if done.returncode != 0:
        if not (plan.may_refuse and h.one_line_error(done)):
            return f"tpgrpo run failed (rc {done.returncode}): {done.stderr.strip()[-800:]}", False
        refusal = done.stderr.strip()
        if plan.damaged is not None and plan.damaged.name not in refusal and plan.damaged.parent.name not in refusal:
            return f"refusal does not name the damaged {plan.damaged.name}: {refusal}", False
        after = h.digests(seq.root)
        if after != before:
            changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
            return f"refused ({refusal}) but changed {changed[:4]}", False
        if not _undo(seq, plan) or depth:
            return None, False
        if plan.damaged is not None:  # the user deleted the damaged artifact: the next run must rebuild it
            return check(seq, Plan(plan.what + "; deleted after refusal", plan.allowed, marks=marks), depth + 1)
        return _verify(seq, marks, set(), set())
    return _verify(seq, marks, plan.allowed, plan.required, restored(done.stdout))


def restored(output: str) -> set[str]:
    """Stages DVC restored from its run cache instead of running (their cached logs come back too)."""
    return set(re.findall(r"Stage '([\w-]+)' is cached - skipping run", output))


def _verify(seq: Seq, marks: dict, allowed: set[str] | None, required: set[str],
            restores: frozenset | set = frozenset()) -> tuple[str | None, bool]:
    problems = h.compare(h.digests(seq.root), seq.refs.get(seq.root))
    if problems:
        return f"(a) {len(problems)} artifacts differ from a run from scratch: {problems[:4]}", False
    status = h.dvc_status(seq.root)
    if status != "{}":
        return f"(b) dvc status not clean: {status[:600]}", False
    ran, rewritten = h.ran_between(marks, h.stage_marks(seq.root))
    ran -= set(restores)
    extra = sorted(ran - with_block_stages(allowed)) if allowed is not None else []  # ran for sure
    missing = sorted(required - ran - rewritten)  # not even rewritten
    if extra or missing:
        return f"(c) ran {sorted(ran)}; not affected by the change: {extra}; should have re-run: {missing}", False
    return None, True


def with_block_stages(allowed: set[str]) -> set[str]:
    """``allowed`` with each sealed block's stage (``iters-0001-0002``) standing for the stages it re-runs:
    ``ran`` comes from the stages' logs, and ``tpgrpo block`` rewrites every one of its iterations' logs."""
    inner = set()
    for name in allowed:
        if m := re.fullmatch(r"iters-(\d{4})-(\d{4})", name):
            inner |= {f"{kind}-{i:04d}" for i in range(int(m[1]), int(m[2]) + 1)
                      for kind in ("rollout", "probe", "credit", "update", "eval")}
    return allowed | inner


@dataclass
class Result:
    seed: int
    steps: list[str]
    failure: str | None = None
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        return self.failure is None


def new_project(root: Path, model_dir: Path, code_src: Path, refs: h.References) -> str | None:
    """A fresh tiny project run from scratch (its digests are the reference for its params and code);
    None, or why it failed."""
    from conftest import tiny_params

    # split steps that fit the tiny schedule (T = 4), so turning tree.enabled on gives a valid params file
    h.make_project(root, model_dir, code_src, tiny_params(train=dict(BASE_TRAIN), tree={"split_steps": "0,1"}))
    done = h.tpgrpo(root, "run")
    if done.returncode != 0:
        return f"first run failed: {done.stderr.strip()[-800:]}"
    key = refs.key(root)
    if not (refs.folder / f"{key}.json").is_file():
        refs.store(key, h.digests(root))
    status = h.dvc_status(root)
    return None if status == "{}" else f"(b) after the first run: {status[:600]}"


def copy_project(template: Path, root: Path) -> None:
    """A copy of a project that has run (``cp -a``: hard links between workspace and cache stay links,
    mtimes stay; DVC re-hashes by inode, so the copy behaves as the original would)."""
    subprocess.run(["cp", "-a", str(template), str(root)], check=True)


def run_sequence(root: Path, template: Path, refs: h.References, seed: int, length: int,
                 actions: list[str]) -> Result:
    """One seeded sequence of ``length`` actions drawn from ``actions`` on a copy of ``template`` (a project
    :func:`new_project` made and ran), each action followed by the checks."""
    started = time.time()
    result = Result(seed, [])
    try:
        copy_project(template, root)
        seq = Seq(root, refs, random.Random(seed))
        for _ in range(length):
            name = seq.rng.choice(actions)
            plan = ACTIONS[name](seq)
            result.steps.append(plan.what)
            try:
                result.failure, go_on = check(seq, plan)
            except RuntimeError as exc:  # the reference from scratch failed: that is a finding too
                result.failure, go_on = str(exc), False
            if result.failure or not go_on:
                if not result.failure:
                    result.steps.append("(refused with one line; nothing to undo: sequence ends, held)")
                break
    finally:
        h.end_processes(root)
        result.seconds = time.time() - started
    return result


def describe(result: Result) -> str:
    lines = [f"sequence seed {result.seed}: {'held' if result.held else 'FAILED'} ({result.seconds:.0f} s)"]
    lines += [f"  {k + 1}. {step}" for k, step in enumerate(result.steps)]
    if result.failure:
        lines.append(f"  first failure: {result.failure}")
    return "\n".join(lines)
