"""A stage's lock write that rewrites its own block only (tpgrpo.pipeline.dvc_integration.lock_blocks) writes the
bytes DVC's own write would: random sequences of stage entries, written both ways and compared after every step;
files of another shape go to DVC's own code; and through a real ``dvc repro`` the lock is the one plain DVC
writes."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_dvc_atomic import PIPELINE, _atomic_dvc, _env

from tpgrpo.pipeline.dvc_integration.lock_blocks import HEADER, split_blocks, updated_text

WORDS = ["tpgrpo", "stage", "rollout", "--iter", "data/iters/0001/trajectories.zarr", "x" * 70, "é", "a: b", "#",
         "'quoted'", '"double"', "yes", "null", "0123", "2.0", "1e-05", "~", "[1, 2]", "{a: 1}", "*", "&x"]


def _scalar(rng: random.Random):
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randrange(-10**12, 10**12)
    if kind == 1:
        return rng.choice([3e-4, 1e-05, 0.1, 26.0, 1e20, -0.0, 2.5e-7, 0.3, float("inf"), 123456.789])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return ""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))  # long ones wrap at column 80


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6) if depth < 2 else 0
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 5:
        return {f"k{i}.{rng.choice(WORDS)[:8]}": _value(rng, depth + 1) for i in range(rng.randrange(0, 4))}
    return _scalar(rng)


def _file_entry(rng: random.Random) -> dict:
    entry = {"path": rng.choice(WORDS[4:6]) + str(rng.randrange(100)), "hash": "md5",
             "md5": "%032x" % rng.getrandbits(128) + rng.choice(["", ".dir"]), "size": rng.randrange(10**10)}
    if rng.random() < 0.3:
        entry["nfiles"] = rng.randrange(1, 500)
    return entry


def random_entry(rng: random.Random) -> dict:
    """A lock entry of the shape DVC's ``serialize.to_lockfile`` makes, with awkward values."""
    entry = {"cmd": _scalar(rng) if rng.random() < 0.2 else " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 30)))}
    if rng.random() < 0.9:
        entry["deps"] = [_file_entry(rng) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.7:
        entry["params"] = {"params.yaml": {f"{rng.choice(['train', 'tree', 'model'])}.{i}": _value(rng)
                                           for i in range(rng.randrange(1, 6))}}
    if rng.random() < 0.9:
        entry["outs"] = [_file_entry(rng) for _ in range(rng.randrange(1, 4))]
    return entry


NAMES = ["code", "rollout-0001", "probe-0001", "credit-0001", "update-0001", "eval-0010", "eval_prompts",
         "summary", "a@b", "with space", "0001", "yes", "-dash", "x" * 90]


def dvc_write(path: Path, entries: dict[str, dict]) -> None:
    """What DVC's ``Lockfile.dump_stages`` does to the file: round-trip parse, update, dump the whole."""
    from dvc.utils.serialize import modify_yaml

    with modify_yaml(path) as data:
        if not data:
            data.update({"schema": "2.0"})
        data["stages"] = data.get("stages", {})
        data["stages"].update(entries)


def parse(text: str):
    from dvc.utils.serialize import parse_yaml

    return parse_yaml(text, "dvc.lock")


def block_write(path: Path, entries: dict[str, dict]) -> bool:
    """What lock_blocks' dump_stages does; False when it left the file to DVC's own write."""
    from dvc.utils.serialize._yaml import _dump

    new = updated_text(path.read_text(encoding="utf-8"), entries, _dump, parse)
    if new is None:  # text that may hold an anchor: DVC's own write, as dump_stages falls back
        dvc_write(path, entries)
        return False
    path.write_text(new[0], encoding="utf-8")
    return True


@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_of_stage_writes_give_dvcs_own_bytes(tmp_path: Path, seed: int):
    rng = random.Random(1000 + seed)
    ours, theirs = tmp_path / "ours.lock", tmp_path / "theirs.lock"
    dvc_write(theirs, {rng.choice(NAMES): random_entry(rng)})  # the first write of a lock is DVC's own
    ours.write_bytes(theirs.read_bytes())
    cut = 0
    for step in range(10):
        entries = {rng.choice(NAMES): random_entry(rng) for _ in range(rng.choice([1, 1, 1, 2]))}
        if rng.random() < 0.2 and split_blocks(theirs.read_text(), parse):  # write a known stage again, unchanged
            entries = {}
        dvc_write(theirs, entries)
        cut += block_write(ours, entries)
        assert ours.read_bytes() == theirs.read_bytes(), f"seed {seed} step {step}: {sorted(entries)}"
    assert cut >= 5, f"only {cut} of 10 writes cut the file: the test would not test lock_blocks"


@pytest.mark.parametrize("seed", range(4))
def test_after_a_seal_rewrote_the_lock_with_pyyaml_writes_keep_dvcs_data(tmp_path: Path, seed: int):
    """Sealing rewrites the root lock with PyYAML (tpgrpo.pipeline.long_runs.blocks.write_yaml), in another style than
    DVC's: then the blocks left alone keep that style, so the bytes differ from DVC's full re-emission, but what
    DVC reads back from the file is the same after every write."""
    from dvc.utils.serialize import parse_yaml

    from tpgrpo.pipeline.long_runs.blocks import write_yaml

    rng = random.Random(2000 + seed)
    ours, theirs = tmp_path / "ours.lock", tmp_path / "theirs.lock"
    write_yaml(theirs, {"schema": "2.0", "stages": {rng.choice(NAMES): random_entry(rng) for _ in range(4)}})
    ours.write_bytes(theirs.read_bytes())
    for step in range(8):
        entries = {rng.choice(NAMES): random_entry(rng)}
        dvc_write(theirs, entries)
        block_write(ours, entries)
        assert parse_yaml(ours.read_text(), str(ours)) == parse_yaml(theirs.read_text(), str(theirs)), step


def test_an_unchanged_entry_is_no_change_and_a_changed_one_is():
    from dvc.utils.serialize._yaml import _dump

    entry = {"cmd": "tpgrpo stage code", "outs": [{"path": "a", "hash": "md5", "md5": "0" * 32, "size": 1}]}
    text = updated_text(HEADER, {"code": entry}, _dump, parse)[0]
    assert updated_text(text, {"code": entry}, _dump, parse) == (text, False)
    again, changed = updated_text(text, {"code": dict(entry, cmd="tpgrpo stage code --x")}, _dump, parse)
    assert changed and again.count("  code:\n") == 1 and "--x" in again


def test_a_dumper_that_writes_another_shape_leaves_the_file_to_dvc():
    from dvc.utils.serialize._yaml import _dump

    text = updated_text(HEADER, {"code": {"cmd": "a"}}, _dump, parse)[0]
    assert updated_text(text, {"code": {"cmd": "b"}}, lambda data, stream: stream.write("{}\n"), parse) is None


@pytest.mark.parametrize("text", [
    "",  # empty
    "schema: '2.0'\nstages:\n  code:\n    cmd: a\n",  # ... well formed, then each damage below:
    "schema: '2.0'\nstages:\n  code:\n    cmd: a\n# a comment\n",
    "schema: '2.0'\nstages:\n  code:\n    cmd: a\ndatasets:\n- name: d\n",
    "schema: '2.0'\nstages:\n  code: {cmd: a}\n",
    "schema: '2.0'\nstages:\n  ? very long key\n  : cmd: a\n",
    "schema: '2.0'\nstages:\n  code:\n    cmd: a\n  code:\n    cmd: b\n",
    "schema: '2.0'\nstages:\n  'yes':\n    cmd: a\n  yes:\n    cmd: b\n",  # one name, quoted two ways
    "schema: '2.0'\nstages:\n  1:\n    cmd: a\n",  # not a string
    "schema: '2.0'\nstages:\n  code:\n    p: &id001\n      x: 1\n  b:\n    p: *id001\n",  # an anchor, an alias
    "schema: '2.0'\nstages:\n    cmd: a\n",
    "schema: '2.0'\nstages:\n  code:\n    cmd: a",  # no final newline
    "schema: '2.0'\nstages:\n  code:\n\n    cmd: a\n",  # a blank line
    "schema: '3.0'\nstages:\n  code:\n    cmd: a\n",
])
def test_only_a_header_and_stage_blocks_are_cut(text: str):
    blocks = split_blocks(text, parse)
    assert (blocks is not None) == (text == "schema: '2.0'\nstages:\n  code:\n    cmd: a\n")
    if blocks is not None:
        assert HEADER + "".join(blocks.values()) == text


def test_a_lock_whose_stages_share_an_anchor_is_not_cut_and_tpgrpo_writes_none(tmp_path: Path):
    """Found by the randomised harness (bench/up_to_date.py --seed 2020, an edit during a run): unsealing
    restored a block's params value into each of its stages as one shared object, PyYAML wrote it as an anchor
    in one stage's entry and aliases in the others, and rewriting the anchor's stage alone left aliases to
    nothing: "dvc.lock: not readable as YAML". Such a file now goes to DVC's own write, and tpgrpo's own
    writer spells shared objects out."""
    import yaml
    from dvc.utils.serialize._yaml import _dump

    from tpgrpo.pipeline.long_runs.blocks import read_lock, write_lock

    shared = {"train_prompts": "data/prompts/a.jsonl", "reward": "geneval_soft"}
    stages = {name: {"cmd": f"tpgrpo stage {name}", "params": {"params.yaml": {"task": shared}}}
              for name in ("code", "rollout-0001")}
    anchored = yaml.safe_dump({"schema": "2.0", "stages": stages}, sort_keys=False)  # the writer before
    assert "&id001" in anchored and "*id001" in anchored
    new_entry = {"cmd": "tpgrpo stage code", "params": {"params.yaml": {"task": dict(shared, reward="jpeg")}}}
    assert updated_text(anchored, {"code": new_entry}, _dump, parse) is None
    (tmp_path / "theirs.lock").write_text(anchored)
    dvc_write(tmp_path / "theirs.lock", {"code": new_entry})  # what then writes it: DVC's own code
    assert parse((tmp_path / "theirs.lock").read_text())["stages"]["rollout-0001"]["params"]["params.yaml"][
        "task"] == shared
    write_lock(tmp_path, {"schema": "2.0", "stages": stages})  # tpgrpo's writer: no anchor
    text = (tmp_path / "dvc.lock").read_text()
    assert "&" not in text and "*" not in text
    block_write(tmp_path / "dvc.lock", {"code": new_entry})
    assert read_lock(tmp_path)["stages"]["rollout-0001"]["params"]["params.yaml"]["task"] == shared


def _project(root: Path) -> Path:
    root.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=_env(), check=True)
    (root / "dvc.yaml").write_text(PIPELINE)
    (root / "in.txt").write_text("one\n")
    return root


def test_a_real_repro_writes_the_lock_plain_dvc_writes_and_a_hand_edited_lock_goes_to_dvc(tmp_path: Path):
    ours, plain = _project(tmp_path / "ours"), _project(tmp_path / "plain")
    for text in ("one\n", "two\n"):
        for root in (ours, plain):
            (root / "in.txt").write_text(text)
        assert _atomic_dvc(ours, "repro").returncode == 0
        done = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=plain, env=_env(), capture_output=True)
        assert done.returncode == 0
        assert (ours / "dvc.lock").read_bytes() == (plain / "dvc.lock").read_bytes()
    # a comment added by hand: not a shape lock_blocks cuts, so DVC's own write (which keeps the comment) runs
    lock = ours / "dvc.lock"
    lock.write_text("# kept\n" + lock.read_text())
    (ours / "in.txt").write_text("three\n")
    assert _atomic_dvc(ours, "repro").returncode == 0
    assert lock.read_text().startswith("# kept\n") and "THREE" in (ours / "b.txt").read_text()
    assert _atomic_dvc(ours, "status").stdout.strip() == "Data and pipelines are up to date."
