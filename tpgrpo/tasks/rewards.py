"""Rewards by name, and weighted combinations of them: the registry.

`get_reward(name)(images, metas) -> RewardResult` for rewards that need no params; `build_reward(spec, cfg)`
for any `task.reward` spec: a name or a mapping name -> weight (the weighted sum; see `WeightedSum`).

- "geneval": GenEval-style discrete rules with partial credit over `detect` (see `geneval.py`).
- "geneval_soft": the same clauses scored continuously; strict is geneval's.
- "ocr": 1 - normalised edit distance between the quoted text and rapidocr's reading; strict = exact.
- "jpeg_compressibility": DDPO's compressibility in [0, 1]; any prompt; no strict.
- "pickscore": PickScore (CLIP from `reward_models.pickscore_path`), raw / `pickscore_divisor`; no strict.
- "geneval_detector" / "geneval_detector_soft": the geneval rules over a transformers object detector
  (`reward_models.geneval_detector_path`, OWL-ViT/OWLv2 or any AutoModelForObjectDetection).
- "aesthetic": LAION aesthetic MLP over CLIP image embeddings (`reward_models.aesthetic_*`); no strict.
- "remote": a reward server at `remote_reward.url` (`tpgrpo serve-reward`); strict as the server says.
Rewards are pointwise (one image, one prompt). Model rewards check their folder when built and load
their weights on the first call (once per process).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tpgrpo.tasks import geneval
from tpgrpo.tasks.detect import DetectorConfig, detect
from tpgrpo.tasks.ocr import read_texts, text_similarity
from tpgrpo.tasks.reward_names import REWARD_NAMES


@dataclass(frozen=True)
class RewardResult:
    """Per-image reward (N,) float64 and strict correctness (N,) bool (all clauses right).

    has_strict: whether the reward defines strict correctness at all (False: `strict` is all False).
    Bounded rewards (GenEval-style, OCR, JPEG) lie in [0, 1]; model rewards keep their own scale.
    """

    reward: np.ndarray
    strict: np.ndarray
    has_strict: bool = True


class Reward:
    """Base class: checks the batch and the prompts' task, then scores (subclasses: `_score`)."""

    name: str = ""
    task: str | None = ""  # the prompts' task this reward scores; None scores any prompt
    bounded: bool = True  # rewards must lie in [0, 1] (checked: a violation is a bug)
    has_strict: bool = True  # whether strict correctness is defined (reported for empty batches)

    def __call__(self, images: np.ndarray, metas: list[dict]) -> RewardResult:
        """images: uint8 (N, H, W, 3) RGB; metas: N prompt dicts of this reward's task."""
        self._check(images, metas)
        if len(metas) == 0:
            return RewardResult(reward=np.zeros(0, dtype=np.float64), strict=np.zeros(0, dtype=bool),
                                has_strict=self.has_strict)
        reward, strict = self._score(images, metas)
        reward = np.asarray(reward, dtype=np.float64)
        if reward.shape != (len(metas),):
            raise AssertionError(f"{self.name}: {reward.shape} rewards for {len(metas)} images")  # a bug
        if self.bounded and not np.all((reward >= 0.0) & (reward <= 1.0)):
            raise AssertionError(f"{self.name}: reward out of contract: {reward}")  # a bug, not bad input
        if strict is None:
            return RewardResult(reward=reward, strict=np.zeros(len(metas), dtype=bool), has_strict=False)
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

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray | None]:
        """Rewards (N,) and strict (N,) bool, or None where the reward defines no strict correctness."""
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
    reward for pipeline tests on untrained models. It has no clauses: no strict (all False).
    """

    name = "jpeg_compressibility"
    task = None
    has_strict = False

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, None]:
        import io

        from PIL import Image

        sizes = []
        for img in images:
            buffer = io.BytesIO()
            Image.fromarray(img).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell())
        reward = np.clip(1.0 - np.array(sizes, dtype=np.float64) / images[0].nbytes, 0.0, 1.0)
        return reward, None


class WeightedSum(Reward):
    """``sum_i weight_i * reward_i`` of named rewards, each checking its own prompts' task.

    strict (and has_strict) is that of the first component, in the mapping's order, that defines strict
    correctness (e.g. geneval's in ``{pickscore: 1, geneval: 0.2}``); none does: no strict (all False).
    """

    task = None
    bounded = False

    def __init__(self, parts: list[tuple[str, float, Reward]]):
        self.parts = parts
        self.name = " + ".join(f"{weight:g}*{name}" for name, weight, _ in parts)
        self.has_strict = any(r.has_strict for _, _, r in parts)

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray | None]:
        total, strict = np.zeros(len(metas), dtype=np.float64), None
        for _, weight, reward in self.parts:
            result = reward(images, metas)
            total += weight * result.reward
            if strict is None and result.has_strict:
                strict = result.strict
        return total, strict


def _model_reward(module: str, cls: str) -> Callable[[Any, Path | None], Reward]:
    """Factory of a reward that reads params: imported on use (torch, transformers are heavy)."""
    def build(cfg, root: Path | None) -> Reward:
        import importlib

        return getattr(importlib.import_module(module), cls).from_config(cfg, root)
    return build


_REGISTRY: dict[str, Callable[[Any, Path | None], Reward]] = {
    "geneval": lambda cfg, root: GenEvalReward(soft=False),
    "geneval_soft": lambda cfg, root: GenEvalReward(soft=True),
    "ocr": lambda cfg, root: OcrReward(),
    "jpeg_compressibility": lambda cfg, root: JpegCompressibilityReward(),
    "pickscore": _model_reward("tpgrpo.rewards.pickscore", "PickScoreReward"),
    "geneval_detector": _model_reward("tpgrpo.rewards.detector", "GenEvalDetectorReward"),
    "geneval_detector_soft": _model_reward("tpgrpo.rewards.detector", "GenEvalDetectorSoftReward"),
    "aesthetic": _model_reward("tpgrpo.rewards.aesthetic", "AestheticReward"),
    "remote": _model_reward("tpgrpo.rewards.remote", "RemoteReward"),
}
if tuple(_REGISTRY) != REWARD_NAMES:  # params are validated against that list, without importing this module
    raise ImportError(f"tpgrpo/tasks/reward_names.py lists {REWARD_NAMES}; expected the registry's names "
                      f"{tuple(_REGISTRY)}")
# Local folders (reward_models keys) each reward loads: dvc.yaml lists the configured ones as deps.
FOLDER_KEYS: dict[str, tuple[str, ...]] = {
    "pickscore": ("pickscore_path", "pickscore_processor_path"),
    "geneval_detector": ("geneval_detector_path",), "geneval_detector_soft": ("geneval_detector_path",),
    "aesthetic": ("aesthetic_clip_path", "aesthetic_head_path"),
}


def get_reward(name: str, cfg=None, root: Path | None = None) -> Reward:
    """A fresh reward object by name; unknown names raise ValueError listing the valid ones.

    cfg (a `Config`) and root (the project folder relative paths start from) are needed by the model
    and remote rewards only; the embedded rewards ignore them.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; valid rewards: {', '.join(REWARD_NAMES)}")
    if cfg is None and (name in FOLDER_KEYS or name == "remote"):
        raise ValueError(f"reward {name!r} reads params (reward_models, remote_reward): "
                         "use build_reward(spec, cfg)")
    return _REGISTRY[name](cfg, root)


def reward_names(spec: str | dict[str, float]) -> list[str]:
    """The reward names of a spec (a name, or a mapping name -> weight), in order."""
    return [spec] if isinstance(spec, str) else list(spec)


def build_reward(spec: str | dict[str, float], cfg=None, root: Path | None = None) -> Reward:
    """The reward of a `task.reward` / `task.eval_reward` spec: a name, or a mapping name -> weight.

    A mapping gives a `WeightedSum`. Model rewards check their folders here and load on first call.
    """
    if isinstance(spec, str):
        return get_reward(spec, cfg, root)
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"reward spec {spec!r}: expected a reward name or a mapping name -> weight")
    return WeightedSum([(name, float(weight), get_reward(name, cfg, root)) for name, weight in spec.items()])


def reward_folders(spec: str | dict[str, float], cfg) -> list[str]:
    """The configured local folders/files (as written in params) the spec's rewards load."""
    folders = []
    for name in reward_names(spec):
        for key in FOLDER_KEYS.get(name, ()):
            value = getattr(cfg.reward_models, key)
            if value and value not in folders:
                folders.append(value)
    return folders
