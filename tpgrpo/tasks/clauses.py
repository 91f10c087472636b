"""Which GenEval clause an image breaks: the reason behind a strict-accuracy number.

Strict accuracy says how many images are right; it does not say what the wrong ones got wrong, and RL moves
the clauses at different speeds (a base that ignores word order draws left/right pairs on the asked side
only by chance, and no update at this scale fixes that, while counts and extra objects move). This module
names the broken clauses of one image with the same detection and slot matching as the `geneval` rules
(`tpgrpo.tasks.geneval`), and tabulates them per prompt kind.

Clauses (an image can break several):
- ``missing``: an asked object instance was not found (too few for a count, the second of a pair);
- ``colour`` / ``shape``: a matched object has the wrong colour / shape;
- ``side``: both objects of a left/right prompt were found and the first is not on the asked side
  (GenEval's alignment rule, > 0.5, fails: the wrong side, or too little horizontal offset);
- ``extra``: a valid object that fills no slot (one too many);
- ``junk``: a coloured component the detector cannot read as an object.
An image is strict exactly when it breaks none of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpgrpo.tasks import geneval
from tpgrpo.tasks.detect import Detection, detect

CLAUSES = ("missing", "colour", "shape", "side", "extra", "junk")


def read_clauses(det: Detection, meta: dict) -> tuple[tuple[str, ...], int]:
    """One image against a compositional meta, with one `geneval` matching: the clauses it breaks (in
    ``CLAUSES`` order) and its side sign (see :func:`side_sign`)."""
    slots = geneval._slots(meta)
    found = [det.objects[k] if k is not None else None for k in geneval.match(det.objects, slots)]
    broken = set()
    for obj, (colour, shape) in zip(found, slots):
        if obj is None:
            broken.add("missing")
            continue
        if obj.color != colour:
            broken.add("colour")
        if obj.shape != shape:
            broken.add("shape")
    align = None if meta["relation"] is None else geneval._alignment(meta, found[0], found[1])
    if align is not None and align <= geneval.ALIGN_STRICT:
        broken.add("side")
    if len(det.objects) > sum(obj is not None for obj in found):
        broken.add("extra")
    if det.junk:
        broken.add("junk")
    sign = 0 if align is None or abs(align) <= geneval.ALIGN_STRICT else (1 if align > 0 else -1)
    return tuple(c for c in CLAUSES if c in broken), sign


def failed_clauses(det: Detection, meta: dict) -> tuple[str, ...]:
    """The clauses (in ``CLAUSES`` order) that one image's detection breaks for a compositional meta."""
    return read_clauses(det, meta)[0]


def side_sign(det: Detection, meta: dict) -> int:
    """For a left/right prompt: +1 when both objects were found with a clear horizontal offset on the asked
    side, -1 when clearly on the other side, 0 otherwise (an object missing, or |alignment| <= 0.5)."""
    return read_clauses(det, meta)[1]


def clause_table(images: np.ndarray, metas: Sequence[dict]) -> dict:
    """Per prompt kind (and ``all``): images ``n``, ``strict`` accuracy, the fraction of images breaking each
    clause, and for left/right prompts ``side_right``: of the images with a clear offset, the fraction on the
    asked side (0.5 = chance; None without any).

    images: ``uint8 (N, H, W, 3)``; metas: N compositional prompt metas (``kind``, ``objects``, ``relation``).
    """
    rows = []
    for image, meta in zip(images, metas):
        rows.append((str(meta.get("kind", "")), *read_clauses(detect(image), meta)))
    table = {}
    for kind in sorted({k for k, _, _ in rows}) + ["all"]:
        picked = [(broken, sign) for k, broken, sign in rows if kind in (k, "all")]
        signs = [sign for _, sign in picked if sign != 0]
        table[kind] = {
            "n": len(picked),
            "strict": float(np.mean([not broken for broken, _ in picked])),
            **{c: float(np.mean([c in broken for broken, _ in picked])) for c in CLAUSES},
            "side_right": float(np.mean([s > 0 for s in signs])) if signs else None,
        }
    return table


def clause_markdown(table: dict) -> str:
    """The table as Markdown: one row per kind, the share of images breaking each clause."""
    head = "| kind | images | strict | " + " | ".join(CLAUSES) + " | on the asked side (left/right, clear offset) |"
    lines = [head, "|" + "---|" * (len(CLAUSES) + 4)]
    for kind, row in table.items():
        side = "-" if row["side_right"] is None else f"{row['side_right']:.2f}"
        cells = " | ".join(f"{row[c]:.2f}" for c in CLAUSES)
        lines.append(f"| {kind} | {row['n']} | {row['strict']:.3f} | {cells} | {side} |")
    return "\n".join(lines) + "\n"
