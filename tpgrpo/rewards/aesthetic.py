"""The LAION aesthetic predictor (v2): an MLP over L2-normalised CLIP image embeddings, from local files.

`aesthetic_clip_path`: a CLIP save_pretrained folder (openai/clip-vit-large-patch14, embeddings of 768);
`aesthetic_head_path`: the MLP's state dict (``sac+logos+ava1-l14-linearMSE.pth``, or .safetensors) with
layers ``layers.{0,2,4,6,7}`` = Linear(D, 1024), Linear(1024, 128), Linear(128, 64), Linear(64, 16),
Linear(16, 1) (dropout between; DDPO's and Flow-GRPO's aesthetic reward). The reward is the raw score, on
the AVA 1-10 scale (most images 4-7); it ignores the prompt. No clauses: no strict correctness.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from tpgrpo.distributed import reward_device
from tpgrpo.rewards.folders import check_file, check_folder, load_error
from tpgrpo.rewards.pickscore import MODEL_FILES, PROCESSOR_FILES, load_clip
from tpgrpo.tasks.rewards import Reward

HEAD_LAYERS = (0, 2, 4, 6, 7)  # indices of the Linear layers in the original nn.Sequential
WHAT_CLIP = "a CLIP save_pretrained folder (clip-vit-large-patch14) with config.json, weights and processor files"
WHAT_HEAD = "the LAION aesthetic MLP state dict (.pth or .safetensors)"


@functools.lru_cache(maxsize=2)
def load_head(path: str, device: str):
    """The aesthetic MLP as an nn.Sequential (eval mode), its sizes read from the state dict."""
    import torch

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = {k.removeprefix("module.").removeprefix("layers."): v for k, v in state.items()}
        linears = [torch.nn.Linear(*state[f"{i}.weight"].shape[::-1]) for i in HEAD_LAYERS]
    except Exception as exc:  # noqa: BLE001 - any load failure -> one line
        raise load_error("aesthetic", Path(path), exc) from None
    head = torch.nn.Sequential(linears[0], torch.nn.Dropout(0.2), linears[1], torch.nn.Dropout(0.2),
                               linears[2], torch.nn.Dropout(0.1), linears[3], linears[4])
    try:
        head.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as exc:
        raise load_error("aesthetic", Path(path), exc) from None
    return head.eval().to(torch.device(device))


class AestheticReward(Reward):
    """LAION aesthetic score of each image (any prompt, the text is ignored)."""

    name = "aesthetic"
    task = None
    bounded = False
    has_strict = False

    def __init__(self, clip_path: Path, head_path: Path, device: str = "cpu", batch_size: int = 32):
        self.clip_path, self.head_path = Path(clip_path), Path(head_path)
        self.device, self.batch_size = device, batch_size

    @classmethod
    def from_config(cls, cfg, root: Path | None) -> AestheticReward:
        rm = cfg.reward_models
        clip = check_folder("reward_models.aesthetic_clip_path", rm.aesthetic_clip_path, root, WHAT_CLIP,
                            MODEL_FILES + PROCESSOR_FILES)
        head = check_file("reward_models.aesthetic_head_path", rm.aesthetic_head_path, root, WHAT_HEAD)
        return cls(clip, head, reward_device(rm.device), rm.batch_size)

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, None]:
        import torch

        model, processor = load_clip(str(self.clip_path), str(self.clip_path), self.device, self.name)
        head = load_head(str(self.head_path), self.device)
        out = []
        for start in range(0, len(images), self.batch_size):
            inputs = processor(images=list(images[start:start + self.batch_size]), return_tensors="pt")
            with torch.no_grad():
                pooled = model.vision_model(pixel_values=inputs["pixel_values"].to(model.device)).pooler_output
                embeds = torch.nn.functional.normalize(model.visual_projection(pooled).float(), dim=-1)
                out.append(head(embeds).squeeze(-1).cpu().numpy())
        return np.concatenate(out).astype(np.float64), None
