"""``tpgrpo export``: hand an iteration's LoRA adapter to a stock diffusers pipeline.

The update writes ``data/iters/NNNN/policy/`` (and ``policy/ema/`` when ``update.ema`` is true) in the
diffusers + peft adapter format; export copies ``pytorch_lora_weights.safetensors`` (keys
``transformer.<module>.lora_{A,B}.weight`` plus the LoraConfig as diffusers' adapter metadata) and peft's
``adapter_config.json`` to a folder of the user's choice, so that::

    pipe = StableDiffusion3Pipeline.from_pretrained(base_folder)   # or FluxPipeline
    pipe.load_lora_weights(out_folder)

gives the trained policy. No model is loaded; the files are verified against the folder's ``sha256.json``,
checked and copied, each atomically.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tpgrpo.io.artifacts import IterationPaths, atomic_path, first_line, verify_file
from tpgrpo.errors import PipelineError
from tpgrpo.policy.lora import CONFIG_FILE, PREFIX, WEIGHTS_FILE

EMA_FOLDER = "ema"  # in a policy folder: the EMA adapter (tpgrpo.policy.checkpoint writes it)


def adapter_folder(root: Path, iteration: int, ema: bool = False) -> Path:
    """The adapter folder iteration ``iteration``'s update wrote (its EMA adapter with ``ema``).

    One-line ``PipelineError`` when the iteration has no policy, or no EMA adapter.
    """
    policy = IterationPaths(root, iteration).policy
    if not (policy / WEIGHTS_FILE).is_file():
        raise PipelineError(f"iteration {iteration} has no policy: {policy / WEIGHTS_FILE} is missing "
                            f"(run `tpgrpo stage update --iter {iteration}` first)")
    if not ema:
        return policy
    folder = policy / EMA_FOLDER
    if not (folder / WEIGHTS_FILE).is_file():
        raise PipelineError(f"iteration {iteration} has no EMA adapter: {folder / WEIGHTS_FILE} is missing "
                            "(the run had update.ema false; export without --ema)")
    return folder


def _check_weights(path: Path) -> int:
    """Number of LoRA tensors in an adapter file; one-line error unless every key is a transformer LoRA key."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types on a damaged file
        raise PipelineError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None
    bad = [k for k in keys if not (k.startswith(PREFIX) and (".lora_A." in k or ".lora_B." in k))]
    if not keys or bad:
        raise PipelineError(f"{path}: expected {PREFIX}<module>.lora_A/B.weight keys, found "
                            f"{bad[0] if bad else 'no tensors'!r}")
    return len(keys)


def export_adapter(root: Path, iteration: int, out: Path, ema: bool = False) -> dict:
    """Copy iteration ``iteration``'s adapter (or its EMA adapter) into ``out`` (created if needed).

    Each file is written to a temporary name and renamed; other files already in ``out`` are left alone.
    Returns ``{"source", "out", "tensors"}`` for the CLI to report.
    """
    source = adapter_folder(root, iteration, ema)
    for name in (WEIGHTS_FILE, CONFIG_FILE):  # a damaged adapter is not handed on
        if (source / name).is_file():
            verify_file(source / name)
    tensors = _check_weights(source / WEIGHTS_FILE)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PipelineError(f"--out {out} is a file (expected a folder to write {WEIGHTS_FILE} into)")
    if out.resolve() == source.resolve():
        raise PipelineError(f"--out {out} is the policy folder itself (expected another folder)")
    out.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if (source / name).is_file():
            with atomic_path(out / name) as tmp:
                shutil.copyfile(source / name, tmp)
    return {"source": str(source), "out": str(out), "tensors": tensors}
