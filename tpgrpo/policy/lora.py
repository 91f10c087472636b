"""The LoRA policy (spec section 7): attach, save/load, reference mode, EMA of the LoRA weights.

The adapter is added with diffusers' peft integration (``transformer.add_adapter``), so a saved
adapter folder loads both through peft (``attach_lora(..., adapter_dir=folder)``, which reads the
peft ``adapter_config.json`` and sets the weights with ``set_peft_model_state_dict``) and through a
stock diffusers pipeline (``pipe.load_lora_weights(folder)``).

Adapter folder layout (written atomically, temp folder + rename; byte-identical for identical weights in
any process: safetensors header and set-valued config lists in sorted order):
    ``pytorch_lora_weights.safetensors``  LoRA weights, keys ``transformer.<module>.lora_{A,B}.weight``
                                          (+ the LoraConfig as diffusers' adapter metadata)
    ``adapter_config.json``               the peft ``LoraConfig`` (rank, alpha, target modules)
    ``sha256.json``                       the sha256 of each file above, as written; verified on every load
                                          (a damaged or truncated file is one line naming it)

The KL reference of the update is the same network with the adapter disabled (``reference_mode``):
no second copy of the model.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from tpgrpo.io.artifacts import atomic_path, canonicalize_safetensors, first_line, verify_file, write_manifest
from tpgrpo.io.schemas import ArtifactError

ADAPTER_NAME = "default"
WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
CONFIG_FILE = "adapter_config.json"  # peft's CONFIG_NAME
PREFIX = "transformer."  # diffusers' key prefix for the transformer's LoRA layers


def lora_config(rank: int, alpha: int, target_modules: list[str]):
    """The peft ``LoraConfig``: rank ``r``, scale ``alpha / r``, no dropout, ``lora_B = 0`` at init."""
    from peft import LoraConfig

    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA rank must be >= 1 and alpha > 0, got rank={rank}, alpha={alpha}")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, init_lora_weights=True,
                      target_modules=sorted(target_modules))


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_parameters(backend) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every LoRA weight on ``backend.transformer``, in module order."""
    return [(n, p) for n, p in backend.transformer.named_parameters() if _is_lora(n)]


def has_lora(backend) -> bool:
    return bool(getattr(backend.transformer, "peft_config", None)) and bool(lora_parameters(backend))


def _freeze_all_but_lora(backend) -> None:
    """Only LoRA weights require grad (and are kept in float32, as is usual for bf16 bases)."""
    for value in vars(backend).values():
        if isinstance(value, torch.nn.Module) and value is not backend.transformer:
            value.requires_grad_(False)
    for name, p in backend.transformer.named_parameters():
        p.requires_grad_(_is_lora(name))
        if _is_lora(name) and p.dtype != torch.float32:
            p.data = p.data.float()


def read_adapter_config(folder):
    """The peft ``LoraConfig`` saved in an adapter folder, its file verified against ``sha256.json``
    (one-line error if absent, damaged or unreadable)."""
    from peft import LoraConfig

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"adapter folder {folder} lacks {CONFIG_FILE} or {WEIGHTS_FILE} "
                                "(expected a folder written by tpgrpo.policy.lora.save_adapter)")
    verify_file(folder / CONFIG_FILE)
    try:
        return LoraConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - peft raises JSON, type and value errors on a damaged file
        raise ArtifactError(f"{folder / CONFIG_FILE}: not a readable peft LoraConfig ({first_line(exc)})") from None


def read_adapter_weights(folder) -> dict[str, torch.Tensor]:
    """The peft state dict (keys without the ``transformer.`` prefix) of an adapter folder, the file verified
    against ``sha256.json`` first (one line naming it if damaged or unreadable)."""
    from safetensors.torch import load_file

    path = verify_file(Path(folder) / WEIGHTS_FILE)
    try:
        raw = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on a damaged file
        raise ArtifactError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None
    bad = [k for k in raw if not k.startswith(PREFIX)]
    if bad:
        raise ArtifactError(f"{path}: unexpected key {bad[0]!r} (expected {PREFIX}...)")
    return {k[len(PREFIX):]: v for k, v in raw.items()}


def load_lora_weights(backend, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a peft state dict (``<module>.lora_A.weight`` keys) into the attached adapter, exactly."""
    from peft.utils import set_peft_model_state_dict

    expected = {n.replace(f".{ADAPTER_NAME}.", ".") for n, _ in lora_parameters(backend)}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"adapter weights do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        set_peft_model_state_dict(backend.transformer, state_dict, adapter_name=ADAPTER_NAME)


def attach_lora(backend, rank: int, alpha: int, adapter_dir=None) -> None:
    """Add a LoRA adapter to ``backend.transformer`` on ``backend.lora_target_modules``.

    At init ``lora_B = 0``, so the adapted model equals the base model exactly. With ``adapter_dir``
    (the previous iteration's ``save_adapter`` output) the weights are loaded from it; its saved rank
    and alpha must equal ``rank``/``alpha`` (a mismatch is an error, not a silent re-init). Afterwards
    only the LoRA weights require grad (float32).
    """
    if has_lora(backend):
        raise ValueError("the backend's transformer already has a LoRA adapter attached")
    config = lora_config(rank, alpha, backend.lora_target_modules)
    if adapter_dir is not None:
        saved = read_adapter_config(adapter_dir)
        if (saved.r, saved.lora_alpha) != (rank, alpha):
            raise ValueError(f"adapter {adapter_dir} has rank {saved.r}, alpha {saved.lora_alpha}; "
                             f"the config asks for rank {rank}, alpha {alpha}")
    backend.transformer.add_adapter(config, adapter_name=ADAPTER_NAME)
    _freeze_all_but_lora(backend)
    if adapter_dir is not None:
        load_lora_weights(backend, read_adapter_weights(adapter_dir))


def lora_state_dict(backend) -> dict[str, torch.Tensor]:
    """Detached float32 copies of the LoRA weights, peft keys (``<module>.lora_A.weight``)."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(backend.transformer, adapter_name=ADAPTER_NAME)
    return {k: v.detach().float().clone().contiguous() for k, v in sd.items()}


def _metadata(config) -> dict:
    """The LoraConfig as JSON-safe diffusers adapter metadata (sets -> sorted lists)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            value = sorted(value)
        out[key] = value.value if hasattr(value, "value") else value
    return out


def save_adapter(backend, folder, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter (or the given peft ``state_dict``, e.g. EMA weights) to ``folder``, atomically.

    The folder loads with ``attach_lora(backend, r, alpha, adapter_dir=folder)`` and with a diffusers
    pipeline's ``load_lora_weights(folder)``. An existing ``folder`` is replaced as a whole.
    """
    from diffusers.loaders import SD3LoraLoaderMixin

    if not has_lora(backend):
        raise ValueError("no LoRA adapter attached to the backend (call attach_lora first)")
    config = backend.transformer.peft_config[ADAPTER_NAME]
    weights = lora_state_dict(backend) if state_dict is None else state_dict
    folder = Path(folder)
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        SD3LoraLoaderMixin.save_lora_weights(tmp, transformer_lora_layers=weights,
                                      transformer_lora_adapter_metadata=_metadata(config))
        canonicalize_safetensors(tmp / WEIGHTS_FILE)  # the library's header order changes per process
        config.save_pretrained(str(tmp))
        _sort_set_lists(tmp / CONFIG_FILE, config)
        write_manifest(tmp)  # of the bytes as written (the same in any process, see above)
    return folder


def _sort_set_lists(path: Path, config) -> None:
    """Rewrite peft's ``adapter_config.json`` with every set-valued field (``target_modules``, ...) as a
    sorted list: peft writes ``list(set)``, whose order changes from process to process."""
    import json

    data = json.loads(path.read_text())
    for key, value in config.to_dict().items():
        if isinstance(value, set) and key in data:
            data[key] = sorted(value, key=str)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


@contextmanager
def reference_mode(backend) -> Iterator[None]:
    """Run the backend with the LoRA adapter disabled (the KL reference); re-enable on exit.

    Every LoRA parameter's ``requires_grad`` flag is restored exactly on exit (peft's toggling would
    otherwise reset them). Use it under ``torch.no_grad()``: the reference needs no gradient.
    """
    transformer = backend.transformer
    flags = [(p, p.requires_grad) for _, p in lora_parameters(backend)]
    if not flags:
        raise ValueError("no LoRA adapter attached to the backend (call attach_lora first)")
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
        for p, flag in flags:
            p.requires_grad_(flag)


class LoraEMA:
    """Exponential moving average of the LoRA weights (spec section 7), for evaluation and export.

    Call ``step(backend)`` after every optimizer step. With ``n`` = optimizer steps taken so far
    (1-based, counted by this object), the average updates when ``n % every == 0`` with decay
    ``min((1 + n) / (10 + n), max_decay)`` (Flow-GRPO: every 8 steps, cap 0.9):
    ``ema <- ema + (1 - decay) * (w - ema)``. Starts as a copy of the current weights.
    """

    def __init__(self, backend, max_decay: float = 0.9, every: int = 8):
        if not 0.0 <= max_decay < 1.0 or every < 1:
            raise ValueError(f"need 0 <= max_decay < 1 and every >= 1, got {max_decay}, {every}")
        self.max_decay, self.every = float(max_decay), int(every)
        self.num_steps = 0
        self.num_updates = 0
        self.shadow = lora_state_dict(backend)

    def decay(self, n: int) -> float:
        """Decay at optimizer step ``n`` (1-based)."""
        return min((1.0 + n) / (10.0 + n), self.max_decay)

    @torch.no_grad()
    def step(self, backend) -> bool:
        """Count one optimizer step; update the average when due. Returns whether it updated."""
        self.num_steps += 1
        if self.num_steps % self.every:
            return False
        one_minus = 1.0 - self.decay(self.num_steps)
        current = lora_state_dict(backend)
        for key, avg in self.shadow.items():
            avg.add_(one_minus * (current[key] - avg))
        self.num_updates += 1
        return True

    def state_dict(self) -> dict:
        return {"max_decay": self.max_decay, "every": self.every, "num_steps": self.num_steps,
                "num_updates": self.num_updates,
                "shadow": {k: v.clone() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("EMA state does not match the attached adapter's LoRA weights")
        self.max_decay, self.every = float(state["max_decay"]), int(state["every"])
        self.num_steps, self.num_updates = int(state["num_steps"]), int(state["num_updates"])
        # On the device of this EMA's own shadow (the adapter's): a saved state loads to the CPU, and
        # mixing it with cuda weights in ``step`` would raise at the first EMA update after a resume.
        self.shadow = {k: v.detach().float().to(self.shadow[k].device).clone() for k, v in state["shadow"].items()}

    def save_adapter(self, backend, folder) -> Path:
        """Write the averaged weights as an adapter folder (same layout as ``save_adapter``)."""
        return save_adapter(backend, folder, state_dict=self.shadow)

    @contextmanager
    def applied(self, backend) -> Iterator[None]:
        """Temporarily load the averaged weights into the model (e.g. for evaluation)."""
        saved = lora_state_dict(backend)
        load_lora_weights(backend, self.shadow)
        try:
            yield
        finally:
            load_lora_weights(backend, saved)
