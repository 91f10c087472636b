"""bench/studies/look_guard.py: the guard fixed before the third equal-wall test, on its pure rule and on an archive
whose seconds the docs state (m31c: the tree's 60 iterations took 728 s against Flow-GRPO's 688 s at 24)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.studies import look_guard

REPO = Path(__file__).resolve().parents[1]

SECONDS = {48: 580.0, 54: 653.0, 60: 728.0}


def test_the_planned_iteration_stands_within_the_tolerance():
    assert look_guard.guarded_iteration(SECONDS, 688.0, 60, 0.10)[0] == 60


@pytest.mark.parametrize("tolerance, reference, expected", [(0.03, 688.0, 54), (0.0, 600.0, 48)])
def test_over_the_tolerance_the_largest_iteration_within_the_references_seconds(tolerance, reference, expected):
    chosen, why = look_guard.guarded_iteration(SECONDS, reference, 60, tolerance)
    assert chosen == expected and "over the tolerance" in why


def test_no_iteration_within_the_references_seconds_is_an_error():
    with pytest.raises(SystemExit):
        look_guard.guarded_iteration(SECONDS, 500.0, 60, 0.0)


def test_the_m31c_archive_reads_at_60_and_at_54_with_a_3_percent_tolerance():
    archive = REPO / "results" / "tree_geneval_m31c_issue45"
    script = [sys.executable, "-m", "bench.studies.look_guard", str(archive)]
    out = subprocess.run(script, capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "flow_grpo at 24: 688 s" in out and "60: 728 s" in out
    assert out.strip().splitlines()[-1].startswith("read tree-tp at 60 against flow_grpo at 24")
    out = subprocess.run([*script, "--tolerance", "0.03"], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip().splitlines()[-1].startswith("read tree-tp at 54 against flow_grpo at 24")
