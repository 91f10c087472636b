"""Base weights that stay loaded across the model stages of a run (``launch.resident_model``).

Why: every model stage (rollout, probe, update, eval) is its own process and loaded the model folder again:
3.5 s a load for SD3.5-M on this CPU, about 12 s of a 48 s paper-sized H200 iteration on paper. With the stage
server (:mod:`tpgrpo.pipeline.execution.stage_server`), which already forks every stage process from one that imported
the libraries, the server also loads the run's base model once (:func:`hold`), before it forks. A forked
stage then takes that backend (:func:`take`) instead of reading the folder: it is the child's own copy-on-write
copy, so what the stage does to it (a LoRA attached, gradients, text encoders freed) stays in that stage's
process, and the base weights' pages, never written, stay shared.

What keeps it honest: a stage takes the held backend only when it asks for exactly what was loaded (kind,
folder, device, dtype, resolution) and every file under the folder has the size, mtime and inode it had
when the server loaded it (:func:`folder_stamps`); otherwise it loads from disk, as without the server. It is
taken at most once per process (a second load in the same stage reads the folder). The holder itself never
takes it: only a process forked from the holder does.

On a GPU (``model.device`` cuda, opted in with ``launch.resident_model``): the server still holds the weights on
the CPU, and never initialises CUDA (a process forked after that cannot use it; the server checks before each
fork). A GPU stage forked from it moves its own copy to the GPU (:func:`take`, :func:`movable`): a host-to-device
copy instead of reading the folder. Not yet run on a GPU (docs/long-runs.md).
"""

from __future__ import annotations

import os
from pathlib import Path

_held: dict = {}  # {"key": ..., "stamps": ..., "backend": ..., "holder": pid}


def model_key(kind: str, path, device: str, dtype, resolution) -> tuple:
    """What a load asks for: ``(kind, absolute folder, device, dtype name, resolution or 0)``."""
    return (kind, str(Path(os.fspath(path)).resolve()), str(device), str(dtype), int(resolution or 0))


def folder_stamps(path) -> tuple:
    """``((relative path, size, mtime_ns, inode), ...)`` of every file under ``path``, sorted: any rewrite,
    replacement or new file changes it (stat only, no hashing: milliseconds for a model folder)."""
    root = Path(os.fspath(path)).resolve()
    stamps = []
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            st = os.stat(full)
            stamps.append((os.path.relpath(full, root), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(stamps))


def hold(load, kind: str, path, device: str = "cpu", dtype="fp32", resolution: int | None = None) -> None:
    """Load the backend once in this process (the stage server, before it forks), for its forked children.
    ``load``: :func:`tpgrpo.models.load_backend` (passed in: that module imports this one)."""
    key = model_key(kind, path, device, dtype, resolution)
    stamps = folder_stamps(path)  # before the load: a file rewritten during it no longer matches
    backend = load(kind, path, device, dtype, resolution=resolution)
    _held.clear()
    _held.update(key=key, stamps=stamps, backend=backend, holder=os.getpid())


def release() -> None:
    """Forget the held backend (tests; a server that stops holding)."""
    _held.clear()


def take(kind: str, path, device: str, dtype, resolution) -> object | None:
    """The held backend when this process was forked from its holder and asks for exactly what it holds,
    with the folder unchanged since; else None (load from disk). Handed out once per process. A backend held
    on the CPU also serves a request for another device (a GPU stage): this process moves its own copy there
    (:meth:`tpgrpo.models.base.FlowBackend.to_device`), the server's pages stay as they were."""
    if not _held or _held["holder"] == os.getpid():
        return None
    asked = model_key(kind, path, device, dtype, resolution)
    if not (asked == _held["key"] or movable(_held["key"], asked)):
        return None
    try:
        if folder_stamps(path) != _held["stamps"]:
            _held.clear()
            return None
    except OSError:
        return None
    backend, same = _held["backend"], asked == _held["key"]
    _held.clear()
    return backend if same else backend.to_device(device)


def movable(held: tuple, asked: tuple) -> bool:
    """Whether a backend held as ``held`` (a :func:`model_key`) serves ``asked`` by moving: held on the CPU,
    asked on another device, everything else the same."""
    return held[2] == "cpu" and asked[2] != "cpu" and held[:2] + held[3:] == asked[:2] + asked[3:]


def held_key() -> tuple | None:
    """What this process holds (or inherited and has not taken yet), for logs and tests."""
    return _held.get("key")


def hold_for_stages(load, model: dict | None) -> str:
    """What the stage server does with :func:`spec`'s ``model``: load it for the stages it forks (:func:`hold`;
    ``load`` is :func:`tpgrpo.models.load_backend`, passed in as there), and say what it holds, for its log. A
    failure is logged, not raised: the stages then load it themselves (and report a bad folder as they always
    did)."""
    if not model:
        return "none"
    import torch

    # Loaded on one thread: a torch op on more starts OpenMP's thread pool in this process, and a stage forked
    # after that hangs in its first parallel op (libgomp's pool does not survive fork: a 2-thread `make run`
    # stopped in its first model stage). With one thread no pool is started, and each forked stage starts its
    # own at the run's thread count (tests/test_resident_model.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hold(load, **model)
    except Exception as exc:  # noqa: BLE001 - the stage's own load gives the user the error
        return f"none ({type(exc).__name__}: {exc})"
    finally:
        torch.set_num_threads(threads)
    return f"{model['kind']} {model['path']} ({model['dtype']})"


def spec(cfg, root: Path) -> dict | None:
    """What the stage server loads for the stages (``launch.resident_model``): the ``model`` params' folder,
    kind, dtype and resolution, on the CPU whatever ``model.device`` says (the server never initialises CUDA:
    a GPU stage moves its forked copy, :func:`take`); None when off."""
    from tpgrpo.stage_common import resolve

    if not cfg.launch.resident_model:
        return None
    return {"kind": cfg.model.kind, "path": str(resolve(root, cfg.model.path)), "device": "cpu",
            "dtype": cfg.model.dtype, "resolution": cfg.model.resolution}
