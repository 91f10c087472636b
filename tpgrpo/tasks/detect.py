"""A small rule-based object detector for the compositional task's palette shapes.

Pipeline per image: per-pixel colour = nearest palette colour if within `color_tol` (RGB distance) ->
per-colour connected components (8-connected) -> per component: area, bbox, centre, fill ratio,
colour purity, IoU with each shape's template in the component's bbox (the best one is its shape) ->
validity checks, so that speckle noise, smears, merged blobs and other junk are never objects.

Thresholds are in pixels at 32x32 and scale with the image area (areas) or side (lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

from tpgrpo.tasks.shapes import COLORS, PALETTE_ARRAY, SHAPES, shape_iou

SOFT_IOU = (0.7, 0.95)  # template IoU mapped linearly onto the [0, 1] shape score of `geneval_soft`


@dataclass(frozen=True)
class DetectorConfig:
    """Detector thresholds; lengths in px and areas in px^2 at a 32x32 image (scaled for others)."""

    color_tol: float = 85.0  # RGB distance (0-255 units) within which a pixel takes a palette colour
    color_knee: float = 25.0  # distance up to which a pixel counts as fully pure (render jitter <= 14)
    min_area: float = 16.0  # smallest object area; a 7 px triangle (the smallest rendered) has 28
    junk_min_area: float = 4.0  # invalid components at least this big are junk (smaller: stray pixels)
    min_side: float = 5.0  # smallest bbox side of an object
    max_side: float = 24.0  # largest bbox side (render max 17): an object never fills the image
    max_aspect: float = 1.6  # bbox long/short side; objects are w = h, merged pairs are ~2
    min_shape_iou: float = 0.6  # best template IoU below this = malformed blob, not an object


@dataclass(frozen=True)
class Component:
    """One connected region of a palette colour.

    bbox (x, y, w, h) px; center (x, y) px = bbox centre (what GenEval's position rule uses);
    fill = area / bbox area; purity in [0, 1] = mean over its pixels of how close they are to the
    palette colour; shape_ious = IoU with each shape's template in the bbox; shape = argmax of those.
    """

    color: str
    shape: str
    area: int
    bbox: tuple[int, int, int, int]
    center: tuple[float, float]
    fill: float
    purity: float
    shape_ious: dict[str, float]
    valid: bool
    reason: str = ""  # why invalid; "" for objects

    @property
    def color_score(self) -> float:
        """Soft evidence in [0, 1] that the component has its colour (the GenEval rules' interface)."""
        return self.purity

    @property
    def shape_scores(self) -> dict[str, float]:
        """Soft evidence in [0, 1] per shape: template IoU ramped from SOFT_IOU[0] (0) to SOFT_IOU[1] (1)."""
        lo, hi = SOFT_IOU
        return {s: float(np.clip((iou - lo) / (hi - lo), 0.0, 1.0)) for s, iou in self.shape_ious.items()}


@dataclass(frozen=True)
class Detection:
    """All components of one image: valid `objects`, `junk` (invalid, >= junk_min_area) and the
    number of coloured pixels in smaller components (`stray_px`)."""

    objects: list[Component] = field(default_factory=list)
    junk: list[Component] = field(default_factory=list)
    stray_px: int = 0


def classify_pixels(image: np.ndarray, cfg: DetectorConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel (H, W): palette index (-1 = background/unknown) and distance to that colour (0-255 units)."""
    rgb = image.astype(np.float32)
    dist = np.linalg.norm(rgb[:, :, None, :] - PALETTE_ARRAY[None, None], axis=-1)  # (H, W, 4)
    idx = dist.argmin(axis=-1)
    best = np.take_along_axis(dist, idx[..., None], axis=-1)[..., 0]
    return np.where(best < cfg.color_tol, idx, -1), best


def _check(area: int, w: int, h: int, best_iou: float, cfg: DetectorConfig, scale: float) -> str:
    """'' if a component with these measurements is a plausible object, else the reason it is not."""
    if area < cfg.min_area * scale * scale:
        return "too small"
    if min(w, h) < cfg.min_side * scale:
        return "too thin"
    if max(w, h) > cfg.max_side * scale:
        return "too large"
    if max(w, h) > cfg.max_aspect * min(w, h):
        return "elongated"
    if best_iou < cfg.min_shape_iou:
        return "malformed"
    return ""


def _component(color: str, mask: np.ndarray, dist: np.ndarray, bbox: tuple[int, int, int, int],
               cfg: DetectorConfig, scale: float) -> Component:
    """Measure one component given its tight mask (h, w) and the colour distances of the crop (h, w)."""
    x, y, w, h = bbox
    area = int(mask.sum())
    ious = {s: shape_iou(mask, s) for s in SHAPES}
    shape = max(SHAPES, key=lambda s: ious[s])
    closeness = np.clip((cfg.color_tol - dist[mask]) / (cfg.color_tol - cfg.color_knee), 0.0, 1.0)
    reason = _check(area, w, h, ious[shape], cfg, scale)
    return Component(color=color, shape=shape, area=area, bbox=bbox, center=(x + w / 2, y + h / 2),
                     fill=area / (w * h), purity=float(closeness.mean()), shape_ious=ious,
                     valid=not reason, reason=reason)


def detect(image: np.ndarray, cfg: DetectorConfig = DetectorConfig()) -> Detection:
    """Detect palette objects in one uint8 (H, W, 3) RGB image."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"detect needs a uint8 (H, W, 3) image, got {image.dtype} {image.shape}")
    scale = float(np.sqrt(image.shape[0] * image.shape[1] / 1024.0))
    labels, dist = classify_pixels(image, cfg)
    objects, junk, stray = [], [], 0
    for ci, color in enumerate(COLORS):
        mask = (labels == ci).astype(np.uint8)
        if not mask.any():
            continue
        n, comp_labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
        for k in range(1, n):
            x, y, w, h, area = (int(v) for v in stats[k])
            if area < cfg.junk_min_area * scale * scale:
                stray += area  # isolated specks: too small to classify, still cost soft reward
                continue
            crop = comp_labels[y:y + h, x:x + w] == k
            comp = _component(color, crop, dist[y:y + h, x:x + w], (x, y, w, h), cfg, scale)
            (objects if comp.valid else junk).append(comp)
    return Detection(objects=objects, junk=junk, stray_px=stray)
