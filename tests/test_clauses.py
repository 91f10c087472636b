"""The clause breakdown names exactly the clause a rendered violation breaks, and agrees with strict."""

from __future__ import annotations

import numpy as np
import pytest

from tpgrpo.tasks import geneval
from tpgrpo.tasks.clauses import CLAUSES, clause_markdown, clause_table, failed_clauses, side_sign
from tpgrpo.tasks.detect import detect
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import render_prompt, render_violation


@pytest.fixture(scope="module")
def metas() -> list[dict]:
    return build_prompt_sets(seed=0)["compositional_eval"]


def test_clean_renders_break_nothing_and_are_strict(metas):
    rng = np.random.default_rng(0)
    for meta in metas:
        det = detect(render_prompt(meta, rng))
        assert failed_clauses(det, meta) == ()
        assert geneval.score(det, meta, soft=False).strict
        assert side_sign(det, meta) == (1 if meta["relation"] else 0)


@pytest.mark.parametrize("violation, clause", [("wrong_color", "colour"), ("wrong_shape", "shape"),
                                               ("wrong_side", "side"), ("wrong_count", None)])
def test_a_violation_breaks_its_own_clause(metas, violation, clause):
    rng = np.random.default_rng(1)
    picked = [m for m in metas if violation != "wrong_side" or m["kind"] == "position"]
    for meta in picked:
        det = detect(render_violation(meta, violation, rng))
        broken = failed_clauses(det, meta)
        # a count one too many is an extra object; one too few (or a pair's second gone) a missing one
        expected = clause or ("extra" if len(det.objects) > len(geneval._slots(meta)) else "missing")
        assert expected in broken, (meta["prompt"], violation, broken)
        assert not geneval.score(det, meta, soft=False).strict
        if violation == "wrong_side":
            assert side_sign(det, meta) == -1


def test_the_table_counts_per_kind_and_side_against_chance(metas):
    rng = np.random.default_rng(2)
    pos = [m for m in metas if m["kind"] == "position"][:20]
    images = np.stack([render_prompt(m, rng) if i % 2 else render_violation(m, "wrong_side", rng)
                       for i, m in enumerate(pos)])
    table = clause_table(images, pos)
    row = table["position"]
    assert row["n"] == 20 and row["side"] == 0.5 and row["side_right"] == 0.5 and row["strict"] == 0.5
    assert table["all"] == row
    assert all(row[c] == 0.0 for c in CLAUSES if c != "side")
    text = clause_markdown(table)
    assert text.count("\n") == 4 and "| position | 20 | 0.500 |" in text
