"""Prompt sets: determinism, held-out splits, vocabulary, JSONL round trip and row validation."""

import json
import re
from pathlib import Path

import pytest

from tpgrpo.tasks.prompts import (
    TEXT_CHARSET,
    VOCABULARY,
    build_prompt_sets,
    format_prompt,
    load_prompts,
    write_prompt_files,
)

SETS = build_prompt_sets(seed=0)


def _combos(meta):
    return {(o["color"], o["shape"]) for o in meta["objects"]}


def test_deterministic_and_seed_dependent():
    assert build_prompt_sets(seed=0) == SETS
    other = build_prompt_sets(seed=1)
    assert other["text_eval"] != SETS["text_eval"]
    assert {k: len(v) for k, v in other.items()} == {k: len(v) for k, v in SETS.items()}


def test_sizes_and_kinds():
    sizes = {k: len(v) for k, v in SETS.items()}
    assert sizes == {"compositional_train": 336, "compositional_eval": 108, "text_train": 2000, "text_eval": 100}
    for name in ("compositional_train", "compositional_eval"):
        assert {m["kind"] for m in SETS[name]} == {"single", "counting", "two_objects", "position"}
    for name, metas in SETS.items():
        assert all(m["task"] == name.split("_")[0] for m in metas)


def test_ids_unique_and_stable():
    ids = [m["id"] for metas in SETS.values() for m in metas]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"(comp|text)-\d{4}", i) for i in ids)
    # Compositional ids follow a seed-independent canonical order.
    comp = {m["id"]: m["prompt"] for k in ("compositional_train", "compositional_eval")
            for m in build_prompt_sets(seed=3)[k]}
    assert comp == {m["id"]: m["prompt"] for k in ("compositional_train", "compositional_eval") for m in SETS[k]}


def test_train_eval_disjoint_and_genuinely_held_out():
    for task in ("compositional", "text"):
        train = {m["prompt"] for m in SETS[f"{task}_train"]}
        evals = {m["prompt"] for m in SETS[f"{task}_eval"]}
        assert not train & evals
    train = SETS["compositional_train"]
    # Pairs of objects held out for two_objects/position never appear together in any train prompt.
    train_pairs = {frozenset(_combos(m)) for m in train if len(m["objects"]) == 2}
    for m in SETS["compositional_eval"]:
        if len(m["objects"]) == 2:
            assert frozenset(_combos(m)) not in train_pairs, m["prompt"]
    # A held-out (combo, count) is never a single/counting train prompt, but every combo is one.
    train_counts = {(o["color"], o["shape"], o["count"]) for m in train
                    if m["kind"] in ("single", "counting") for o in m["objects"]}
    for m in SETS["compositional_eval"]:
        if m["kind"] in ("single", "counting"):
            o = m["objects"][0]
            assert (o["color"], o["shape"], o["count"]) not in train_counts
            assert any(c[:2] == (o["color"], o["shape"]) for c in train_counts)
    assert {m["text"] for m in SETS["text_train"]}.isdisjoint({m["text"] for m in SETS["text_eval"]})


def test_every_word_in_vocabulary_and_text_in_charset():
    vocab = set(VOCABULARY)
    assert VOCABULARY == sorted(vocab) and all(w == w.lower() for w in VOCABULARY)
    for metas in SETS.values():
        for m in metas:
            outside = re.sub(r'"[^"]*"', " ", m["prompt"])
            assert set(outside.split()) <= vocab, m["prompt"]
            if m["task"] == "text":
                assert re.search(r'"([^"]*)"', m["prompt"]).group(1) == m["text"]
                assert set(m["text"]) <= set(TEXT_CHARSET) and 2 <= len(m["text"]) <= 3
            assert format_prompt(m) == m["prompt"]


def test_examples():
    prompts = {m["prompt"]: m for k in ("compositional_train", "compositional_eval") for m in SETS[k]}
    m = prompts["a red circle left of a blue square"]
    assert m["kind"] == "position" and m["relation"] == "left_of"
    assert m["objects"] == [{"shape": "circle", "color": "red", "count": 1},
                            {"shape": "square", "color": "blue", "count": 1}]
    assert prompts["four yellow triangles"]["objects"][0]["count"] == 4
    assert "a blue square right of a red circle" in prompts


def test_write_and_load_round_trip(tmp_path):
    paths = write_prompt_files(tmp_path / "prompts")
    assert sorted(p.name for p in paths) == sorted(f"{k}.jsonl" for k in SETS)
    for p in paths:
        assert load_prompts(p) == SETS[p.stem]
    assert not list((tmp_path / "prompts").glob("*.tmp"))  # no temp files left behind


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda m: m.pop("relation"), "relation"),
        (lambda m: m.update(colour="red"), "colour"),
        (lambda m: m.update(task="video"), "task"),
        (lambda m: m.update(prompt="a red square"), "prompt"),
        (lambda m: m["objects"][0].update(count=7), "objects"),
        (lambda m: m["objects"][0].update(color="purple"), "objects"),
        (lambda m: m.update(relation="above"), "relation"),
    ],
)
def test_bad_row_is_a_one_line_error(tmp_path, mutate, key):
    rows = [dict(m, objects=[dict(o) for o in m["objects"]]) for m in SETS["compositional_eval"][-3:]]
    mutate(rows[1])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: key '{key}'"), msg


def test_bad_json_and_bad_text(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*invalid JSON"):
        load_prompts(path)
    row = dict(SETS["text_eval"][0], text="hello", prompt='a sign that says "hello"')
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: key 'text'"):
        load_prompts(path)


def test_shipped_prompt_files_are_current():
    """data/prompts/*.jsonl are `write_prompt_files()` output; regenerate them if this fails."""
    folder = Path(__file__).resolve().parents[1] / "data" / "prompts"
    if not folder.is_dir():
        pytest.skip("data/prompts not generated")
    for name, metas in SETS.items():
        assert load_prompts(folder / f"{name}.jsonl") == metas, name
