"""PickScore (Kirstain et al. 2023): a CLIP model fine-tuned on human preferences, loaded from a local folder.

score = logit_scale.exp() * cos(text_embeds, image_embeds): PickScore_v1's logit scale is 100, so raw
scores of ordinary images lie around 21-23 (of a random CLIP, anything near 0 to its scale). The reward is
raw / `reward_models.pickscore_divisor` (Flow-GRPO divides by 26). No clauses: no strict correctness.

Layout: `pickscore_path` is a CLIP ``save_pretrained`` folder (config.json + weights, e.g.
yuvalkirstain/PickScore_v1); its processor (tokenizer + image processor, laion/CLIP-ViT-H-14-laion2B) is
read from `pickscore_processor_path`, or from the same folder when that is "".
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from tpgrpo.distributed import reward_device
from tpgrpo.rewards.folders import check_folder, load_error
from tpgrpo.tasks.rewards import Reward

MODEL_FILES = (("config.json",), ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"))
PROCESSOR_FILES = (("preprocessor_config.json", "processor_config.json"),
                   ("tokenizer.json", "vocab.json", "tokenizer_config.json"))
WHAT_MODEL = "a CLIP save_pretrained folder with config.json and model weights (PickScore_v1)"
WHAT_PROCESSOR = "a CLIP processor folder with preprocessor_config.json and tokenizer files"


@functools.lru_cache(maxsize=4)
def load_clip(model_path: str, processor_path: str, device: str, reward: str = "pickscore"):
    """(CLIPModel in eval mode on ``device``, its processor), loaded once per process from local folders."""
    import torch
    from transformers import AutoProcessor, CLIPModel

    try:
        model = CLIPModel.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(processor_path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any load failure (safetensors, config, files) -> one line
        raise load_error(reward, Path(model_path), exc) from None
    return model.eval().to(torch.device(device)), processor


class PickScoreReward(Reward):
    """PickScore of each image for its prompt (``meta["prompt"]``), divided by ``divisor``; any task."""

    name = "pickscore"
    task = None
    bounded = False
    has_strict = False

    def __init__(self, model_path: Path, processor_path: Path | None = None, divisor: float = 26.0,
                 device: str = "cpu", batch_size: int = 32):
        self.model_path, self.processor_path = Path(model_path), Path(processor_path or model_path)
        self.divisor, self.device, self.batch_size = divisor, device, batch_size

    @classmethod
    def from_config(cls, cfg, root: Path | None) -> PickScoreReward:
        """Check the configured folders now; the weights load on the first call."""
        rm = cfg.reward_models
        model = check_folder("reward_models.pickscore_path", rm.pickscore_path, root, WHAT_MODEL, MODEL_FILES)
        processor = model
        if rm.pickscore_processor_path:
            processor = check_folder("reward_models.pickscore_processor_path", rm.pickscore_processor_path,
                                     root, WHAT_PROCESSOR, PROCESSOR_FILES)
        else:
            check_folder("reward_models.pickscore_path", rm.pickscore_path, root,
                         WHAT_PROCESSOR + " (or set reward_models.pickscore_processor_path)", PROCESSOR_FILES)
        return cls(model, processor, rm.pickscore_divisor, reward_device(rm.device), rm.batch_size)

    def raw_scores(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """logit_scale.exp() * cos(text, image) per (image, prompt) pair: (N,) float64.

        images: uint8 (N, H, W, 3) RGB; prompts: N strings. Batched by ``batch_size``, no gradients.
        """
        import torch

        model, processor = load_clip(str(self.model_path), str(self.processor_path), self.device, self.name)
        max_length = model.config.text_config.max_position_embeddings
        out = []
        for start in range(0, len(images), self.batch_size):
            stop = start + self.batch_size
            inputs = processor(text=list(prompts[start:stop]), images=list(images[start:stop]),
                               return_tensors="pt", padding=True, truncation=True, max_length=max_length)
            inputs = {k: v.to(model.device) for k, v in inputs.items()}
            with torch.no_grad():
                result = model(**inputs)
                text = torch.nn.functional.normalize(result.text_embeds.float(), dim=-1)
                image = torch.nn.functional.normalize(result.image_embeds.float(), dim=-1)
                out.append((model.logit_scale.exp().float() * (text * image).sum(-1)).cpu().numpy())
        return np.concatenate(out).astype(np.float64)

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, None]:
        prompts = []
        for i, meta in enumerate(metas):
            if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
                raise ValueError(f"reward {self.name!r}: prompt {i} has no 'prompt' text")
            prompts.append(meta["prompt"])
        return self.raw_scores(images, prompts) / self.divisor, None
