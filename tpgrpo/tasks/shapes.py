"""Shared visual vocabulary of the compositional task: palette, shapes and their rasterisation.

The renderer (pretraining data) and the detector (reward) must agree pixel for pixel on what a
"red triangle" is, so both draw their shape templates from `rasterize_shape` here.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

# Saturated, mutually distant RGB colours. The smallest pairwise distance (red-yellow, ~171) sets
# the detector's tolerance: a pixel is assigned to a colour only within half that distance, so no
# pixel can be near two palette colours at once.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
}
PALETTE_ARRAY = np.array([PALETTE[c] for c in COLORS], dtype=np.float32)  # (4, 3) RGB

# Background: neutral light grey, shade per image in this range (0-255). Its distance to every palette
# colour is > 190, far outside the detector's colour tolerance; text uses the same background.
BACKGROUND_RANGE: tuple[int, int] = (225, 255)


@lru_cache(maxsize=512)
def rasterize_shape(shape: str, w: int, h: int) -> np.ndarray:
    """Boolean mask (h, w) of `shape` filling a w x h pixel box.

    A pixel is inside when its centre is inside the ideal shape (no anti-aliasing, so renders use
    exact palette colours). Circles are ellipses inscribed in the box, squares fill it, triangles
    are isosceles, apex up at the top centre, base on the bottom row. With odd w = h every shape
    touches all four sides of its box, so a detector's tight bbox of a clean render equals the box
    and the template matches the render exactly. The returned array is read-only (it is cached).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
    if w < 1 or h < 1:
        raise ValueError(f"shape box must be at least 1x1 pixels, got {w}x{h}")
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64) + 0.5  # pixel centres
    if shape == "square":
        mask = np.ones((h, w), dtype=bool)
    elif shape == "circle":
        mask = ((xs - w / 2) / (w / 2)) ** 2 + ((ys - h / 2) / (h / 2)) ** 2 <= 1.0
    else:
        # Half-width grows linearly from 0 at the top edge to w/2 at the bottom edge; the small
        # epsilon keeps the apex pixel of odd-width triangles (its centre lies exactly on an edge).
        half = (w / 2) * (ys / h)
        mask = np.abs(xs - w / 2) <= half + 1e-9
    mask.setflags(write=False)
    return mask


def shape_iou(mask: np.ndarray, shape: str) -> float:
    """IoU in [0, 1] between a component's tight mask (h, w) and `shape`'s template of the same box."""
    template = rasterize_shape(shape, mask.shape[1], mask.shape[0])
    inter = np.count_nonzero(mask & template)
    union = np.count_nonzero(mask | template)
    return inter / union if union else 0.0


# GenEval's position rule: shrink the centre offset by this fraction of the two boxes' summed
# extents per axis (near-touching or overlapping objects have no relation), then call B "right of" A
# when the remaining offset points mostly along +x.
POSITION_SHRINK = 0.1


def horizontal_alignment(center_a: tuple[float, float], dims_a: tuple[float, float],
                         center_b: tuple[float, float], dims_b: tuple[float, float]) -> float:
    """How much B lies to the right of A, in [-1, 1] (GenEval-style; 0 if no clear offset).

    centers (x, y) and dims (w, h) in px. Returns the x component of the unit vector of the
    shrunken offset B - A: +1 = B straight right of A, -1 = straight left, 0 = above/below or
    overlapping. GenEval's discrete rule is "A left of B" iff the value is > 0.5.
    """
    offset = np.subtract(center_b, center_a, dtype=np.float64)
    shrink = POSITION_SHRINK * (np.asarray(dims_a, dtype=np.float64) + np.asarray(dims_b, dtype=np.float64))
    revised = np.maximum(np.abs(offset) - shrink, 0.0) * np.sign(offset)
    norm = float(np.linalg.norm(offset))
    if norm == 0.0 or float(np.abs(revised).max()) < 1e-3:
        return 0.0
    return float(revised[0] / norm)
