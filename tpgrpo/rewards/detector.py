"""GenEval with a real object detector: the project's GenEval rules over a transformers detector's boxes.

GenEval (Ghosh et al. 2023) detects objects with Mask2Former, counts them, judges colour with CLIP and
position from box centres. Here the detector is any transformers detector in a local folder:
- OWL-ViT / OWLv2 (zero-shot): each image is queried with ``"a photo of a {name}"`` for its prompt's
  object names plus the task vocabulary (the three shapes), so a wrong object is found as that object;
- any other AutoModelForObjectDetection (DETR family, closed set): its labels (``id2label``) must
  contain the prompt's object names; softmax heads drop their no-object column, sigmoid heads do not.
Per image: per-name probabilities of each predicted box -> boxes whose best probability reaches
`reward_models.geneval_detector_threshold` -> greedy non-maximum suppression (IoU > 0.5, any name) ->
objects: name = best name, colour = the majority palette colour of the box's pixels (the project's colour
code, `detect.classify_pixels`; colours outside the palette are never matched), soft evidence =
colour share and name probability relative to the best name -> `tpgrpo.tasks.geneval.score` (the same
rules, partial credit, extra-object penalty and strict accuracy as "geneval" / "geneval_soft").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpgrpo.distributed import reward_device
from tpgrpo.rewards.folders import check_folder, load_error
from tpgrpo.tasks import geneval
from tpgrpo.tasks.detect import Detection, DetectorConfig, classify_pixels
from tpgrpo.tasks.rewards import Reward
from tpgrpo.tasks.shapes import COLORS, SHAPES

QUERY_TEMPLATE = "a photo of a {}"
NMS_IOU = 0.5  # boxes overlapping a kept box more than this are the same object
VOCABULARY = SHAPES  # names every image is also queried for (zero-shot) / kept (closed set) when known
ZERO_SHOT = ("owlvit", "owlv2")
FILES = (("config.json",), ("model.safetensors", "pytorch_model.bin"),
         ("preprocessor_config.json", "processor_config.json"))
WHAT = ("an OWL-ViT/OWLv2 or AutoModelForObjectDetection save_pretrained folder with config.json, "
        "weights and preprocessor_config.json")


@dataclass(frozen=True)
class Boxes:
    """Candidate boxes of one image: xyxy (M, 4) float px; probs (M, len(names)) in [0, 1] per name."""

    xyxy: np.ndarray
    probs: np.ndarray
    names: tuple[str, ...]


@dataclass(frozen=True)
class BoxObject:
    """One detected object, in the form the GenEval rules read (`geneval.DetectedObject`)."""

    color: str
    shape: str
    bbox: tuple[float, float, float, float]  # x, y, w, h px
    center: tuple[float, float]  # x, y px
    color_score: float  # share of the box's palette-coloured pixels that have `color`, in [0, 1]
    shape_scores: dict[str, float]  # per name: probability / best probability of the box, in [0, 1]


def select_boxes(boxes: Boxes, threshold: float, nms_iou: float = NMS_IOU) -> Boxes:
    """Boxes whose best name probability is >= threshold, then greedy NMS by that probability."""
    best = boxes.probs.max(axis=1) if boxes.probs.size else np.zeros(len(boxes.xyxy))
    order = [i for i in np.argsort(-best, kind="stable") if best[i] >= threshold]
    x0, y0, x1, y1 = boxes.xyxy.T if len(boxes.xyxy) else (np.zeros(0),) * 4
    area = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    kept: list[int] = []
    for i in order:
        iw = np.clip(np.minimum(x1[i], x1[kept]) - np.maximum(x0[i], x0[kept]), 0, None)
        ih = np.clip(np.minimum(y1[i], y1[kept]) - np.maximum(y0[i], y0[kept]), 0, None)
        inter = iw * ih
        iou = inter / np.maximum(area[i] + area[kept] - inter, 1e-9)
        if not kept or iou.max() <= nms_iou:
            kept.append(i)
    return Boxes(xyxy=boxes.xyxy[kept], probs=boxes.probs[kept], names=boxes.names)


def box_colour(image: np.ndarray, xyxy: np.ndarray) -> tuple[str, float]:
    """Majority palette colour of the pixels inside a box and its share of the box's coloured pixels.

    image uint8 (H, W, 3); xyxy px. ("none", 0.0) when no pixel is within a palette colour's tolerance.
    """
    H, W = image.shape[:2]
    x0, y0 = int(np.clip(np.floor(xyxy[0]), 0, W - 1)), int(np.clip(np.floor(xyxy[1]), 0, H - 1))
    x1, y1 = int(np.clip(np.ceil(xyxy[2]), x0 + 1, W)), int(np.clip(np.ceil(xyxy[3]), y0 + 1, H))
    labels, _ = classify_pixels(image[y0:y1, x0:x1], DetectorConfig())
    counts = np.bincount(labels[labels >= 0], minlength=len(COLORS))
    if counts.sum() == 0:
        return "none", 0.0
    c = int(counts.argmax())
    return COLORS[c], float(counts[c] / counts.sum())


def to_detection(image: np.ndarray, boxes: Boxes) -> Detection:
    """The selected boxes of one image as objects of the GenEval rules (no junk: a detector finds objects)."""
    objects = []
    for xyxy, probs in zip(boxes.xyxy, boxes.probs):
        top = float(probs.max())
        color, share = box_colour(image, xyxy)
        w, h = float(xyxy[2] - xyxy[0]), float(xyxy[3] - xyxy[1])
        objects.append(BoxObject(
            color=color, shape=boxes.names[int(probs.argmax())], bbox=(float(xyxy[0]), float(xyxy[1]), w, h),
            center=(float(xyxy[0]) + w / 2, float(xyxy[1]) + h / 2), color_score=share,
            shape_scores={n: float(p / top) if top > 0 else 0.0 for n, p in zip(boxes.names, probs)}))
    return Detection(objects=objects)


def image_names(meta: dict) -> tuple[str, ...]:
    """The object names an image is queried for: its prompt's objects, then the vocabulary's others."""
    return tuple(dict.fromkeys([o["shape"] for o in meta["objects"]] + list(VOCABULARY)))


@functools.lru_cache(maxsize=4)
def load_detector(path: str, device: str, reward: str = "geneval_detector"):
    """(model in eval mode on ``device``, processor, zero_shot) from a local folder, once per process."""
    import torch
    from transformers import (AutoConfig, AutoModelForObjectDetection, AutoModelForZeroShotObjectDetection,
                              AutoProcessor)

    try:
        zero_shot = AutoConfig.from_pretrained(path, local_files_only=True).model_type in ZERO_SHOT
        auto = AutoModelForZeroShotObjectDetection if zero_shot else AutoModelForObjectDetection
        model = auto.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any load failure (safetensors, config, files) -> one line
        raise load_error(reward, Path(path), exc) from None
    return model.eval().to(torch.device(device)), processor, zero_shot


class ObjectDetector:
    """A transformers detector from a local folder (loaded on first call): per image, candidate ``Boxes``."""

    def __init__(self, path: Path, device: str = "cpu", batch_size: int = 32, reward: str = "geneval_detector"):
        self.path, self.device, self.batch_size, self.reward = Path(path), device, batch_size, reward

    def __call__(self, images: np.ndarray, names: list[tuple[str, ...]],
                 required: list[tuple[str, ...]] | None = None) -> list[Boxes]:
        """images uint8 (N, H, W, 3); names[i]: the names image i is scored for -> N ``Boxes``.

        A closed-set detector keeps the names among its labels; one of ``required[i]`` (the prompt's
        objects; default all of names[i]) missing from its labels is an error.
        """
        required = names if required is None else required
        model, processor, zero_shot = load_detector(str(self.path), self.device, self.reward)
        out = []
        for start in range(0, len(images), self.batch_size):
            chunk, chunk_names = images[start:start + self.batch_size], names[start:start + self.batch_size]
            if zero_shot:
                out += self._zero_shot(model, processor, chunk, chunk_names)
            else:
                out += self._closed_set(model, processor, chunk, chunk_names,
                                        required[start:start + self.batch_size])
        return out

    @staticmethod
    def _pixel_boxes(pred_boxes, image: np.ndarray, padded_square: bool) -> np.ndarray:
        """Normalised (cx, cy, w, h) (M, 4) -> xyxy px; OWLv2 boxes are relative to the padded square."""
        H, W = image.shape[:2]
        scale = np.array([max(H, W), max(H, W)] * 2 if padded_square else [W, H] * 2, dtype=np.float64)
        cx, cy, w, h = pred_boxes.double().cpu().numpy().T
        return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1) * scale

    def _zero_shot(self, model, processor, images: np.ndarray, names: list[tuple[str, ...]]) -> list[Boxes]:
        import torch

        queries = [[QUERY_TEMPLATE.format(n) for n in image_names] for image_names in names]
        inputs = processor(text=queries, images=list(images), return_tensors="pt", truncation=True)
        with torch.no_grad():
            outputs = model(**{k: v.to(model.device) for k, v in inputs.items()})
        probs = torch.sigmoid(outputs.logits.float()).cpu().numpy()  # (B, patches, padded queries)
        owlv2 = model.config.model_type == "owlv2"
        return [Boxes(xyxy=self._pixel_boxes(outputs.pred_boxes[b], images[b], owlv2),
                      probs=probs[b, :, :len(names[b])].astype(np.float64), names=names[b])
                for b in range(len(images))]

    def _closed_set(self, model, processor, images: np.ndarray, names: list[tuple[str, ...]],
                    required: list[tuple[str, ...]]) -> list[Boxes]:
        import torch

        labels = {str(v).lower(): int(k) for k, v in model.config.id2label.items()}
        inputs = processor(images=list(images), return_tensors="pt")
        with torch.no_grad():
            outputs = model(**{k: v.to(model.device) for k, v in inputs.items()})
        logits = outputs.logits.float()
        no_object = logits.shape[-1] == len(labels) + 1  # DETR-style softmax with a no-object class
        probs = (logits.softmax(-1)[..., :-1] if no_object else logits.sigmoid()).cpu().numpy()
        result = []
        for b, image_names in enumerate(names):
            missing = [n for n in required[b] if n.lower() not in labels]
            if missing:
                from tpgrpo.errors import RewardError

                raise RewardError(f"reward {self.reward}: detector {self.path} has no label {missing[0]!r} "
                                  f"(labels: {', '.join(sorted(labels)[:20])})")
            kept = tuple(n for n in image_names if n.lower() in labels)
            columns = [labels[n.lower()] for n in kept]
            result.append(Boxes(xyxy=self._pixel_boxes(outputs.pred_boxes[b], images[b], False),
                                probs=probs[b][:, columns].astype(np.float64), names=kept))
        return result


class GenEvalDetectorReward(Reward):
    """The GenEval rules (discrete, partial credit; strict = all clauses) over an ``ObjectDetector``."""

    name = "geneval_detector"
    task = "compositional"
    soft = False

    def __init__(self, detector: ObjectDetector, threshold: float = 0.3):
        self.detector, self.threshold = detector, threshold

    @classmethod
    def from_config(cls, cfg, root: Path | None) -> GenEvalDetectorReward:
        """Check the configured folder now; the detector loads on the first call."""
        rm = cfg.reward_models
        path = check_folder("reward_models.geneval_detector_path", rm.geneval_detector_path, root, WHAT, FILES)
        detector = ObjectDetector(path, reward_device(rm.device), rm.batch_size, cls.name)
        return cls(detector, rm.geneval_detector_threshold)

    def detections(self, images: np.ndarray, metas: list[dict]) -> list[Detection]:
        """The rules' view of each image: its selected boxes as objects."""
        required = [tuple(dict.fromkeys(o["shape"] for o in m["objects"])) for m in metas]
        boxes = self.detector(images, [image_names(m) for m in metas], required)
        return [to_detection(img, select_boxes(b, self.threshold)) for img, b in zip(images, boxes)]

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        image_px = images.shape[1] * images.shape[2]
        scores = [geneval.score(det, meta, self.soft, image_px=image_px)
                  for det, meta in zip(self.detections(images, metas), metas)]
        return np.array([s.reward for s in scores]), np.array([s.strict for s in scores])


class GenEvalDetectorSoftReward(GenEvalDetectorReward):
    """The continuous variant (as "geneval_soft"): colour share and relative name probability as evidence."""

    name = "geneval_detector_soft"
    soft = True
