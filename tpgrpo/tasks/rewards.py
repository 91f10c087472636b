"""Rewards by name: `get_reward("geneval" | "geneval_soft" | "ocr")(images, metas) -> RewardResult`.

- "geneval": GenEval-style discrete rules with partial credit over `detect` (see `geneval.py`).
- "geneval_soft": the same clauses scored continuously; strict is geneval's.
- "ocr": 1 - normalised edit distance between the quoted text and rapidocr's reading; strict = exact.
Rewards are pointwise (one image, one prompt) and stateless apart from the shared OCR engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpgrpo.tasks import geneval
from tpgrpo.tasks.detect import DetectorConfig, detect
from tpgrpo.tasks.ocr import read_texts, text_similarity


@dataclass(frozen=True)
class RewardResult:
    """Per-image reward (N,) float64 in [0, 1] and strict correctness (N,) bool (all clauses right)."""

    reward: np.ndarray
    strict: np.ndarray


class Reward:
    """Base class: checks the batch and the prompts' task, then scores (subclasses: `_score`)."""

    name: str = ""
    task: str | None = ""  # the prompts' task this reward scores; None scores any prompt

    def __call__(self, images: np.ndarray, metas: list[dict]) -> RewardResult:
        """images: uint8 (N, H, W, 3) RGB; metas: N prompt dicts of this reward's task."""
        self._check(images, metas)
        if len(metas) == 0:
            return RewardResult(reward=np.zeros(0, dtype=np.float64), strict=np.zeros(0, dtype=bool))
        reward, strict = self._score(images, metas)
        reward = np.asarray(reward, dtype=np.float64)
        if reward.shape != (len(metas),) or not np.all((reward >= 0.0) & (reward <= 1.0)):
            raise AssertionError(f"{self.name}: reward out of contract: {reward}")  # a bug, not bad input
        return RewardResult(reward=reward, strict=np.asarray(strict, dtype=bool))

    def _check(self, images: np.ndarray, metas: list[dict]) -> None:
        if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
            kind = images.dtype if isinstance(images, np.ndarray) else type(images).__name__
            raise ValueError(f"reward {self.name!r} needs a uint8 numpy image batch, got {kind}")
        if images.ndim != 4 or images.shape[3] != 3 or min(images.shape[1:3], default=0) < 1:
            raise ValueError(f"reward {self.name!r} needs images of shape (N, H, W, 3), got {images.shape}")
        if len(metas) != images.shape[0]:
            raise ValueError(f"reward {self.name!r}: {images.shape[0]} images but {len(metas)} prompts")
        for i, meta in enumerate(metas if self.task is not None else []):  # task None: any prompt
            task = meta.get("task") if isinstance(meta, dict) else None
            if task != self.task:
                raise ValueError(f"reward {self.name!r} scores {self.task!r} prompts; prompt {i} "
                                 f"({meta.get('id') if isinstance(meta, dict) else meta!r}) has task {task!r}")

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class GenEvalReward(Reward):
    """GenEval-style rules over the palette-shape detector; `soft` selects the continuous variant."""

    task = "compositional"

    def __init__(self, soft: bool = False, cfg: DetectorConfig = DetectorConfig()):
        self.soft = soft
        self.cfg = cfg
        self.name = "geneval_soft" if soft else "geneval"

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        image_px = images.shape[1] * images.shape[2]
        scores = [geneval.score(detect(img, self.cfg), meta, self.soft, self.cfg, image_px)
                  for img, meta in zip(images, metas)]
        return np.array([s.reward for s in scores]), np.array([s.strict for s in scores])


class OcrReward(Reward):
    """1 - normalised Levenshtein distance between the prompt's quoted text and the OCR reading."""

    name = "ocr"
    task = "text"

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        reads = read_texts(images)
        targets = [meta["text"] for meta in metas]
        reward = np.array([text_similarity(t, r) for t, r in zip(targets, reads)])
        strict = np.array([t == r for t, r in zip(targets, reads)])
        return reward, strict


class JpegCompressibilityReward(Reward):
    """DDPO's JPEG-compressibility reward, mapped to [0, 1]: ``1 - jpeg_bytes / raw_bytes`` at quality 95.

    Needs no model and scores any prompt (it ignores the text), so it also serves as a cheap continuous
    reward for pipeline tests on untrained models. It has no clauses: ``strict`` is always False.
    """

    name = "jpeg_compressibility"
    task = None

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        import io

        from PIL import Image

        sizes = []
        for img in images:
            buffer = io.BytesIO()
            Image.fromarray(img).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell())
        reward = np.clip(1.0 - np.array(sizes, dtype=np.float64) / images[0].nbytes, 0.0, 1.0)
        return reward, np.zeros(len(images), dtype=bool)


_REGISTRY = {
    "geneval": lambda: GenEvalReward(soft=False),
    "geneval_soft": lambda: GenEvalReward(soft=True),
    "ocr": OcrReward,
    "jpeg_compressibility": JpegCompressibilityReward,
}
REWARD_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_reward(name: str) -> Reward:
    """A fresh reward object by name; unknown names raise ValueError listing the valid ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; valid rewards: {', '.join(REWARD_NAMES)}")
    return _REGISTRY[name]()
