"""Machine and code provenance of comparison runs, and the tree arms of a comparison.

The same training seed gave held-out 0.43 on one CPU and 0.46 on another: pairs across machines, or across code
that computes numbers differently, are flagged in the report (no verdict) and refused by ``archive --add``
unless a reason is given. Run folders are built by hand (tests/test_comparison.py's fakes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_comparison import FAKE_CODE, FAKE_MACHINE, fake_run, make_comparison, noisy, write_provenance

from tpgrpo.comparison import runs as cmp
from tpgrpo.comparison import store
from tpgrpo.comparison.archive import add_to_archive, write_archive
from tpgrpo.comparison.claims import collect
from tpgrpo.comparison.provenance import (MACHINE_FILE, machine_record, mismatch, read_machines)
from tpgrpo.comparison.report import write_report
from tpgrpo.errors import PipelineError

OTHER_MACHINE = {**FAKE_MACHINE, "cpu_id": "Vendor/6/2/1", "numeric_flags": ["amx_bf16", "avx2", "avx512f", "fma"]}
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu vme avx avx2 fma avx512f avx512_bf16 hypervisor ssbd
processor\t: 1
model name\t: something else
"""


def test_machine_record_reads_the_cpu_and_only_the_flags_that_change_float_results(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    record = machine_record(3, tmp_path / "cpuinfo")
    assert record["cpu_model"] == "AMD EPYC" and record["cpu_id"] == "AuthenticAMD/25/17/1"
    assert record["numeric_flags"] == ["avx", "avx2", "avx512_bf16", "avx512f", "fma"]  # not hypervisor, ssbd
    assert record["threads"] == 3 and record["torch"]


def folder_with(tmp_path: Path, name: str, machines, code) -> Path:
    folder = tmp_path / name
    (folder / "data").mkdir(parents=True)
    write_provenance(folder, machines, code)
    return folder


@pytest.mark.parametrize("machines_b, code_b, status, words", [
    ([FAKE_MACHINE], FAKE_CODE, "", ""),
    ([{**FAKE_MACHINE, "time": "later"}], FAKE_CODE, "", ""),  # another attempt's time is not the machine
    ([OTHER_MACHINE], FAKE_CODE, "differ", "different machines"),
    ([FAKE_MACHINE, OTHER_MACHINE], FAKE_CODE, "differ", "resumed on another machine"),
    ([{**FAKE_MACHINE, "threads": 2}], FAKE_CODE, "differ", "different machines"),
    ([FAKE_MACHINE], {**FAKE_CODE, "files": {**FAKE_CODE["files"], "stages/probe.py": "f" * 32}}, "differ",
     "different code that computes numbers (stages/probe.py)"),
    ([FAKE_MACHINE], {**FAKE_CODE, "libraries": {"torch": "2.14.0"}}, "differ", "(torch)"),
    (None, FAKE_CODE, "unknown", "no machine.json"),
    ([FAKE_MACHINE], None, "unknown", "no code manifests"),
    # md5s of stripped code (the code hash) against bytes (older manifests, no "hashes"): not evidence either way
    ([FAKE_MACHINE], {**FAKE_CODE, "hashes": "code"}, "unknown", "hashed their code differently (bytes vs code)"),
])
def test_mismatch_names_what_differs(tmp_path, machines_b, code_b, status, words):
    a = folder_with(tmp_path, "a", [FAKE_MACHINE], FAKE_CODE)
    b = folder_with(tmp_path, "b", machines_b, code_b)
    got, why = mismatch([a, b])
    assert got == status and words in why


def test_every_attempt_appends_its_machine_even_a_failed_one(tmp_path):
    """The launcher records the machine before ``tpgrpo run`` starts: a run that fails (here: no params.yaml)
    or is killed still has its attempt recorded, so a resume elsewhere is seen."""
    from tpgrpo.comparison.variants import RunSpec, Variant

    folder = tmp_path / "flow_grpo" / "seed0"
    folder.mkdir(parents=True)
    spec = RunSpec(Variant("flow_grpo", "flow_grpo"), 0, folder)
    for attempt in (1, 2):
        code, _ = cmp.run_one(spec, threads=1)
        assert code != 0 and len(read_machines(folder)) == attempt
    assert mismatch([folder])[0] == "unknown"  # one machine, but no code manifests: nothing ran


def two_machine_comparison(out: Path) -> None:
    """tp seed 1 trained on another machine than everything else."""
    make_comparison(out)
    (out / "tp" / "seed1" / MACHINE_FILE).write_text(json.dumps([OTHER_MACHINE]))


def test_the_report_flags_pairs_across_machines_and_gives_them_no_verdict(tmp_path):
    two_machine_comparison(tmp_path / "cmp")
    tables = collect(tmp_path / "cmp", n_boot=50)
    pairs = tables["pairs"].set_index(["a", "b", "kind"])
    assert pairs.loc[("tp", "flow_grpo", "iteration"), "note"].startswith("not comparable: ")
    assert pairs.loc[("incremental", "flow_grpo", "iteration"), "note"] == ""  # seed 0 only: one machine
    claim = tables["claims"].set_index("a").loc["tp"].iloc[0]
    assert claim["verdict"] == "not comparable"
    text = write_report([tmp_path / "cmp"], tmp_path / "report.md", n_boot=50).read_text()
    assert "more than one: pairs across them are flagged" in text and "Vendor/6/2/1" in text


def test_archive_add_refuses_another_machine_or_code_unless_a_reason_is_given(tmp_path):
    first, dest = tmp_path / "cmp", tmp_path / "archive"
    make_comparison(first)
    write_archive(first, dest)
    assert store.is_file(dest / "tp" / "seed0" / MACHINE_FILE) and store.is_file(dest / "tp" / "seed0" / "data/code/probe.json")
    base = noisy(0.3, 0)
    elsewhere = tmp_path / "elsewhere"
    fake_run(elsewhere, "tp", "tp", 2, {0: base, 2: noisy(0.5, 40), 4: noisy(0.7, 41)}, 4, machines=[OTHER_MACHINE])
    with pytest.raises(PipelineError, match="different machines.*--accept"):
        add_to_archive(elsewhere, dest)
    changed = tmp_path / "changed"
    fake_run(changed, "tp", "tp", 3, {0: base, 2: noisy(0.5, 42), 4: noisy(0.7, 43)}, 4,
             code={**FAKE_CODE, "files": {**FAKE_CODE["files"], "tpgrpo/algo/credit.py": "e" * 32}})
    with pytest.raises(PipelineError, match="tpgrpo/algo/credit.py"):
        add_to_archive(changed, dest)
    unrecorded = tmp_path / "unrecorded"
    fake_run(unrecorded, "tp", "tp", 4, {0: base, 2: noisy(0.5, 44), 4: noisy(0.7, 45)}, 4, machines=None)
    with pytest.raises(PipelineError, match="cannot check the machine"):
        add_to_archive(unrecorded, dest)
    assert {r["seed"] for r in cmp.discover(dest) if r["variant"] == "tp"} == {0, 1}  # nothing was added
    same = tmp_path / "same"
    fake_run(same, "tp", "tp", 5, {0: base, 2: noisy(0.5, 46), 4: noisy(0.7, 47)}, 4)
    assert add_to_archive(same, dest)["runs"] == 1
    added = add_to_archive(elsewhere, dest, accept="checked: seed 0 gives the same credit table on both CPUs")
    assert added["accepted"].startswith("checked")
    text = write_report([dest], tmp_path / "report.md", n_boot=50).read_text()
    assert "Accepted despite another machine or code: checked" in text


def tree_comparison(out: Path) -> None:
    """flow_grpo at 1.2 s/iteration (no probe) beaten at equal wall clock by tree-tp at 0.6 s/iteration (its
    probe is model-free but timed), extended to 8."""
    base = noisy(0.3, 0)
    for s in (0, 1):
        fake_run(out, "flow_grpo", "flow_grpo", s, {0: base, 2: noisy(0.45, s + 3), 4: noisy(0.5, s + 4)}, 4,
                 scale=0.4)
        fake_run(out, "tree-tp", "tp", s, {0: base, 2: noisy(0.42, s + 20), 4: noisy(0.47, s + 21),
                                           6: noisy(0.65, s + 22), 8: noisy(0.7, s + 23)}, 4, planned=8,
                 scale=0.12, overrides={"tree.enabled": True})
        fake_run(out, "tree-incremental", "incremental", s, {0: base, 2: noisy(0.4, s + 30), 4: noisy(0.45, s + 31)},
                 4, scale=0.12, overrides={"tree.enabled": True})


def test_a_tree_arm_extended_at_equal_wall_clock_is_paired_the_right_way_round(tmp_path):
    """The equal-wall pass gave tree-tp (the cheaper arm) the extra iterations: the pair is flow_grpo - tree-tp
    with tree-tp at the iteration flow_grpo's 4 iterations of seconds buy (8), and the claim "the tree beats
    Flow-GRPO at equal wall clock" reads it turned round: +0.2, confirmed."""
    tree_comparison(tmp_path / "cmp")
    tables = collect(tmp_path / "cmp", n_boot=50)
    pair = tables["pairs"].set_index(["a", "b", "kind"]).loc[("flow_grpo", "tree-tp", "equal_wall")]
    assert (pair["iteration_a"], pair["iteration_b"]) == ("4", "8")
    claims = tables["claims"].set_index("claim")
    wall = claims.loc["TP-GRPO on trees beats Flow-GRPO at equal wall-clock time (the tree given the iterations its "
                      "cheaper iteration buys)"]
    assert wall["reward_diff"] == pytest.approx(-pair["reward_diff"]) and wall["reward_diff"] > 0.15
    assert wall["verdict"] == "confirmed"
    same = claims.loc["TP-GRPO on trees beats Flow-GRPO at the same iteration"]
    assert abs(same["reward_diff"]) < 0.1
    assert claims.loc["on trees, turning points beat incremental credit at the same iteration", "reward_diff"] > 0
    assert claims.loc["TP-GRPO on trees beats TP-GRPO on chains at the same iteration", "verdict"] == "not run"
    headline = tables["headline"].set_index("variant")  # iterations to flow_grpo's best, as for every main arm:
    # tree-tp gets there only in the iterations the equal-wall pass gave it (between 4 and 6)
    assert 4 < headline.loc["tree-tp", "iteration"] < 6 and headline.loc["tree-tp", "seconds"] > 0
    assert headline.loc["tree-incremental", "seeds_reaching"] == 0  # not extended: followed to the budget


CHAIN_WALL = ("TP-GRPO on trees beats TP-GRPO on chains at equal wall-clock time (the tree given the iterations its "
              "cheaper iteration buys)")


@pytest.mark.parametrize("tree_to", [8, 16])
def test_a_tree_arm_short_of_chain_tps_seconds_gets_no_equal_wall_verdict_against_it(tmp_path, tree_to):
    """Chain tp costs 4x tree-tp per iteration: its 4 iterations buy the tree 16. A tree extended to 8 (what
    flow_grpo's seconds buy) would pair at its nearest evaluated iteration, 8, with half chain tp's time: the
    pair says so and the claim gets no verdict. Extended to 16, it is paired there, and flow_grpo's pair stays
    at 8."""
    out = tmp_path / "cmp"
    tree_comparison(out)
    base = noisy(0.3, 0)
    for s in (0, 1):
        fake_run(out, "tp", "tp", s, {0: base, 2: noisy(0.42, s + 40), 4: noisy(0.48, s + 41)}, 4, scale=0.48)
        if tree_to == 16:
            (out / "tree-tp" / f"seed{s}").rename(tmp_path / f"old{s}")
            fake_run(out, "tree-tp", "tp", s, {0: base, **{i: noisy(0.4 + 0.02 * i, s + 20 + i) for i in
                                                            range(2, 17, 2)}}, 4, planned=16, scale=0.12,
                     overrides={"tree.enabled": True})
    tables = collect(out, n_boot=50)
    pairs = tables["pairs"].set_index(["a", "b", "kind"])
    chain = pairs.loc[("tp", "tree-tp", "equal_wall")]
    claim = tables["claims"].set_index("claim").loc[CHAIN_WALL]
    assert pairs.loc[("flow_grpo", "tree-tp", "equal_wall"), "iteration_b"] == "8"
    if tree_to == 8:
        assert chain["reward_diff"] != chain["reward_diff"]  # NaN: not compared
        assert "tree-tp seed 0 is evaluated to iteration 8 of the 16 that tp's training seconds buy" in chain["note"]
        assert claim["verdict"] == "not run" and "of the 16" in claim["note"]
    else:
        assert chain["iteration_b"] == "16" and claim["reward_diff"] == pytest.approx(-chain["reward_diff"])
        assert claim["verdict"] == "confirmed"  # 0.72 against 0.48


def test_equal_wall_passes_of_one_target_against_two_references_are_both_kept(tmp_path):
    """flow_grpo's seconds and chain tp's seconds each buy the tree its own count: one record each; the tree's
    params keep the larger (a second pass never lowers them)."""
    out = tmp_path / "cmp"
    tree_comparison(out)
    for s in (0, 1):
        fake_run(out, "tp", "tp", s, {0: noisy(0.3, 0), 2: noisy(0.42, s), 4: noisy(0.48, s)}, 4, scale=0.48)
    by_chain, _ = cmp.equal_wall_plan(out, "tp", "tree-tp")
    by_flow, _ = cmp.equal_wall_plan(out, "flow_grpo", "tree-tp")
    records = cmp.equal_wall_records(out)
    assert [(r["reference"], r["iterations"]) for r in records] == [("tp", by_chain["iterations"]),
                                                                   ("flow_grpo", by_flow["iterations"])]
    assert by_chain["iterations"] > by_flow["iterations"]
    planned = {yaml.safe_load((out / "tree-tp" / f"seed{s}" / "params.yaml").read_text())["train"]["iterations"]
               for s in (0, 1)}
    assert planned == {by_chain["iterations"]}


def test_tree_modes_make_tree_arms_with_the_tree_switched_on(tmp_path):
    from tpgrpo.comparison.cli import _variants
    from tpgrpo.config import ConfigError

    arms = {v.name: v for v in _variants("flow_grpo", "0,1", [], [], "", "", "", "", tree_modes="tp,incremental")}
    assert list(arms) == ["flow_grpo", "tree-tp", "tree-incremental"]
    assert arms["tree-tp"].overrides == {"tree.enabled": True} and arms["tree-tp"].mode == "tp"
    assert "tree.enabled" not in arms["flow_grpo"].overrides
    only = _variants("", "0", ["eval.every=3"], [], "", "", "", "", tree_modes="incremental")
    assert [(v.name, v.overrides) for v in only] == [("tree-incremental", {"eval.every": 3, "tree.enabled": True})]
    with pytest.raises(ConfigError, match="tree modes \\['tpx'\\]"):
        _variants("", "0", [], [], "", "", "", "", tree_modes="tpx")
    with pytest.raises(ConfigError, match="both empty"):
        _variants("", "0", [], [], "", "", "", "", tree_modes="")


def test_mode_set_gives_a_tree_arm_its_own_shape_and_leaves_the_chains_alone():
    from tpgrpo.comparison.cli import _variants
    from tpgrpo.config import ConfigError

    arms = {v.name: v for v in _variants("flow_grpo,tp", "0", [], ["tree-tp:tree.roots=4", "tp:update.lr=0.01"],
                                         "", "", "", "", tree_modes="tp")}
    assert arms["tree-tp"].overrides == {"tree.roots": 4, "tree.enabled": True}
    assert arms["tp"].overrides == {"update.lr": 0.01} and arms["flow_grpo"].overrides == {}
    with pytest.raises(ConfigError, match="'tree-incremental': not among the tree arms \\(tree-tp\\)"):
        _variants("flow_grpo", "0", [], ["tree-incremental:tree.roots=2"], "", "", "", "", tree_modes="tp")
    with pytest.raises(ConfigError, match="no --tree-modes"):
        _variants("flow_grpo", "0", [], ["tree-tp:tree.roots=2"], "", "", "", "")
