"""`tpgrpo status`: one screen on where a run stands, read from the files the stages leave.

Which iterations are done (every stage's JSON written), which stage runs now or failed last (the CLI keeps
``data/.last_stage.json``), the latest held-out reward against the base model's, and disk per iteration.
Reads only small JSON files and directory sizes, so it stays fast at 1,000 iterations.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.pipeline.dvc_integration.dvclock import pid_state
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import seal_files
from tpgrpo.stage_params import BASELINE_LOG, DONE, outputs_read_by

ITERATION_FILES = outputs_read_by(DONE)  # the stage logs that make an iteration done
LAST_STAGE = Path("data") / ".last_stage.json"


def record_stage(root: Path, stage: str, iteration: int | None, state: str, error: str = "",
                 enabled: bool = True) -> None:
    """Note the stage the CLI starts or ends (``state`` running | done | failed) for ``tpgrpo status``.

    Best effort: a read-only project or a full disk must not fail the stage itself. But the note must not
    lie: when the new one cannot be written beside the old (a full disk), the old one is rewritten in place
    (truncating frees its block), and failing that left empty, which ``tpgrpo status`` reports as unknown
    instead of naming the previous stage's state.
    """
    if not enabled:
        return
    payload = {"stage": stage, "iteration": iteration, "state": state, "pid": os.getpid(),
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "error": error}
    text = json.dumps(payload) + "\n"
    path = root / LAST_STAGE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
        return
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if path.exists():
        with contextlib.suppress(OSError), open(path, "w") as f:  # truncated first: empty if the write fails
            f.write(text)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie): the same test the stale-lock check uses."""
    return pid_state(pid) not in (None, "Z")


def folder_bytes(folder: Path) -> int:
    """Bytes of every file below ``folder`` (0 if it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


@dataclass(frozen=True)
class IterationState:
    iteration: int
    done: bool          # every stage of the iteration wrote its JSON
    stages: tuple[str, ...]  # the stages that did
    bytes: int


def iteration_states(root: Path, planned: int) -> list[IterationState]:
    """State of iterations 1..max(planned, highest folder on disk)."""
    iters = root / "data" / "iters"
    on_disk = [int(p.name) for p in iters.glob("[0-9]" * 4)] if iters.is_dir() else []
    states = []
    for i in range(1, max([planned, *on_disk]) + 1):
        folder = IterationPaths(root, i).folder
        stages = tuple(f.split(".")[0] for f in ITERATION_FILES if (folder / f).is_file())
        states.append(IterationState(i, len(stages) == len(ITERATION_FILES), stages, folder_bytes(folder)))
    return states


def done_iterations(root: Path, planned: int) -> list[int]:
    """The iterations whose every stage wrote its JSON."""
    return [s.iteration for s in iteration_states(root, planned) if s.done]


def describe_done(root: Path, planned: int) -> str:
    """``"1-3, 5"`` or ``"none"``."""
    return _ranges(done_iterations(root, planned))


def check_iteration(cfg, root: Path, iteration: int | None) -> None:
    """Refuse an iteration outside 1..train.iterations with one line naming the iterations this run has."""
    planned = cfg.train.iterations
    if iteration is None or 1 <= iteration <= planned:
        return
    done = describe_done(root, planned)
    raise PipelineError(f"--iter {iteration}: this run has iterations 1..{planned} (train.iterations = {planned}; "
                        f"finished: {done})")


def stage_params(params: Path, name: str, missing_ok: bool = False) -> dict | None:
    """``{dotted key: value}`` of every leaf under the params dvc.yaml lists for stage ``name`` (all of
    params.yaml for a stage it does not list), read as DVC reads YAML (1.2: ``1e-5`` is a number, for
    PyYAML a string). ``missing_ok``: None when params.yaml is missing or unreadable."""
    from dvc.utils.serialize import parse_yaml

    from tpgrpo.stage_params import stage_inputs

    try:
        raw = parse_yaml(Path(params).read_text(), str(params))
    except Exception:  # noqa: BLE001 - missing, not YAML: load_config says what is wrong
        if missing_ok:
            return None
        raise
    raw = raw if isinstance(raw, dict) else {}
    keys = stage_inputs(name, raw)  # the tree section only while params.yaml switches it on
    if keys is None:
        return flat_params(raw)
    selected = {}
    for key in keys:
        value = raw
        for part in key.split("."):
            value = value.get(part, "<absent>") if isinstance(value, dict) else "<absent>"
        selected[key] = value
    return flat_params(selected)


def flat_params(values: dict) -> dict:
    """``{"eval": {...}, "task.reward": x}`` (params.yaml's sections, a dvc.lock entry's params) as dotted
    leaves: ``{"eval.num_steps": 4, ..., "task.reward": x}``."""
    flat: dict = {}

    def leaves(key: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                leaves(f"{key}.{k}", v)
        else:
            flat[key] = value

    for key, value in values.items():
        leaves(str(key), value)
    return flat


def check_params_unchanged(params: Path, name: str, label: str, read: dict) -> None:
    """A stage reads params.yaml when it starts, DVC records it when the stage exits: fail (DVC then records
    nothing) when a value the stage depends on changed in between."""
    try:
        now = stage_params(params, name)
    except Exception:  # noqa: BLE001 - unreadable now (being edited): not what the stage read either
        now = {"(params.yaml unreadable)": None}
    changed = sorted(k for k in set(read) | set(now) if read.get(k, "<absent>") != now.get(k, "<absent>"))
    if changed:
        raise PipelineError(f"params.yaml changed while stage {label} ran ({', '.join(changed[:3])}"
                            f"{', ...' if len(changed) > 3 else ''}): its outputs are not recorded; run again")


def check_outputs_cached(root: Path, env: dict[str, str], targets: list[str] | None = None) -> None:
    """After ``dvc repro``: every output DVC recorded is in its cache and the workspace (``dvc status`` of
    ``targets``, e.g. ``dvc.yaml`` when only its stages ran; all when empty). DVC that cannot store an output
    (a full disk: it logs "failed to transfer") still records the stage and goes on; this fails with one line
    naming the first such output instead. About one ``dvc status``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", *(targets or [])], cwd=root, env=env,
                          capture_output=True, text=True)
    try:
        report = json.loads(done.stdout or "{}") if done.returncode == 0 else None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise PipelineError(f"dvc status after dvc repro failed (exit code {done.returncode}): {last}")
    bad = [f"{stage}'s output {path} is {state}" for stage, entries in report.items() for entry in entries
           if isinstance(entry, dict) for path, state in entry.get("changed outs", {}).items()
           if state in ("not in cache", "deleted")]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise PipelineError(f"dvc repro recorded stages it could not store: {bad[0]}{more} (DVC logs 'failed to "
                            "transfer', e.g. on a full disk); free disk space and run `tpgrpo run` again")


def dvc_up_to_date(root: Path) -> bool:
    """Whether ``dvc status`` finds every stage of the project at ``root`` up to date (False when it fails)."""
    import subprocess
    import sys

    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, env=env,
                          capture_output=True, text=True)
    try:
        return done.returncode == 0 and json.loads(done.stdout or "null") == {}
    except ValueError:
        return False


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts, start = [], None
    for k, n in enumerate(numbers):
        if start is None:
            start = n
        if k + 1 == len(numbers) or numbers[k + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts) or "none"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def _last_stage_line(root: Path) -> str:
    path = root / LAST_STAGE
    if not path.is_file():
        return "last stage: none recorded yet"
    try:
        last = json.loads(path.read_text())
        last["stage"], last["state"], last["time"]
    except (OSError, ValueError, KeyError, TypeError):
        return (f"last stage: unknown ({LAST_STAGE} is empty or unreadable: a stage could not record its "
                "state, e.g. on a full disk; see the output of the run)")
    name = last["stage"] + ("" if last.get("iteration") is None else f" --iter {last['iteration']}")
    state = last["state"]
    if state == "running" and not _alive(int(last["pid"])):
        state = "killed (its process is gone)"
    line = f"last stage: {name}: {state} (started or ended {last['time']})"
    return line + (f"\n  error: {last['error']}" if last.get("error") else "")


def _reward_line(root: Path, states: list[IterationState]) -> str:
    base_file = root / BASELINE_LOG
    base = json.loads(base_file.read_text()) if base_file.is_file() else None
    evaluated = []  # the latest evaluated iteration, if any
    for s in reversed(states):
        m = json.loads(IterationPaths(root, s.iteration).eval_metrics.read_text()) if "eval" in s.stages else {}
        if m.get("evaluated"):
            evaluated.append((s.iteration, m))
            break
    if base is None:
        return "held-out reward: base model not evaluated yet (stage baseline)"
    line = f"held-out reward: base {base['eval_reward']:.3f} (strict {base['eval_strict_accuracy']:.3f})"
    if not evaluated:
        return line + "; no iteration evaluated yet"
    i, m = evaluated[0]
    gain = m["eval_reward"] - base["eval_reward"]
    return line + (f" -> iteration {i}: {m['eval_reward']:.3f} (strict {m['eval_strict_accuracy']:.3f}), "
                   f"{gain:+.3f}")


def status_text(root: Path, planned: int) -> str:
    """The whole screen, a handful of lines at any run length."""
    states = iteration_states(root, planned)
    done = [s.iteration for s in states if s.done]
    partial = [s for s in states if s.stages and not s.done]
    sizes = [s.bytes for s in states if s.stages]
    lines = [f"iterations: {len(done)} of {planned} done ({_ranges(done)})"]
    lines += [f"  iteration {s.iteration}: partly done ({', '.join(s.stages)})" for s in partial[:3]]
    lines.append(_last_stage_line(root))
    lines.append(_reward_line(root, states))
    sealed = sorted(seal_files(root))
    if sealed:
        iters = [i for b in sealed for i in b.iterations]
        lines.append(f"dvc: iterations {_ranges(iters)} sealed in {len(sealed)} block stages (data/seals); "
                     "`tpgrpo retain` drops what params.yaml's retention does not keep")
    if sizes:
        lines.append(f"disk: {_mb(sum(sizes))} in {len(sizes)} iteration folders; per iteration mean "
                     f"{_mb(sum(sizes) // len(sizes))}, largest {_mb(max(sizes))}, latest {_mb(sizes[-1])}")
    else:
        lines.append("disk: no iteration folders yet")
    return "\n".join(lines)
