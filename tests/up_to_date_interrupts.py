"""User actions that interrupt ``tpgrpo run`` (a SIGKILL at a random moment or at a file-system change of the
unsealing, a Ctrl-C) or edit params.yaml while it runs; the check after each is the harness's, as for
:mod:`up_to_date_actions`' changes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import up_to_date_harness as h
from up_to_date_actions import (GRACE_S, LEAF, UPSTREAM, Plan, Seq, _edit, delete, edit_code, edit_leaf, edit_upstream,
                                iterations)


def _start_run(seq: Seq) -> subprocess.Popen:
    """``tpgrpo run`` in the project, in its own process group (a kill reaches everything it started)."""
    return subprocess.Popen([sys.executable, "-m", "tpgrpo", "run"], cwd=seq.root, env=h.env(seq.root),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _edit_during_a_run(seq: Seq) -> tuple[Plan, dict, subprocess.Popen, Plan]:
    """An upstream edit, then ``tpgrpo run`` started, then another param edited 1-20 s into it: the first
    edit's plan, the stage marks from before the run, the running process and the second edit's plan."""
    plan = edit_upstream(seq)
    marks = h.stage_marks(seq.root)
    proc = _start_run(seq)
    time.sleep(seq.rng.uniform(1.0, 20.0))
    return plan, marks, proc, _edit(seq, {**UPSTREAM, **LEAF}, "during the run:")


def _kill_during(seq: Seq, plan: Plan) -> Plan:
    """Start ``tpgrpo run`` after ``plan``'s change, SIGKILL its process group at a random moment, wait
    for it to be reaped; nothing it started may run on."""
    marks = h.stage_marks(seq.root)
    proc = _start_run(seq)
    delay = seq.rng.uniform(1.0, 25.0)
    try:
        proc.wait(timeout=delay)
        outcome = f"run ended by itself before {delay:.1f} s"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        outcome = f"SIGKILL at {delay:.1f} s"
    deadline = time.time() + GRACE_S  # a server polling for its parent's death may take a moment
    while (left := h.processes_in(seq.root)) and time.time() < deadline:
        time.sleep(0.5)
    plan.marks, plan.required = marks, set()
    plan.what = f"{plan.what}; run, {outcome}"
    if left:
        plan.failure = f"still running in the project {GRACE_S} s after the group kill: {left[:3]}"
        h.end_processes(seq.root)
    return plan


def sigkill(seq: Seq) -> Plan:
    change = seq.rng.choice([edit_upstream, edit_leaf, delete, edit_code, iterations])
    return _kill_during(seq, change(seq))


def edit_during_run(seq: Seq) -> Plan:
    """Start a run after an upstream edit and edit another param while it runs (items 2 and 6): the run
    after must still give the current params' artifacts."""
    plan, marks, proc, second = _edit_during_a_run(seq)
    proc.wait()
    return Plan(f"{plan.what}; run; {second.what} (run rc {proc.returncode})", None, marks=marks,
                may_refuse=seq.retained)


KILLER = Path(__file__).resolve().parent / "kill_points.py"  # SIGKILL at the k-th file-system change


def _dvc_works(root: Path) -> str | None:
    """None when `dvc status` and `dvc dag` (the whole graph, as `dvc repro` builds it) work in ``root``."""
    for args in (("status", "--json"), ("dag",)):
        done = h.sh(root, sys.executable, "-m", "dvc", *args)
        if done.returncode != 0:
            return f"dvc {args[0]} fails right after: {done.stderr.strip()[-400:]}"
    return None


def kill_unsealing(seq: Seq) -> Plan:
    """Edit a param the sealed block's stages read, then `tpgrpo run`, SIGKILLed at a random file-system change
    (1-8) its unsealing makes (tests/kill_points.py): DVC must work right after, and the next run finish clean."""
    plan = _edit(seq, {**UPSTREAM, **LEAF}, "edit param")
    marks, at = h.stage_marks(seq.root), seq.rng.randint(1, 8)
    done = h.sh(seq.root, sys.executable, str(KILLER), "--at", str(at), "--within",
                "tpgrpo.pipeline.long_runs.sealing:unseal_changed", "-m", "tpgrpo", "run")
    outcome = "SIGKILL" if done.returncode == -signal.SIGKILL else f"ended by itself (rc {done.returncode})"
    h.end_processes(seq.root)
    plan.marks, plan.required = marks, set()
    plan.what = f"{plan.what}; run, {outcome} at unsealing's change {at}"
    plan.failure = _dvc_works(seq.root)
    return plan


def edit_then_interrupt(seq: Seq) -> Plan:
    """Start a run after an upstream edit, edit another param while it runs, then interrupt it: Ctrl-C (SIGINT to
    its process group) or SIGKILL, at a random moment. An edit DVC recorded after its stage read params.yaml must
    not stay recorded as what the stage ran with: the next run gives the current params' artifacts."""
    plan, marks, proc, second = _edit_during_a_run(seq)
    how = seq.rng.choice([signal.SIGINT, signal.SIGKILL])
    try:
        proc.wait(timeout=seq.rng.uniform(0.0, 8.0))
        outcome = f"run ended by itself (rc {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, how)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a Ctrl-C the run did not act on is a finding: kill, then report
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Plan(f"{plan.what}; {second.what}; SIGINT not acted on in 60 s", None,
                        failure="tpgrpo run went on 60 s after Ctrl-C")
        outcome = f"{signal.Signals(how).name} (rc {proc.returncode})"
    deadline = time.time() + GRACE_S
    while (left := h.processes_in(seq.root)) and time.time() < deadline:
        time.sleep(0.5)
    failure = f"still running {GRACE_S} s after the interruption: {left[:3]}" if left else _dvc_works(seq.root)
    h.end_processes(seq.root)
    return Plan(f"{plan.what}; run; {second.what}; {outcome}", None, marks=marks, may_refuse=seq.retained,
                failure=failure)


INTERRUPTS = {f.__name__: f for f in (sigkill, edit_during_run, kill_unsealing, edit_then_interrupt)}
