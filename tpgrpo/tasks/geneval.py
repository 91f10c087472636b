"""GenEval-style scoring of one detection against one compositional prompt (discrete and soft).

The prompt expands into slots, one per requested object instance ("three red circles" = 3 slots).
Detected objects are matched to slots greedily, best discrete credit first:
  exact colour and shape = 1, right colour only = 0.5, right shape only = 0.5, neither = no match.
- discrete ("geneval"): reward = (sum of slot credits + position clause) / (slots + relations),
  times 0.75 per extra object (unmatched valid object, e.g. one too many) and per junk component.
  Position clause: both slots filled and GenEval's rule (`horizontal_alignment` > 0.5).
  strict = every slot exact, position right, no extras, no junk (i.e. reward == 1).
- soft ("geneval_soft"): the same matching, but each indicator becomes a score in [0, 1]:
  colour -> the component's colour purity, shape -> how well it fits the *requested* shape's
  template (IoU 0.7 -> 0, 0.95 -> 1), position -> alignment 0.25 -> 0, 0.75 -> 1; the junk
  penalty counts junk and stray coloured pixels by mass (min_area px = one extra object).
A missing object scores 0 and every unexplained coloured pixel costs, so noise cannot earn reward.

The rules read detected objects only through `DetectedObject` (colour and shape labels, box, and soft
evidence in [0, 1]), so the same code scores the embedded palette detector (`detect.Component`) and a
transformers object detector (`tpgrpo.rewards.detector`, reward "geneval_detector").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tpgrpo.tasks.detect import SOFT_IOU, Detection, DetectorConfig  # noqa: F401 (SOFT_IOU re-exported)
from tpgrpo.tasks.shapes import horizontal_alignment

EXTRA_PENALTY = 0.75  # reward factor per extra object or junk component
ALIGN_STRICT = 0.5  # GenEval's threshold on horizontal_alignment
SOFT_ALIGN = (0.25, 0.75)  # alignment mapped linearly onto [0, 1] position score


class DetectedObject(Protocol):
    """What the rules need from one detected object (`detect.Component` is one).

    color, shape: labels ("red", "circle"); bbox (x, y, w, h) px; center (x, y) px;
    color_score in [0, 1]: evidence for its colour; shape_scores: evidence in [0, 1] per shape name.
    """

    color: str
    shape: str
    bbox: tuple[float, float, float, float]
    center: tuple[float, float]

    @property
    def color_score(self) -> float: ...

    @property
    def shape_scores(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Score:
    """Reward in [0, 1] and whether every clause holds (strict, GenEval's accuracy)."""

    reward: float
    strict: bool


def _ramp(x: float, lo: float, hi: float) -> float:
    return float(np.clip((x - lo) / (hi - lo), 0.0, 1.0))


def _discrete_credit(comp: DetectedObject, color: str, shape: str) -> float:
    return 0.5 * (comp.color == color) + 0.5 * (comp.shape == shape)


def _soft_credit(comp: DetectedObject, color: str, shape: str) -> float:
    colour = comp.color_score if comp.color == color else 0.0
    return 0.5 * colour + 0.5 * comp.shape_scores.get(shape, 0.0)


def _slots(meta: dict) -> list[tuple[str, str]]:
    return [(o["color"], o["shape"]) for o in meta["objects"] for _ in range(o["count"])]


def match(objects: list[DetectedObject], slots: list[tuple[str, str]]) -> list[int | None]:
    """Greedy slot -> object index assignment (None = unfilled), best discrete then soft credit first.

    Greedy is exact for these credits up to ties: an exact match (1) never helps more elsewhere
    (<= 0.5), and partial matches are all worth 0.5.
    """
    pairs = []
    for j, (color, shape) in enumerate(slots):
        for k, comp in enumerate(objects):
            credit = _discrete_credit(comp, color, shape)
            if credit > 0:
                pairs.append((-credit, -_soft_credit(comp, color, shape), j, k))
    pairs.sort()
    assigned: list[int | None] = [None] * len(slots)
    used: set[int] = set()
    for _, _, j, k in pairs:
        if assigned[j] is None and k not in used:
            assigned[j], used = k, used | {k}
    return assigned


def _alignment(meta: dict, a: DetectedObject | None, b: DetectedObject | None) -> float | None:
    """Alignment of the first object relative to the second in the direction the relation asks, or None."""
    if a is None or b is None:
        return None
    align = horizontal_alignment(a.center, a.bbox[2:], b.center, b.bbox[2:])
    return align if meta["relation"] == "left_of" else -align


def score(det: Detection, meta: dict, soft: bool, cfg: DetectorConfig = DetectorConfig(),
          image_px: int = 1024) -> Score:
    """Score one image's detection against one compositional meta (see the module docstring).

    image_px: H * W of the image (scales the junk-mass unit, `cfg.min_area` at 32x32).
    """
    slots = _slots(meta)
    assigned = match(det.objects, slots)
    comps = [det.objects[k] if k is not None else None for k in assigned]
    n_extra = len(det.objects) - sum(k is not None for k in assigned)

    hard = [_discrete_credit(c, *s) if c else 0.0 for c, s in zip(comps, slots)]
    clauses_total = len(slots) + (meta["relation"] is not None)
    pos_hard = pos_soft = 0.0
    if meta["relation"] is not None:
        align = _alignment(meta, comps[0], comps[1])
        if align is not None:
            pos_hard = float(align > ALIGN_STRICT)
            pos_soft = _ramp(align, *SOFT_ALIGN)
    hard_reward = (sum(hard) + pos_hard) / clauses_total * EXTRA_PENALTY ** (n_extra + len(det.junk))
    strict = hard_reward == 1.0
    if not soft:
        return Score(reward=float(hard_reward), strict=strict)

    credits = [_soft_credit(c, *s) if c else 0.0 for c, s in zip(comps, slots)]
    min_area = cfg.min_area * image_px / 1024.0
    junk_mass = (sum(j.area for j in det.junk) + det.stray_px) / min_area
    soft_reward = (sum(credits) + pos_soft) / clauses_total * EXTRA_PENALTY ** (n_extra + junk_mass)
    return Score(reward=float(np.clip(soft_reward, 0.0, 1.0)), strict=strict)

