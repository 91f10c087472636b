"""Procedural renders and the detector: clean renders are exactly what the detector expects."""

import numpy as np
import pytest

from tpgrpo.tasks.detect import detect
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import VIOLATIONS, degrade, render_objects, render_prompt, render_violation
from tpgrpo.tasks.shapes import BACKGROUND_RANGE, SHAPES, rasterize_shape

SETS = build_prompt_sets()
COMP = SETS["compositional_train"] + SETS["compositional_eval"]


def _expected(meta):
    return sorted((o["color"], o["shape"]) for o in meta["objects"] for _ in range(o["count"]))


def test_deterministic_given_rng():
    for meta in (COMP[0], COMP[-1], SETS["text_eval"][0]):
        a = render_prompt(meta, np.random.default_rng(5))
        b = render_prompt(meta, np.random.default_rng(5))
        c = render_prompt(meta, np.random.default_rng(6))
        assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
        assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("size", [32, 64])
def test_clean_renders_detect_exactly(size):
    """Every object is found with its colour and shape, nothing else; left-of holds by centroid."""
    rng = np.random.default_rng(0)
    for meta in COMP:
        img = render_prompt(meta, rng, size=size)
        assert img.shape == (size, size, 3)
        det = detect(img)
        assert not det.junk and det.stray_px == 0, meta["prompt"]
        assert sorted((o.color, o.shape) for o in det.objects) == _expected(meta), meta["prompt"]
        assert all(o.purity == 1.0 and o.shape_ious[o.shape] == 1.0 for o in det.objects)
        if meta["relation"] is not None:
            first, second = meta["objects"]
            cx = {(o.color, o.shape): o.center[0] for o in det.objects}
            a, b = cx[first["color"], first["shape"]], cx[second["color"], second["shape"]]
            assert (a < b) == (meta["relation"] == "left_of"), meta["prompt"]


def test_objects_do_not_overlap_or_touch():
    rng = np.random.default_rng(1)
    for _ in range(50):
        img = render_objects([("red", "circle")] * 5, rng)
        boxes = [o.bbox for o in detect(img).objects]
        assert len(boxes) == 5
        for i, (x, y, w, h) in enumerate(boxes):
            for (u, v, s, t) in boxes[i + 1:]:
                assert x + w + 2 <= u or u + s + 2 <= x or y + h + 2 <= v or v + t + 2 <= y


def test_background_and_templates():
    img = render_violation(COMP[0], "blank", np.random.default_rng(0))
    assert len(np.unique(img)) == 1 and BACKGROUND_RANGE[0] <= img[0, 0, 0] <= BACKGROUND_RANGE[1]
    for shape in SHAPES:
        mask = rasterize_shape(shape, 9, 9)
        assert mask[0].any() and mask[-1].any() and mask[:, 0].any() and mask[:, -1].any()
    fills = {s: rasterize_shape(s, 15, 15).mean() for s in SHAPES}
    assert fills["triangle"] < fills["circle"] < fills["square"] == 1.0


def test_text_render_is_dark_on_light():
    img = render_prompt(SETS["text_eval"][0], np.random.default_rng(0))
    grey = img.mean(axis=2)
    assert grey.min() <= 60 and np.median(grey) >= BACKGROUND_RANGE[0]
    assert (img.max(axis=2) - img.min(axis=2)).max() == 0  # neutral: no palette colour in text images


def test_violations_differ_from_prompt():
    rng = np.random.default_rng(2)
    position = next(m for m in COMP if m["kind"] == "position")
    for violation in VIOLATIONS:
        if violation == "wrong_text":
            continue
        det = detect(render_violation(position, violation, rng))
        assert sorted((o.color, o.shape) for o in det.objects) != _expected(position) or violation == "wrong_side"
    with pytest.raises(ValueError, match="position"):
        render_violation(COMP[0], "wrong_side", rng)
    with pytest.raises(ValueError, match="unknown violation"):
        render_violation(COMP[0], "upside_down", rng)


def test_degrade_kinds():
    img = render_prompt(COMP[-1], np.random.default_rng(0))
    for kind in ("blur", "color_shift", "noise"):
        out = degrade(img, kind, 1.0)
        assert out.dtype == np.uint8 and out.shape == img.shape and not np.array_equal(out, img)
    with pytest.raises(ValueError):
        degrade(img, "jpeg", 1.0)
