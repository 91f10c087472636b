"""Procedural renders that satisfy a prompt (the tiny model's pretraining data) and renders that don't.

Compositional scenes: a plain light-grey background (shade in `BACKGROUND_RANGE`), solid shapes in
the palette colours (+-8 per channel jitter), odd pixel sizes (so templates match exactly), at least
2 px apart and 1 px from the border; "A left of B" puts A's centroid >= 4 px (at 32 px) left of B's, and B
mostly right of A rather than above or below it (`horizontal_alignment` >= 0.75).
Text: dark grey glyphs (0-50) on the same light background, Pillow's default font at 12 px (at 32 px),
characters 2 px apart (tighter spacing makes OCR merge repeated characters).

Every function is deterministic given its `rng`. Sizes scale with `size / 32`.
"""

from __future__ import annotations

from functools import lru_cache

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tpgrpo.tasks.prompts import TEXT_CHARSET
from tpgrpo.tasks.shapes import (
    BACKGROUND_RANGE, COLORS, PALETTE, SHAPES, horizontal_alignment, rasterize_shape,
)

# Object side ranges (px at 32x32, odd values only) by the number of objects in the scene: fewer
# objects may be larger; four objects of up to 11 px still fit with room to move.
_SIDE_RANGE = {1: (9, 17), 2: (7, 13), 3: (7, 11), 4: (7, 11), 5: (7, 9)}
_GAP = 2  # px between object boxes: keeps components apart even after a mild blur
_MARGIN = 1  # px from the image border
_POSITION_DX = 4.0  # px (at 32) between the centroids of a left/right pair
_POSITION_ALIGN = 0.75  # horizontal_alignment of a rendered left/right pair (detector needs > 0.5)
_COLOR_JITTER = 8  # per-channel, 0-255: keeps colours well inside the detector's tolerance
_FONT_PX = 12  # at 32 px; measured best for rapidocr among 10-12
_TEXT_SPACING = 2  # px between characters: at 1 px OCR merges repeated characters more often
VIOLATIONS = ("wrong_count", "wrong_color", "wrong_shape", "wrong_side", "extra_object",
              "speckle", "blank", "wrong_text")
DEGRADATIONS = ("blur", "color_shift", "noise")


def _scale(size: int) -> float:
    return size / 32.0


def _odd_side(lo: int, hi: int, size: int, rng: np.random.Generator) -> int:
    """A random odd side in [lo, hi] (32 px units) scaled to `size`, at least 3 px."""
    side = 2 * int(rng.integers(lo // 2, hi // 2 + 1)) + 1
    return max(3, int(round(side * _scale(size))) | 1)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    shade = int(rng.integers(BACKGROUND_RANGE[0], BACKGROUND_RANGE[1] + 1))
    return np.full((size, size, 3), shade, dtype=np.uint8)


def _place(sides: list[int], rng: np.random.Generator, size: int, relation: str | None,
           tries: int = 100) -> list[tuple[int, int]] | None:
    """Top-left corners for boxes of the given sides, non-overlapping with a gap; None if no fit.

    With relation "left_of"/"right_of" the first box's centre must lie left/right of the second's.
    """
    min_dx = _POSITION_DX * _scale(size)
    if any(size - _MARGIN - s < _MARGIN for s in sides):
        return None
    for _ in range(tries):
        corners: list[tuple[int, int]] = []
        for s in sides:  # sequential placement, a few tries per object before starting over
            hi = size - _MARGIN - s
            for _ in range(20):
                x, y = (int(v) for v in rng.integers(_MARGIN, hi + 1, size=2))
                if not any(x < cx + cs + _GAP and cx < x + s + _GAP and y < cy + cs + _GAP
                           and cy < y + s + _GAP for (cx, cy), cs in zip(corners, sides)):
                    corners.append((x, y))
                    break
            else:
                break
        if len(corners) != len(sides):
            continue
        if relation is not None:
            sign = 1.0 if relation == "left_of" else -1.0
            (xa, ya), (xb, yb), (sa, sb) = corners[0], corners[1], sides[:2]
            ca, cb = (xa + sa / 2, ya + sa / 2), (xb + sb / 2, yb + sb / 2)
            align = horizontal_alignment(ca, (sa, sa), cb, (sb, sb))
            if sign * (cb[0] - ca[0]) < min_dx or sign * align < _POSITION_ALIGN:
                continue
        return corners
    return None


def render_objects(objects: list[tuple[str, str]], rng: np.random.Generator, size: int = 32,
                   relation: str | None = None) -> np.ndarray:
    """Render (color, shape) objects at random non-overlapping places: uint8 (size, size, 3) RGB.

    `relation` constrains objects[0] relative to objects[1] (centroid x), as in position prompts.
    """
    img = _background(rng, size)
    n = len(objects)
    if n == 0:
        return img
    lo, hi = _SIDE_RANGE[min(n, max(_SIDE_RANGE))]
    corners = None
    while corners is None:
        sides = [_odd_side(lo, hi, size, rng) for _ in objects]
        corners = _place(sides, rng, size, relation)
        if corners is None and hi == lo:
            raise ValueError(f"cannot place {n} objects in a {size}x{size} image")
        hi = max(lo, hi - 2)  # crowded: retry with smaller objects
    for (color, shape), (x, y), s in zip(objects, corners, sides):
        rgb = np.clip(np.array(PALETTE[color]) + rng.integers(-_COLOR_JITTER, _COLOR_JITTER + 1, 3), 0, 255)
        region = img[y:y + s, x:x + s]
        region[rasterize_shape(shape, s, s)] = rgb.astype(np.uint8)
    return img


def _expand(meta: dict) -> list[tuple[str, str]]:
    return [(o["color"], o["shape"]) for o in meta["objects"] for _ in range(o["count"])]


@lru_cache(maxsize=8)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px)


def render_text(text: str, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """Dark text on a light background at a random position: uint8 (size, size, 3) RGB."""
    font = _font(max(4, int(round(_FONT_PX * _scale(size)))))
    img = Image.fromarray(_background(rng, size))
    draw = ImageDraw.Draw(img)
    advances = [font.getlength(ch) for ch in text]
    width = sum(advances) + _TEXT_SPACING * (len(text) - 1)
    _, top, _, bottom = draw.textbbox((0, 0), text, font=font)
    slack = size - width  # 3 wide characters leave ~1 px: then hug the left border instead of 1 px in
    lo = min(1.0, slack / 2)
    x = float(rng.uniform(lo, max(lo, slack - 1)))
    y = int(rng.integers(2, max(2, size - (bottom - top) - 2) + 1)) - top
    ink = (int(rng.integers(0, 51)),) * 3
    for ch, adv in zip(text, advances):
        draw.text((round(x), y), ch, fill=ink, font=font)
        x += adv + _TEXT_SPACING
    return np.asarray(img, dtype=np.uint8).copy()


def render_prompt(meta: dict, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """A clean image satisfying `meta`: uint8 (size, size, 3) RGB, deterministic given rng."""
    if meta["task"] == "text":
        return render_text(meta["text"], rng, size)
    if meta["task"] != "compositional":
        raise ValueError(f"unknown task {meta['task']!r}")
    return render_objects(_expand(meta), rng, size, meta["relation"])


def _other(values: tuple[str, ...], avoid: set[str], rng: np.random.Generator) -> str:
    choices = [v for v in values if v not in avoid]
    return choices[int(rng.integers(len(choices)))]


def _violated_meta(meta: dict, violation: str, rng: np.random.Generator) -> dict:
    """A copy of meta changed so that a render of it breaks exactly one clause of `meta`."""
    bad = {**meta, "objects": [dict(o) for o in meta["objects"]]}
    first = bad["objects"][0]
    if violation == "wrong_count":
        if meta["kind"] == "position":
            bad["objects"], bad["relation"] = bad["objects"][:1], None  # drop the second object
        else:
            first["count"] = first["count"] + 1 if first["count"] < 4 else first["count"] - 1
    elif violation == "wrong_color":
        first["color"] = _other(COLORS, {o["color"] for o in meta["objects"]}, rng)
    elif violation == "wrong_shape":
        first["shape"] = _other(SHAPES, {o["shape"] for o in meta["objects"]}, rng)
    elif violation == "wrong_side":
        if meta["kind"] != "position":
            raise ValueError(f"violation 'wrong_side' needs a position prompt, got {meta['kind']!r}")
        bad["relation"] = "right_of" if meta["relation"] == "left_of" else "left_of"
    else:
        raise ValueError(f"unknown violation {violation!r}; valid: {', '.join(VIOLATIONS)}")
    return bad


def render_violation(meta: dict, violation: str, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """An image that breaks `meta` in one named way: uint8 (size, size, 3) RGB.

    violation: "wrong_count" (one more/fewer, or the second object missing for position prompts),
    "wrong_color" / "wrong_shape" (first object changed to a value no prompt object has),
    "wrong_side" (position only), "extra_object" (a valid object of a combination not in the prompt),
    "speckle" (palette-coloured pixel noise, 5-50% density, no objects), "blank" (background only),
    "wrong_text" (text only: one character replaced).
    """
    if violation == "blank":
        return _background(rng, size)
    if violation == "speckle":
        img = _background(rng, size)
        hit = rng.random((size, size)) < rng.uniform(0.05, 0.5)
        img[hit] = np.array([PALETTE[c] for c in COLORS], dtype=np.uint8)[rng.integers(0, 4, int(hit.sum()))]
        return img
    if meta["task"] == "text":
        if violation != "wrong_text":
            raise ValueError(f"violation {violation!r} does not apply to the text task")
        chars = list(meta["text"])
        i = int(rng.integers(len(chars)))
        chars[i] = _other(tuple(TEXT_CHARSET), {chars[i]}, rng)
        return render_text("".join(chars), rng, size)
    if violation == "extra_object":
        used = {(o["color"], o["shape"]) for o in meta["objects"]}
        spare = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in used]
        objects = _expand(meta) + [spare[int(rng.integers(len(spare)))]]
        return render_objects(objects, rng, size, meta["relation"])
    bad = _violated_meta(meta, violation, rng)
    return render_objects(_expand(bad), rng, size, bad["relation"])


def degrade(image: np.ndarray, kind: str, amount: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """A mildly imperfect copy of a uint8 (H, W, 3) image, as a generator might produce.

    kind: "blur" (Gaussian, sigma = amount px), "color_shift" (every pixel moved by `amount`
    0-255 units along a fixed random RGB direction), "noise" (Gaussian, std = amount 0-255 units).
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    img = image.astype(np.float32)
    if kind == "blur":
        out = cv2.GaussianBlur(img, (0, 0), sigmaX=amount) if amount > 0 else img
    elif kind == "color_shift":
        direction = rng.normal(size=3)
        out = img + amount * direction / np.linalg.norm(direction)
    elif kind == "noise":
        out = img + rng.normal(0.0, amount, img.shape)
    else:
        raise ValueError(f"unknown degradation {kind!r}; valid: {', '.join(DEGRADATIONS)}")
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
