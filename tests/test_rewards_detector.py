"""GenEval over a transformers detector: the project's rules on detector boxes, and tiny real detectors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tpgrpo.config import Config, ConfigError
from tpgrpo.rewards.detector import (Boxes, GenEvalDetectorReward, GenEvalDetectorSoftReward, ObjectDetector,
                                     box_colour, select_boxes)
from tpgrpo.tasks.detect import detect
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import VIOLATIONS, render_prompt, render_violation
from tpgrpo.tasks.rewards import build_reward, get_reward
from tpgrpo.tasks.shapes import SHAPES

try:
    from tests.tiny_reward_models import save_tiny_detr, save_tiny_owlvit
except ImportError:  # pytest's rootdir import mode
    from tiny_reward_models import save_tiny_detr, save_tiny_owlvit

EVAL = build_prompt_sets()["compositional_eval"]


class OracleDetector:
    """Stands in for the transformers model at the boundary: boxes of the palette detector's objects
    (plus any ``extra`` boxes), each certain (probability ``p``) of the shape the palette detector saw."""

    def __init__(self, p: float = 0.9, extra: list[tuple[np.ndarray, str, float]] | None = None):
        self.p, self.extra, self.calls = p, extra or [], 0

    def __call__(self, images, names, required=None):
        self.calls += 1
        out = []
        for img, image_names in zip(images, names):
            rows = [(np.array([o.bbox[0], o.bbox[1], o.bbox[0] + o.bbox[2], o.bbox[1] + o.bbox[3]], float),
                     o.shape, self.p) for o in detect(img).objects] + self.extra
            probs = np.array([[p if n == shape else 0.02 for n in image_names] for _, shape, p in rows])
            out.append(Boxes(xyxy=np.array([r[0] for r in rows]).reshape(-1, 4),
                             probs=probs.reshape(len(rows), len(image_names)), names=tuple(image_names)))
        return out


def test_rules_over_detector_boxes_match_the_embedded_geneval():
    """With the palette detector's objects as boxes, geneval_detector applies exactly geneval's rules."""
    rng = np.random.default_rng(0)
    metas, images = [], []
    for meta in EVAL[::2]:
        for violation in (None, *VIOLATIONS[:5]):
            if violation == "wrong_side" and meta["kind"] != "position":
                continue
            img = render_prompt(meta, rng) if violation is None else render_violation(meta, violation, rng)
            if not detect(img).junk and detect(img).stray_px == 0:  # the detector variant has no junk notion
                metas.append(meta)
                images.append(img)
    images = np.stack(images)
    ours = GenEvalDetectorReward(OracleDetector(), threshold=0.3)(images, metas)
    theirs = get_reward("geneval")(images, metas)
    assert len(metas) > 200 and 0.1 < theirs.strict.mean() < 0.5  # clean and violated renders
    assert len(np.unique(theirs.reward)) >= 4  # partial credit of several kinds
    np.testing.assert_allclose(ours.reward, theirs.reward)
    np.testing.assert_array_equal(ours.strict, theirs.strict)
    soft = GenEvalDetectorSoftReward(OracleDetector(), threshold=0.3)(images, metas)
    # continuous evidence: a wrong-shape box earns its relative probability (0.02 / 0.9) of shape credit
    assert np.all(soft.reward[ours.strict] == 1.0) and np.abs(soft.reward - ours.reward).max() > 0.005
    np.testing.assert_array_equal(soft.strict, ours.strict)


def test_threshold_nms_colour_and_extra_objects():
    meta = next(m for m in EVAL if m["kind"] == "position")
    img = render_prompt(meta, np.random.default_rng(1))[None]
    assert GenEvalDetectorReward(OracleDetector(p=0.9), 0.3)(img, [meta]).strict[0]
    # below the threshold nothing is detected: no credit at all
    assert GenEvalDetectorReward(OracleDetector(p=0.2), 0.3)(img, [meta]).reward[0] == 0.0
    # a duplicate of a detected box (IoU 1) is suppressed; a distinct extra object costs 0.75
    first = detect(img[0]).objects[0]
    box = np.array([first.bbox[0], first.bbox[1], first.bbox[0] + first.bbox[2], first.bbox[1] + first.bbox[3]], float)
    dup = GenEvalDetectorReward(OracleDetector(extra=[(box, first.shape, 0.5)]), 0.3)(img, [meta])
    assert dup.reward[0] == 1.0 and dup.strict[0]
    far = np.array([0.0, 0.0, 4.0, 4.0])  # a background corner: colour "none", an extra object
    extra = GenEvalDetectorReward(OracleDetector(extra=[(far, "circle", 0.9)]), 0.3)(img, [meta])
    assert extra.reward[0] == pytest.approx(0.75) and not extra.strict[0]
    # colour is judged from the pixels inside the box
    assert box_colour(img[0], box) == (first.color, 1.0)
    assert box_colour(img[0], far) == ("none", 0.0)


def test_select_boxes_keeps_best_of_overlapping():
    boxes = Boxes(xyxy=np.array([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 2, 2]], float),
                  probs=np.array([[0.5, 0.1], [0.8, 0.0], [0.1, 0.4], [0.05, 0.1]]), names=("circle", "square"))
    kept = select_boxes(boxes, threshold=0.3)
    np.testing.assert_array_equal(kept.xyxy, [[1, 1, 10, 10], [20, 20, 30, 30]])  # best first, IoU 0.81 dropped
    assert select_boxes(boxes, threshold=0.9).xyxy.shape == (0, 4)


def config(**reward_models) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, reward_models=dataclasses.replace(cfg.reward_models, **reward_models))


@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory):
    return save_tiny_owlvit(tmp_path_factory.mktemp("owl") / "owlvit")


def test_tiny_owlvit_loads_from_its_folder_and_scores_end_to_end(owl_dir):
    metas = EVAL[:5]
    rng = np.random.default_rng(2)
    images = np.stack([render_prompt(m, rng) for m in metas])
    detector = ObjectDetector(owl_dir, batch_size=2)
    boxes = detector(images, [SHAPES] * len(images))
    assert len(boxes) == 5 and boxes[0].xyxy.shape == (16, 4) and boxes[0].probs.shape == (16, 3)
    assert all(np.all((b.probs >= 0) & (b.probs <= 1)) and np.all(np.isfinite(b.xyxy)) for b in boxes)
    # threshold 0: every box competes, NMS keeps some; the rules score them; results are pointwise
    reward = build_reward("geneval_detector", config(geneval_detector_path=str(owl_dir),
                                                     geneval_detector_threshold=0.0, batch_size=2))
    result = reward(images, metas)
    assert result.reward.shape == (5,) and np.all((result.reward >= 0) & (result.reward <= 1))
    dets = reward.detections(images, metas)
    assert all(0 < len(d.objects) <= 16 for d in dets)
    alone = np.concatenate([reward(images[i:i + 1], metas[i:i + 1]).reward for i in range(5)])
    np.testing.assert_allclose(alone, result.reward)
    soft = build_reward("geneval_detector_soft", config(geneval_detector_path=str(owl_dir),
                                                        geneval_detector_threshold=0.0))(images, metas)
    assert np.all(np.isfinite(soft.reward)) and soft.has_strict
    with pytest.raises(ValueError, match="scores 'compositional' prompts"):
        reward(images[:1], [build_prompt_sets()["text_eval"][0]])


def test_tiny_detr_closed_set_labels(tmp_path):
    images = np.stack([render_prompt(m, np.random.default_rng(3)) for m in EVAL[:2]])
    shapes = save_tiny_detr(tmp_path / "detr")
    reward = build_reward("geneval_detector", config(geneval_detector_path=str(shapes), geneval_detector_threshold=0.0))
    result = reward(images, EVAL[:2])
    assert np.all((result.reward >= 0) & (result.reward <= 1))
    assert all(0 < len(d.objects) <= 6 for d in reward.detections(images, EVAL[:2]))
    from tpgrpo.errors import RewardError

    animals = save_tiny_detr(tmp_path / "animals", labels=("cat", "dog"))
    reward = build_reward("geneval_detector", config(geneval_detector_path=str(animals)))
    with pytest.raises(RewardError, match=r"detector .*animals has no label 'circle' \(labels: cat, dog\)"):
        reward(images[:1], EVAL[:1])


def test_missing_detector_folder_names_key_path_and_files(tmp_path):
    with pytest.raises(ConfigError, match="reward_models.geneval_detector_path is not set"):
        build_reward("geneval_detector", config())
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "config.json").write_text("{}")
    (tmp_path / "det" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        build_reward("geneval_detector", config(geneval_detector_path="det"), root=tmp_path)
    message = str(info.value)
    assert f"{tmp_path / 'det'} has no preprocessor_config.json or processor_config.json" in message
    assert "\n" not in message
