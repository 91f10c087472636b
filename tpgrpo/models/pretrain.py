"""Pretraining of the embedded tiny model: rectified flow on procedurally rendered task images.

Each step draws a batch of TRAIN prompts of the chosen tasks (task first, uniformly, then a prompt),
renders a fresh clean image for each (``tpgrpo.tasks.render.render_prompt``, random placement) and
fits ``v(x_s, s, prompt) ~ noise - x0`` at ``x_s = (1 - s) x0 + s noise``, ``s ~ logit-normal(m, 1)``
(SD3: m = 0, most weight at mid noise; ``noise_mean``). 10% of prompts become "" so classifier-free guidance has
an unconditional model. The text encoder trains jointly. Everything random comes from ``seed``
(numpy for data, a torch Generator for noise), so a run with ``steps`` is reproducible bit for bit;
a ``minutes`` budget makes the step count (and so the lr schedule) depend on the machine's speed.

Devices as in ``tpgrpo.algo.trajectory``: the model and every tensor of a step live on ``device``; the data
(numpy) and the noise (a CPU generator) are drawn on the CPU and moved there, so a seed gives the same
draws on any device; the weights are saved from wherever they are.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Callable, Optional, Sequence

import numpy as np
import typer

# A data source: (numpy Generator, batch size) -> (prompts list[str], images uint8 (B, H, W, 3)).
DataFn = Callable[[np.random.Generator, int], tuple[list[str], np.ndarray]]
LOG_FIELDS = ("step", "loss", "lr", "elapsed_s", "steps_per_s")


def task_data(tasks: Sequence[str] = ("compositional", "text"), prompt_seed: int = 0,
              image_size: int = 32) -> DataFn:
    """The default data source: TRAIN prompts of ``tasks`` rendered on the fly."""
    from tpgrpo.tasks.prompts import build_prompt_sets
    from tpgrpo.tasks.render import render_prompt

    sets = build_prompt_sets(seed=prompt_seed)
    pools = []
    for task in tasks:
        key = f"{task}_train"
        if key not in sets or not sets[key]:
            raise ValueError(f"unknown or empty task {task!r}: no prompts under {key!r}")
        pools.append(sets[key])

    def draw(rng: np.random.Generator, batch: int) -> tuple[list[str], np.ndarray]:
        which = rng.integers(len(pools), size=batch)
        metas = [pools[t][int(rng.integers(len(pools[t])))] for t in which]
        images = np.stack([render_prompt(m, rng, size=image_size) for m in metas])
        return [m["prompt"] for m in metas], images

    return draw


def lr_at(progress: float, lr: float, warmup: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over the first ``warmup`` fraction of training, then cosine to ``min_ratio*lr``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return lr * progress / warmup
    frac = (progress - warmup) / max(1e-12, 1.0 - warmup)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def flow_loss(backend, x0, prompts: list[str], generator, dropout: float = 0.0, noise_mean: float = 0.0):
    """Rectified-flow MSE ``mean |v(x_s, s) - (noise - x0)|^2`` for a batch, with gradient.

    ``x0`` is ``(B, C, H, W)`` in [-1, 1] on the backend's device; noise, ``s`` and the dropout draw come
    from ``generator`` (a CPU ``torch.Generator``) in that fixed order and are moved to ``x0``'s device.
    ``s = sigmoid(N(noise_mean, 1))``: a positive mean weights the high noise levels, where layouts form.
    """
    import torch

    batch = x0.shape[0]
    drop = torch.rand(batch, generator=generator) < dropout
    prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
    noise = torch.randn(x0.shape, generator=generator).to(x0.device)
    s = torch.sigmoid(torch.randn(batch, generator=generator) + noise_mean).to(x0.device)
    s4 = s.view(-1, 1, 1, 1)
    x_s = (1.0 - s4) * x0 + s4 * noise
    hidden, pooled = backend.encode_text(prompts)
    v = backend.predict(x_s, s, hidden, pooled)
    return torch.mean((v - (noise - x0)) ** 2)


class _Ema:
    """Exponential moving average of parameters (decay warmed up as ``(1+n)/(10+n)``)."""

    def __init__(self, params, decay: float):
        self.params, self.decay, self.n = list(params), decay, 0
        self.shadow = [p.detach().clone() for p in self.params]

    def update(self) -> None:
        import torch

        self.n += 1
        d = min(self.decay, (1.0 + self.n) / (10.0 + self.n))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - d)

    def swap(self) -> None:
        """Exchange live and averaged weights (call twice to restore)."""
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.data.copy_(s)
            s.copy_(tmp)


def _atomic_save(backend, out_dir: Path, info: dict, log_rows: list[dict]) -> None:
    """Save model + ``pretrain.json`` + ``pretrain_log.csv`` to a temp folder, then rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    backend.save_pretrained(tmp)
    (tmp / "pretrain.json").write_text(json.dumps(info, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_FIELDS)
    writer.writeheader()
    writer.writerows(log_rows)
    (tmp / "pretrain_log.csv").write_text(buf.getvalue())
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def pretrain(out_dir, *, seed: int = 0, minutes: float | None = None, steps: int | None = None,
             batch_size: int = 64, lr: float = 1e-3, warmup: float = 0.03, weight_decay: float = 0.01,
             tasks: Sequence[str] = ("compositional", "text"), log_every: int = 50,
             config=None, ema_decay: float = 0.995, dropout: float = 0.1,
             save_every_minutes: float | None = 10.0, data: DataFn | None = None,
             num_threads: int | None = None, device: str = "cpu", checkpoint: Path | None = None,
             piece_minutes: float | None = None, stop_at_step: int | None = None,
             change_budget: bool = False, init_from: Path | None = None, noise_mean: float = 0.0) -> dict:
    """Train a tiny model from scratch and save it (EMA weights) atomically to ``out_dir``.

    Args:
        out_dir: model folder to write (replaced as a whole at each save).
        seed: seeds the initial weights, the data order and the noise.
        minutes / steps: wall-clock budget (minutes) and/or optimizer steps; training stops at whichever comes
            first; at least one is required. The lr schedule follows the fraction of the budget used.
        batch_size: images per optimizer step.
        lr, warmup, weight_decay: AdamW peak lr, warmup as a fraction of the budget, weight decay.
        tasks: task names whose ``<task>_train`` prompts are rendered (ignored if ``data`` given).
        log_every: steps between log lines (stdout) and CSV rows (mean loss over the window).
        config: a ``TinyConfig`` (default: the measured ~3.5M-parameter model).
        ema_decay: EMA decay of the saved weights (0 saves the live weights).
        dropout: probability of replacing a prompt by "" (for classifier-free guidance).
        save_every_minutes: write the resumable checkpoint every so many minutes (None: only at a piece's end).
            The model folder is written once, when the run completes.
        data: optional data source (see ``DataFn``) replacing the rendered task prompts.
        num_threads: ``torch.set_num_threads`` if given.
        device: torch device to train on (e.g. ``cuda``); the same seed gives the same draws everywhere.
        checkpoint: the resumable checkpoint file (default ``data/.base.pretrain-ckpt.pt`` for
            ``data/base``); when it exists the run resumes from it (same seed, budget and settings required).
        piece_minutes: stop after this many minutes of this process, leaving the checkpoint to resume
            from (``complete: false`` in the returned dict, nothing written to ``out_dir``).
        stop_at_step: stop (as a piece does) once this many steps are done: a reproducible piece boundary.
        change_budget: resume a checkpoint written under another ``steps`` budget; the lr schedule
            follows the new budget from there, recorded as ``budget_changes`` in ``pretrain.json``.
        init_from: a saved tiny model folder to start from (a second phase with its own schedule) instead of
            fresh weights; its configuration is the run's, and what it was (its ``pretrain.json`` and weights'
            md5) is recorded as ``hparams.init_from``.
        noise_mean: the noise levels are ``sigmoid(N(noise_mean, 1))`` (0: logit-normal(0, 1), SD3's; 1.5 taught
            the shipped base left from right, which 0 had not).
    Returns: the ``pretrain.json`` dict (steps, minutes, seed, final_loss, config, ...).
    """
    from tpgrpo.models.pretrain_checkpoint import default_checkpoint_path, load_checkpoint

    if minutes is None and steps is None:
        raise ValueError("pretrain needs a budget: give minutes and/or steps")
    hparams = {"batch_size": batch_size, "lr": lr, "warmup": warmup, "weight_decay": weight_decay, "tasks": list(tasks),
               "ema_decay": ema_decay, "dropout": dropout, "t_sampling": f"logit_normal({noise_mean:g},1)",
               "noise_mean": noise_mean, "grad_clip": 1.0, "custom_data": data is not None}
    run = _new_run(Path(out_dir), seed, hparams, steps, minutes, config, device, init_from, num_threads)
    draw = data or task_data(tasks, image_size=run.backend.config.image_size)
    rng = np.random.default_rng(seed)
    ckpt = Path(checkpoint) if checkpoint else default_checkpoint_path(Path(out_dir))
    if ckpt.exists():
        run.resume_from(load_checkpoint(run, rng, ckpt, change_budget))
        print(f"pretrain: resumed from {ckpt} at step {run.n_steps}", flush=True)
    if not _train_until_done(run, draw, rng, ckpt, batch_size, log_every, save_every_minutes, piece_minutes,
                             stop_at_step):
        return run.info(complete=False)
    return _finish(run, ckpt, out_dir)


def _new_run(out_dir: Path, seed: int, hparams: dict, steps, minutes, config, device: str, init_from, num_threads):
    """The run at step 0, torch's threads and seed set first. Its model: fresh weights from ``seed`` (``config``,
    default the shipped size), or the saved model ``init_from`` (:func:`_start_from`, recorded in ``hparams``)."""
    import torch

    from tpgrpo.models.tiny import TinyBackend, TinyConfig, build_tiny

    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    if init_from is not None:
        backend, hparams["init_from"] = _start_from(Path(init_from), config, device)
    else:
        built = build_tiny(config := config or TinyConfig(), seed=seed)  # on the CPU: the same weights anywhere
        backend = TinyBackend(built.transformer, built.text_encoder, built.tokenizer, config, device=device)
    return _Run(backend, out_dir, seed, hparams, steps, minutes)


def _finish(run, ckpt: Path, out_dir) -> dict:
    """Log the last window, save the model folder and delete the checkpoint; returns the ``pretrain.json`` dict."""
    if run.window:
        run.log()
    info = run.save(complete=True)
    ckpt.unlink(missing_ok=True)
    print(f"pretrain: saved {out_dir} after {info['steps']} steps, loss {info['final_loss']}", flush=True)
    return info


def _start_from(folder: Path, config, device: str):
    """The tiny model saved in ``folder`` as this run's starting weights, and what to record of it: its
    ``pretrain.json`` (less the loss log) and the md5 of its weight files. ``config``, when given, must be its."""
    import hashlib

    from tpgrpo.models.tiny import TinyBackend, load_tiny

    parent = load_tiny(folder)  # names the folder when it holds no tiny model
    if config is not None and asdict(config) != asdict(parent.config):
        raise ValueError(f"--init-from {folder}: its configuration differs from the one asked for")
    weights = sorted(folder.glob("*/*.safetensors"))
    digest = hashlib.md5(b"".join(hashlib.md5(w.read_bytes()).digest() for w in weights)).hexdigest()
    info = json.loads((folder / "pretrain.json").read_text()) if (folder / "pretrain.json").is_file() else {}
    record = {"path": str(folder), "weights_md5": digest,
              **{k: info.get(k) for k in ("seed", "steps", "minutes", "final_loss", "hparams", "budget_changes",
                                          "cpu", "threads")}}
    backend = TinyBackend(parent.transformer, parent.text_encoder, parent.tokenizer, parent.config, device=device)
    return backend, record


def _train_until_done(run, draw, rng, ckpt: Path, batch_size: int, log_every: int, save_every_minutes,
                      piece_minutes, stop_at_step) -> bool:
    """Train ``run`` to the end of its budget (True) or to the end of this piece (False, checkpoint written),
    writing the resumable checkpoint every ``save_every_minutes``."""
    from tpgrpo.models.pretrain_checkpoint import save_checkpoint

    piece_start = last_save = time.monotonic()
    while run.progress() < 1.0:
        prompts, images = draw(rng, batch_size)
        run.step(prompts, images)
        if run.n_steps % log_every == 0:
            run.log()
        now = time.monotonic()
        if save_every_minutes and now - last_save > 60.0 * save_every_minutes:
            save_checkpoint(run, rng, ckpt, run.elapsed())
            last_save = now
        piece_over = piece_minutes and now - piece_start > 60.0 * piece_minutes
        if (piece_over or (stop_at_step and run.n_steps >= stop_at_step)) and run.progress() < 1.0:
            save_checkpoint(run, rng, ckpt, run.elapsed())
            print(f"pretrain: piece over at step {run.n_steps}; resume with the same command", flush=True)
            return False
    return True


class _Run:
    """State of one pretraining run: model, AdamW, EMA, noise generator, step count and log."""

    def __init__(self, backend, out_dir: Path, seed: int, hparams: dict, steps, minutes):
        import torch

        self.backend, self.out_dir, self.seed, self.hparams = backend, out_dir, seed, hparams
        self.max_steps, self.minutes = steps, minutes
        self.params = [p for m in backend.modules() for p in m.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=hparams["lr"], weight_decay=hparams["weight_decay"])
        decay = hparams["ema_decay"]
        self.ema = _Ema(self.params, decay) if decay > 0 else None
        self.gen = torch.Generator().manual_seed(seed)  # noise, sigmas and prompt dropout
        self.n_steps, self.window, self.log_rows, self.last_loss = 0, [], [], None
        self.budget_changes: list[dict] = []  # {at_step, from_steps, to_steps} of resumes that changed it
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        """Seconds of training so far, over every piece of a resumed run."""
        return time.monotonic() - self.t0

    def resume_from(self, elapsed_s: float) -> None:
        """Count ``elapsed_s`` seconds of earlier pieces as spent (the state itself is loaded already)."""
        self.t0 = time.monotonic() - elapsed_s

    def progress(self) -> float:
        """Fraction of the budget used: the larger of steps and wall-clock fractions."""
        p_steps = self.n_steps / self.max_steps if self.max_steps else 0.0
        p_time = self.elapsed() / (60.0 * self.minutes) if self.minutes else 0.0
        return max(p_steps, p_time)

    def step(self, prompts: list[str], images: np.ndarray) -> float:
        """One AdamW step on a batch of prompts and ``uint8 (B, H, W, 3)`` images; returns the loss."""
        import torch

        lr = lr_at(self.progress(), self.hparams["lr"], self.hparams["warmup"])
        for group in self.opt.param_groups:
            group["lr"] = lr
        for m in self.backend.modules():
            m.train()
        x0 = self.backend.encode_images(images)
        loss = flow_loss(self.backend, x0, prompts, self.gen, self.hparams["dropout"], self.hparams["noise_mean"])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.hparams["grad_clip"])  # early steps spike
        self.opt.step()
        if self.ema is not None:
            self.ema.update()
        self.n_steps += 1
        self.window.append(float(loss.detach()))
        return self.window[-1]

    def log(self) -> None:
        """Append a CSV row (mean loss over the steps since the last row) and print it."""
        elapsed = time.monotonic() - self.t0
        self.last_loss = float(np.mean(self.window))
        row = {"step": self.n_steps, "loss": round(self.last_loss, 6),
               "lr": f"{self.opt.param_groups[0]['lr']:.3e}", "elapsed_s": round(elapsed, 1),
               "steps_per_s": round(self.n_steps / max(elapsed, 1e-9), 3)}
        self.log_rows.append(row)
        self.window = []
        print("pretrain " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    def info(self, complete: bool) -> dict:
        """The ``pretrain.json`` dict: steps, minutes over every piece, the CPU, settings, sizes."""
        import platform

        import torch

        return {"kind": "tiny", "complete": complete, "seed": self.seed, "steps": self.n_steps,
                "minutes": round(self.elapsed() / 60.0, 3), "final_loss": self.last_loss,
                "config": asdict(self.backend.config), "hparams": self.hparams,
                "parameters": self.backend.num_parameters(), "torch": torch.__version__,
                "cpu": _cpu_model(), "threads": torch.get_num_threads(), "machine": platform.machine(),
                "budget_changes": self.budget_changes}

    def save(self, complete: bool) -> dict:
        """Save the EMA weights (or the live ones) atomically; returns the ``pretrain.json`` dict."""
        for m in self.backend.modules():
            m.eval()
        info = self.info(complete)
        if self.ema is not None:
            self.ema.swap()
        try:
            _atomic_save(self.backend, self.out_dir, info, self.log_rows)
        finally:
            if self.ema is not None:
                self.ema.swap()
        return info


def pretrain_command(
    out_dir: Annotated[Path, typer.Option(help="where to save the base model")] = Path("data/base"),
    seed: Annotated[int, typer.Option(help="training seed (weights, data order, noise)")] = 0,
    minutes: Annotated[Optional[float], typer.Option(help="wall-clock budget, minutes")] = None,
    steps: Annotated[Optional[int], typer.Option(help="optimizer steps; stops at whichever budget ends first")] = None,
    batch_size: Annotated[int, typer.Option(help="images per optimizer step")] = 64,
    device: Annotated[str, typer.Option(help="torch device to train on, e.g. cuda")] = "cpu",
    tasks: Annotated[str, typer.Option(help="comma-separated tasks whose training prompts are rendered")]
        = "compositional",
    piece_minutes: Annotated[Optional[float], typer.Option(
        help="stop after this many minutes, keeping a checkpoint; the same command resumes")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    stop_at_step: Annotated[Optional[int], typer.Option(help="stop once this many steps are done, keeping "
                                                        "a checkpoint (a reproducible piece boundary)")] = None,
    change_budget: Annotated[bool, typer.Option(help="resume a checkpoint of another --steps budget; the lr "
                                                "schedule follows the new one from there (recorded)")] = False,
    init_from: Annotated[Optional[Path], typer.Option(help="start from this saved tiny model's weights (a second "
                                                      "phase; recorded) instead of fresh ones")] = None,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate")] = 1e-3,
    noise_mean: Annotated[float, typer.Option(help="mean of the logit-normal noise levels; > 0 weights the high "
                                              "ones, where layouts (left/right) form")] = 0.0,
) -> None:
    """Pretrain the embedded tiny text-to-image model on rendered task images (resumable)."""
    if minutes is None and steps is None:
        raise typer.BadParameter("give --minutes or --steps")
    pretrain(out_dir, seed=seed, minutes=minutes, steps=steps, batch_size=batch_size, device=device,
             tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), piece_minutes=piece_minutes,
             num_threads=threads, stop_at_step=stop_at_step, change_budget=change_budget, init_from=init_from,
             lr=lr, noise_mean=noise_mean)


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string elsewhere."""
    import platform

    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or "unknown"
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"
