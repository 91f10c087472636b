"""Prompt sets of the two tasks the embedded tiny model learns: compositional scenes and short text.

A prompt is a metadata dict (the schema `load_prompts` checks)::

    {"id": "comp-0042", "task": "compositional" | "text",
     "kind": "single" | "counting" | "two_objects" | "position" | "text",
     "prompt": "a red circle left of a blue square",
     "objects": [{"shape": "circle", "color": "red", "count": 1}, ...],   # [] for text
     "relation": None | "left_of" | "right_of",   # first object relative to the second
     "text": None | "42"}

Held-out (eval) prompts never occur in train, but use the same vocabulary:
- single / counting: the 12 colour-shape combinations split into 4 disjoint "transversals" (3 combos,
  one per shape, three different colours); transversal 0 is held out as single objects, transversals
  1-3 as counts 2, 3 and 4. Every combination is thus seen in train, just never at its held-out count.
- two_objects / position: a quarter of the 66 unordered pairs of distinct combos never appear together
  in any train prompt (in neither order, relation nor phrasing: "A left of B" = "B right of A").
- text: 100 strings held out; train draws 2,000 other strings.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from tpgrpo.tasks.shapes import COLORS, SHAPES

COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATION_WORDS: dict[str, str] = {"left_of": "left of", "right_of": "right of"}
TEXT_TEMPLATE = 'a sign that says "{}"'
# Chosen by measurement (rapidocr, 32 px renders): letters OCR confuses with digits or with each other
# at this size (B/G/S/O/I/U/N/E/F/C/L/Y) are left out; single characters are too often unread, so
# strings have 2-3 characters.
TEXT_CHARSET = "0123456789AHKPRTX"
TEXT_LENGTHS: tuple[int, ...] = (2, 3)
TEXT_EVAL_SIZE = 100
TEXT_TRAIN_SIZE = 2000

VOCABULARY: list[str] = sorted(
    set(COUNT_WORDS.values())
    | set(COLORS)
    | set(SHAPES)
    | {s + "s" for s in SHAPES}
    | {"and", "left", "right", "of"}
    | set(TEXT_TEMPLATE.replace('"{}"', "").split())
)

TASKS = ("compositional", "text")
KINDS = ("single", "counting", "two_objects", "position", "text")
_KEYS = ("id", "task", "kind", "prompt", "objects", "relation", "text")
_OBJECT_KEYS = ("shape", "color", "count")

Combo = tuple[str, str]  # (color, shape)


def _object_phrase(color: str, shape: str, count: int) -> str:
    noun = shape if count == 1 else shape + "s"
    return f"{COUNT_WORDS[count]} {color} {noun}"


def format_prompt(meta: dict) -> str:
    """The canonical prompt string of a metadata dict (the inverse of the builders below)."""
    if meta["task"] == "text":
        return TEXT_TEMPLATE.format(meta["text"])
    phrases = [_object_phrase(o["color"], o["shape"], o["count"]) for o in meta["objects"]]
    if meta["relation"] is None:
        return " and ".join(phrases)
    return f"{phrases[0]} {RELATION_WORDS[meta['relation']]} {phrases[1]}"


def _meta(pid: str, kind: str, objects: list[tuple[str, str, int]], relation: str | None) -> dict:
    meta = {
        "id": pid,
        "task": "compositional",
        "kind": kind,
        "prompt": "",
        "objects": [{"shape": s, "color": c, "count": n} for c, s, n in objects],
        "relation": relation,
        "text": None,
    }
    meta["prompt"] = format_prompt(meta)
    return meta


def _transversals() -> list[set[Combo]]:
    """Four disjoint sets of 3 combos (one per shape) that together cover all 12 combos."""
    return [{(COLORS[(i + k) % len(COLORS)], SHAPES[i]) for i in range(len(SHAPES))} for k in range(4)]


def _compositional_prompts(rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """(train, eval) compositional prompts; ids follow a seed-independent canonical order."""
    combos: list[Combo] = [(c, s) for c in COLORS for s in SHAPES]
    held = _transversals()
    pairs = list(itertools.combinations(combos, 2))
    held_pairs = {pairs[i] for i in rng.choice(len(pairs), size=len(pairs) // 4, replace=False)}
    train: list[dict] = []
    evals: list[dict] = []

    def add(kind: str, objs: list[tuple[str, str, int]], rel: str | None, is_eval: bool) -> None:
        meta = _meta(f"comp-{len(train) + len(evals) + 1:04d}", kind, objs, rel)
        (evals if is_eval else train).append(meta)

    for c, s in combos:
        add("single", [(c, s, 1)], None, (c, s) in held[0])
    for n in (2, 3, 4):
        for c, s in combos:
            add("counting", [(c, s, n)], None, (c, s) in held[n - 1])
    for a, b in pairs:
        is_eval = (a, b) in held_pairs
        for x, y in ((a, b), (b, a)):
            add("two_objects", [(*x, 1), (*y, 1)], None, is_eval)
    for a, b in pairs:
        is_eval = (a, b) in held_pairs
        # Both layouts (a left of b, b left of a), each in both phrasings.
        for left, right in ((a, b), (b, a)):
            add("position", [(*left, 1), (*right, 1)], "left_of", is_eval)
            add("position", [(*right, 1), (*left, 1)], "right_of", is_eval)
    return train, evals


def _text_prompts(rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """(train, eval) text prompts; the id is the string's index among all possible strings."""
    strings = ["".join(t) for n in TEXT_LENGTHS for t in itertools.product(TEXT_CHARSET, repeat=n)]
    order = rng.permutation(len(strings))
    picked_eval = sorted(order[:TEXT_EVAL_SIZE])
    picked_train = sorted(order[TEXT_EVAL_SIZE : TEXT_EVAL_SIZE + TEXT_TRAIN_SIZE])

    def meta(i: int) -> dict:
        text = strings[i]
        return {"id": f"text-{i + 1:04d}", "task": "text", "kind": "text",
                "prompt": TEXT_TEMPLATE.format(text), "objects": [], "relation": None, "text": text}

    return [meta(i) for i in picked_train], [meta(i) for i in picked_eval]


def build_prompt_sets(seed: int = 0) -> dict[str, list[dict]]:
    """All prompt sets, deterministic in `seed`.

    Returns {"compositional_train", "compositional_eval", "text_train", "text_eval"} -> list of metas.
    Sizes at any seed: 336 / 108 compositional, 2000 / 100 text.
    """
    rng = np.random.default_rng([seed, 7919])  # fixed stream tag: other code seeding with `seed` differs
    comp_train, comp_eval = _compositional_prompts(rng)
    text_train, text_eval = _text_prompts(rng)
    return {
        "compositional_train": comp_train,
        "compositional_eval": comp_eval,
        "text_train": text_train,
        "text_eval": text_eval,
    }


def write_prompt_files(out_dir: str | os.PathLike = "data/prompts", seed: int = 0) -> list[Path]:
    """Write one `<set>.jsonl` per prompt set into out_dir (atomically: temp file, then rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, metas in build_prompt_sets(seed).items():
        path = out / f"{name}.jsonl"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for meta in metas:
                    f.write(json.dumps(meta, sort_keys=False) + "\n")
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; these are shared data files
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        paths.append(path)
    return paths


def validate_meta(meta: object) -> None:
    """Raise ValueError("key '<k>': <why>") (one line) if `meta` does not follow the schema."""
    if not isinstance(meta, dict):
        raise ValueError(f"key '<row>': expected a JSON object, got {type(meta).__name__}")
    for key in _KEYS:
        if key not in meta:
            raise ValueError(f"key '{key}': missing")
    extra = sorted(set(meta) - set(_KEYS))
    if extra:
        raise ValueError(f"key '{extra[0]}': unknown key")
    if not isinstance(meta["id"], str) or not meta["id"]:
        raise ValueError("key 'id': must be a non-empty string")
    if meta["task"] not in TASKS:
        raise ValueError(f"key 'task': {meta['task']!r} not in {TASKS}")
    if meta["task"] == "text":
        _validate_text(meta)
    else:
        _validate_compositional(meta)
    if meta["prompt"] != format_prompt(meta):
        raise ValueError(f"key 'prompt': {meta['prompt']!r} != expected {format_prompt(meta)!r}")


def _validate_text(meta: dict) -> None:
    if meta["kind"] != "text":
        raise ValueError(f"key 'kind': text task needs kind 'text', got {meta['kind']!r}")
    text = meta["text"]
    if not isinstance(text, str) or not text or any(ch not in TEXT_CHARSET for ch in text):
        raise ValueError(f"key 'text': {text!r} must be a non-empty string over {TEXT_CHARSET!r}")
    if meta["objects"] != []:
        raise ValueError("key 'objects': must be [] for the text task")
    if meta["relation"] is not None:
        raise ValueError("key 'relation': must be null for the text task")


def _validate_compositional(meta: dict) -> None:
    kind, objects, relation = meta["kind"], meta["objects"], meta["relation"]
    n_objects = {"single": 1, "counting": 1, "two_objects": 2, "position": 2}
    if kind not in n_objects:
        raise ValueError(f"key 'kind': {kind!r} not a compositional kind {tuple(n_objects)}")
    if meta["text"] is not None:
        raise ValueError("key 'text': must be null for the compositional task")
    if not isinstance(objects, list) or len(objects) != n_objects[kind]:
        raise ValueError(f"key 'objects': kind {kind!r} needs a list of {n_objects[kind]} objects")
    for obj in objects:
        if not isinstance(obj, dict) or set(obj) != set(_OBJECT_KEYS):
            raise ValueError(f"key 'objects': each object needs exactly the keys {_OBJECT_KEYS}")
        if obj["shape"] not in SHAPES or obj["color"] not in COLORS:
            raise ValueError(f"key 'objects': unknown shape/color {obj['shape']!r}/{obj['color']!r}")
        if obj["count"] not in COUNT_WORDS or isinstance(obj["count"], bool):
            raise ValueError(f"key 'objects': count {obj['count']!r} not in {tuple(COUNT_WORDS)}")
    counts = [o["count"] for o in objects]
    if (kind == "counting") != (counts[0] > 1) or (kind != "counting" and any(n != 1 for n in counts)):
        raise ValueError(f"key 'objects': counts {counts} do not fit kind {kind!r}")
    if (kind == "position") != (relation is not None) or relation not in (None, *RELATION_WORDS):
        raise ValueError(f"key 'relation': {relation!r} does not fit kind {kind!r}")


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read and validate a prompt JSONL file; a bad row raises ``ArtifactError('<file>:<line>: key ...')``
    (a ValueError, and a PipelineError the CLI prints as one line)."""
    from tpgrpo.errors import ArtifactError

    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    metas, seen = [], {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            meta = json.loads(line)
            validate_meta(meta)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path}:{lineno}: key '<row>': invalid JSON ({e.msg})") from None
        except ValueError as e:
            raise ArtifactError(f"{path}:{lineno}: {e}") from None
        if meta["id"] in seen:  # ids name the prompt groups of the credit stage: two prompts, one group
            raise ArtifactError(f"{path}:{lineno}: key 'id': {meta['id']!r} already on line {seen[meta['id']]}")
        seen[meta["id"]] = lineno
        metas.append(meta)
    return metas
