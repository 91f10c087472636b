"""OCR of the text task's 32x32 signs with rapidocr, and the edit distance the OCR reward uses.

Measured on this project's renders (see tests/test_tasks_ocr.py): the recogniser alone on the whole
upscaled image reads 2-3 character strings better than detection + recognition (which often finds no
text box on such small signs) and is ~5x faster, so the text detector is skipped.
"""

from __future__ import annotations

import threading
import unicodedata

import cv2
import numpy as np

UPSCALE = 4  # nearest-neighbour factor before OCR; rapidocr's recogniser wants ~48 px high text lines
# The recogniser pads every crop to 48 x REC_WIDTH px. Its default (320, for long text lines) wastes
# ~4x compute on our square crops (48x48 after resizing) and read them less well: measured on 900
# renders, width 320: 96.3% exact, 18 images/s; 80: 99.4%, ~70 images/s.
REC_WIDTH = 80
REC_BATCH = 32
# OCR output folded onto the text charset (after NFKC, which maps full-width digits to ASCII): the
# charset deliberately lacks these letters, so reading one can only mean the look-alike digit.
_FOLD = str.maketrans({"O": "0", "I": "1", "B": "8", "G": "6", "S": "5", "Z": "2", "×": "X"})

_engine = None
_engine_lock = threading.Lock()


def get_engine():
    """The process-wide RapidOCR engine, created on first use (loading the ONNX models takes ~1 s).

    Configured for this task (single-line square crops, see REC_WIDTH); use its `text_rec` only.
    """
    global _engine
    with _engine_lock:
        if _engine is None:
            from rapidocr_onnxruntime import RapidOCR  # slow import: only when OCR is needed

            engine = RapidOCR()
            engine.text_rec.rec_image_shape = [3, 48, REC_WIDTH]
            engine.text_rec.rec_batch_num = REC_BATCH
            _engine = engine
        return _engine


def normalize(text: str) -> str:
    """NFKC, uppercase, drop whitespace, fold look-alikes (see `_FOLD`): OCR output -> charset space."""
    return "".join(unicodedata.normalize("NFKC", text).upper().split()).translate(_FOLD)


def read_texts(images: np.ndarray) -> list[str]:
    """Normalised text read from each uint8 RGB image of a batch (N, H, W, 3)."""
    engine = get_engine()
    crops = [
        cv2.resize(img, None, fx=UPSCALE, fy=UPSCALE, interpolation=cv2.INTER_NEAREST)[:, :, ::-1].copy()
        for img in images  # rapidocr expects BGR like cv2.imread
    ]
    # The recogniser batches internally (all crops have one aspect ratio); calling it directly skips
    # the text detector and the angle classifier (rapidocr-onnxruntime 1.4.4 API, pinned).
    results, _ = engine.text_rec(crops)
    return [normalize(text) for text, _score in results]


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_similarity(target: str, read: str) -> float:
    """1 - levenshtein / max(len) in [0, 1]; 1.0 iff equal (two empty strings are equal)."""
    longest = max(len(target), len(read))
    return 1.0 - levenshtein(target, read) / longest if longest else 1.0
