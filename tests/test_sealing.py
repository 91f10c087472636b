"""Sealed blocks and retention: the bookkeeping pieces on hand-made files (fast), then a real run (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_params

from tpgrpo.config import ConfigError, config_from_dict
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.rendering.dvcfile import STAGE_PARAMS, block_out_paths, block_stage, iteration_stages, render, write_block_dvcfile
from tpgrpo.pipeline.migrate import migrate, refuse_older_layout
from tpgrpo.pipeline.long_runs.sealing import kept_outs, repro_ends, retain, sealable, stage_names, unseal_changed
from tpgrpo.pipeline.long_runs.blocks import (Block, current_entries, disagreements, full_blocks, param_values,
                                              read_as_dvc, read_lock, write_block_entry, read_seal, write_lock,
                                              write_yaml)


def _raw(**train) -> dict:
    raw = tiny_params()
    raw["train"].update(train)
    return raw


def _cfg(**train):
    return config_from_dict(_raw(**train))


def test_full_blocks_cover_only_complete_blocks_inside_the_run():
    assert full_blocks(25, 60) == [Block(1, 25), Block(26, 50)]
    assert full_blocks(25, 50)[-1] == Block(26, 50)
    assert full_blocks(25, 24) == [] and full_blocks(0, 1000) == []
    assert Block(26, 50).name == "iters-0026-0050"


def test_block_size_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.block_size = -1: expected a value >= 0"):
        _cfg(block_size=-1)


def test_block_stage_is_the_union_of_its_stages_minus_what_the_block_makes_itself():
    cfg = _cfg(iterations=6, block_size=3)
    block = Block(4, 6)
    stage = block_stage(cfg, block)
    inner = [st for i in block.iterations for st in iteration_stages(cfg, i).values()]
    outs = block_out_paths(cfg, block)
    assert "data/iters/0003/policy" in stage["deps"]  # the previous block's last adapter starts this block
    assert "data/iters/eval_prompt_embeds" in stage["deps"]  # its evals read the once-per-run embeddings
    assert not set(stage["deps"]) & set(outs)  # its own intermediate products are not deps
    outside = {d for st in inner for d in st["deps"]} - set(outs)
    assert set(stage["deps"]) == outside
    every = {p for st in inner for p in st["params"]}
    assert all(any(p == q or p.startswith(q + ".") for q in stage["params"]) for p in every)
    assert "credit" in stage["params"] and "train.seed" in stage["params"]
    assert len(outs) == 3 * 11 + 1 and stage["cmd"] == "tpgrpo block --first 4 --last 6"
    assert outs[-1] == "data/iters/0006/block_logs.json"  # the digest of the logs the summary reads
    kept = [p for p in outs if not p.endswith("trajectories.zarr")]
    assert [o if isinstance(o, str) else next(iter(o)) for o in block_stage(cfg, block, kept)["outs"]] == kept


def _seal(root: Path, cfg, block: Block, lock: dict, old_layout: bool = False) -> None:
    """Seal by hand what `seal_finished` would: a seal file, the block's pipeline file and its lock entry
    (``old_layout``: the entry in the root lock ``lock``, as sealing wrote it before)."""
    names = stage_names(cfg, block)
    entries = {n: {"cmd": n, "outs": []} for n in names}
    write_yaml(block.entries_path(root), entries)
    write_yaml(block.seal_path(root), {"first": block.first, "last": block.last,
                                       "outs": block_out_paths(cfg, block)})
    params = block_stage(cfg, block)["params"]
    raw = yaml.safe_load((root / "params.yaml").read_text())
    entry = {"cmd": "x", "params": {"params.yaml": param_values(raw, params)},
             "outs": [{"path": p, "md5": "0"} for p in block_out_paths(cfg, block)]}
    if old_layout:  # sealed before blocks had their own pipeline files: the entry in the root dvc.lock
        lock["stages"][block.name] = entry
    else:
        write_block_entry(root, block, entry)
        write_block_dvcfile(cfg, root, block)


def _project(tmp_path: Path, **train) -> Path:
    raw = _raw(**train)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return tmp_path


def test_dvc_yaml_work_stays_bounded_as_sealed_blocks_pile_up(tmp_path):
    """The root dvc.yaml and dvc.lock do not grow with sealed blocks: each block is one stage in its own
    pipeline file with its own lock (DVC rewrites only the lock of the file whose stage ran)."""
    counts = {}
    for n in (20, 200):
        root = _project(tmp_path / str(n), iterations=n, block_size=20)
        cfg = _cfg(iterations=n, block_size=20)
        lock = {"schema": "2.0", "stages": {}}
        for block in full_blocks(20, n):
            _seal(root, cfg, block, lock)
        stages = render(cfg, root)["stages"]
        assert not any(name.startswith(("rollout-", "iters-")) for name in stages)
        counts[n] = (len(stages), sum(len(st["deps"]) for st in stages.values()))
        blocks = sorted((root / "data" / "seals").glob("*/dvc.yaml"))
        assert len(blocks) == n // 20 and all(len(yaml.safe_load(f.read_text())["stages"]) == 1 for f in blocks)
        assert not lock["stages"]  # nothing of the blocks in the root lock
    flat = render(_cfg(iterations=200, block_size=0))["stages"]
    flat_deps = sum(len(st["deps"]) for st in flat.values())
    assert counts[200][0] == counts[20][0]  # no stage per block in the root file
    assert counts[200][1] < flat_deps / 10, (counts, flat_deps)
    summary = render(cfg, root)["stages"]["summary"]
    assert len(summary["deps"]) < 30  # not one dep per iteration's logs


def test_a_run_is_reproduced_block_by_block_each_rendered_through_its_end(tmp_path):
    root = _project(tmp_path, iterations=5, block_size=2)
    cfg = _cfg(iterations=5, block_size=2)
    assert repro_ends(root, cfg) == [2, 4, 5]  # nothing sealed yet: every block, then the rest
    first = render(cfg, root, upto=2)["stages"]
    assert "rollout-0002" in first and "rollout-0003" not in first and "summary" not in first
    lock = {"schema": "2.0", "stages": {}}
    _seal(root, cfg, Block(1, 2), lock)
    assert repro_ends(root, cfg) == [4, 5]
    second = render(cfg, root, upto=4)["stages"]
    assert "rollout-0001" not in second and "rollout-0003" in second and "rollout-0005" not in second
    assert "iters-0001-0002" in yaml.safe_load(Block(1, 2).dvcfile(root).read_text())["stages"]
    assert render(cfg, root, upto=5) == render(cfg, root)  # the last repro sees the whole run
    assert "summary" in render(cfg, root)["stages"]
    assert repro_ends(root, _cfg(iterations=5, block_size=0)) == [5]  # sealing off: one repro


def test_only_blocks_reproduced_in_this_repro_are_sealed():
    cfg = _cfg(iterations=4, block_size=2)
    entries = {n: {} for b in full_blocks(2, 4) for n in stage_names(cfg, b)}  # both blocks have entries
    # block 2's entries may be stale (restored by unsealing) while only iterations 1..2 were reproduced
    assert sealable(cfg, entries, {}, upto=2) == [Block(1, 2)]
    assert sealable(cfg, entries, {}) == [Block(1, 2), Block(3, 4)]
    assert sealable(cfg, entries, {Block(1, 2): None}, upto=4) == [Block(3, 4)]


def _four_iterations_sealed(tmp_path: Path):
    """A project of 4 iterations in 2 blocks, both sealed by hand; the lock is returned, not written."""
    root = _project(tmp_path, iterations=4, block_size=2)
    cfg = _cfg(iterations=4, block_size=2)
    lock = {"schema": "2.0", "stages": {}}
    for block in full_blocks(2, 4):
        _seal(root, cfg, block, lock)
    return root, cfg, lock


def test_changed_params_unseal_a_block_and_bring_its_per_stage_entries_back(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_block_entry(root, Block(3, 4), None)  # e.g. interrupted between writing the seal and `dvc commit`
    write_lock(root, lock)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    assert unseal_changed(root, cfg, raw) == {Block(3, 4): "it has no dvc.lock entry"}
    assert "credit-0003" in read_lock(root)["stages"] and not Block(3, 4).seal_path(root).exists()
    assert not Block(3, 4).folder(root).exists()  # its pipeline file went with the seal
    assert unseal_changed(root, cfg, raw) == {}  # the matching block stays sealed
    raw["credit"]["mode"] = "incremental"
    assert unseal_changed(root, config_from_dict(raw), raw) == {Block(1, 2): "params changed: credit.mode"}
    stages = read_lock(root)["stages"]
    assert set(stage_names(cfg, Block(1, 2))) <= set(stages) and "iters-0001-0002" not in stages


def test_a_sealed_block_unseals_as_a_repro_reaches_it_and_names_the_real_reason(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["credit"]["mode"] = "incremental"
    changed = config_from_dict(raw)
    assert unseal_changed(root, changed, raw, upto=0) == {}  # not structural: not before a repro reaches it
    assert repro_ends(root, changed, {Block(1, 2), Block(3, 4)}) == [2, 4]
    assert unseal_changed(root, changed, raw, upto=2) == {Block(1, 2): "params changed: credit.mode"}
    assert Block(3, 4).seal_path(root).is_file()  # the root lock holds one block's stages at a time
    # a code manifest the block recorded that differs from today's file: only that kind's stages re-run
    entry = read_as_dvc(Block(3, 4).lockfile(root))["stages"]["iters-0003-0004"]
    entry["params"]["params.yaml"]["credit"]["mode"] = "incremental"
    entry["deps"] = [{"path": "data/code/eval.json", "md5": "old"}]
    write_block_entry(root, Block(3, 4), entry)
    (root / "data" / "code").mkdir(parents=True)
    (root / "data" / "code" / "eval.json").write_text("{}")
    assert unseal_changed(root, changed, raw) == {Block(3, 4): "code changed: data/code/eval.json"}


def test_blocks_sealed_in_the_root_lock_move_into_their_own_files_unchanged(tmp_path):
    root = _project(tmp_path, iterations=4, block_size=2)
    cfg = _cfg(iterations=4, block_size=2)
    lock = {"schema": "2.0", "stages": {"credit-0005": {"cmd": "y"}}}
    for block in full_blocks(2, 4):
        _seal(root, cfg, block, lock, old_layout=True)
    write_lock(root, lock)
    entries = {name: dict(entry) for name, entry in lock["stages"].items()}
    with pytest.raises(PipelineError, match="made by an older version.*sealed blocks recorded in the root "
                       "dvc.lock.*run `tpgrpo migrate` once"):
        refuse_older_layout(root)  # what tpgrpo run, dvc-yaml, retain and the code stage do first
    assert migrate(root, cfg) == ["moved the records of iters-0001-0002, iters-0003-0004 into the blocks' own "
                                  "lock files"]
    refuse_older_layout(root)
    assert read_lock(root)["stages"] == {"credit-0005": {"cmd": "y"}}
    for block in full_blocks(2, 4):
        assert read_as_dvc(block.lockfile(root))["stages"] == {block.name: entries[block.name]}
        assert block.dvcfile(root).is_file()
    assert "iters-0001-0002" not in (root / "dvc.yaml").read_text()


def test_unsealing_restores_each_stage_as_the_blocks_last_run_recorded_it():
    """A code change re-ran the sealed block: DVC rewrote the block's entry (new manifest, new outputs) but
    not the per-stage entries saved at sealing. Restored, each stage must carry the block's newer record."""
    def item(path, md5):
        return {"path": path, "hash": "md5", "md5": md5, "size": 1}
    sealed_then = {
        "credit-0001": {"cmd": "tpgrpo stage credit --iter 1",
                        "deps": [item("data/code/credit.json", "old-code"), item("data/iters/0001/probe.parquet", "p1"),
                                 item("data/only/in/stage", "s")],
                        "params": {"params.yaml": {"credit": {"mode": "tp"}, "probe.completion": "exact",
                                                   "not.in_block": 1}},
                        "outs": [item("data/iters/0001/credit.parquet", "c-old")]}}
    block = {"deps": [item("data/code/credit.json", "new-code")],
             "params": {"params.yaml": {"credit": {"mode": "incremental"}, "probe": {"completion": "ode:2"}}},
             "outs": [item("data/iters/0001/probe.parquet", "p1-new"), item("data/iters/0001/credit.parquet", "c-new")]}
    now = current_entries(sealed_then, block)["credit-0001"]
    assert [d["md5"] for d in now["deps"]] == ["new-code", "p1-new", "s"]  # a path the block lacks: as recorded
    assert [o["md5"] for o in now["outs"]] == ["c-new"]
    assert now["params"]["params.yaml"] == {"credit": {"mode": "incremental"}, "probe.completion": "ode:2",
                                            "not.in_block": 1}
    assert now["cmd"] == sealed_then["credit-0001"]["cmd"]
    assert sealed_then["credit-0001"]["outs"][0]["md5"] == "c-old"  # the input is not modified
    assert current_entries(sealed_then, None) == sealed_then  # no block entry (interrupted sealing): as recorded
    assert disagreements(sealed_then, block) == [
        "credit-0001: data/code/credit.json", "credit-0001: data/iters/0001/probe.parquet",
        "credit-0001: data/iters/0001/credit.parquet", "credit-0001: credit.mode", "credit-0001: probe.completion"]
    assert disagreements(current_entries(sealed_then, block), block) == []
    assert disagreements(sealed_then, None) == ["credit-0001: no block entry"]


def test_a_block_beyond_a_lowered_iteration_count_stays_sealed_for_later(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    raw = _raw(iterations=2, block_size=2)
    assert unseal_changed(root, config_from_dict(raw), raw) == {}
    raw = _raw(iterations=4, block_size=4)  # another block size: the old blocks no longer fit
    assert sorted(unseal_changed(root, config_from_dict(raw), raw, upto=0)) == [Block(1, 2), Block(3, 4)]


def test_lowering_the_iteration_count_into_a_block_unseals_it_and_rendering_alone_refuses(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    raw = _raw(iterations=3, block_size=2)
    lowered = config_from_dict(raw)
    with pytest.raises(ConfigError, match=r"do not fit sealed block iters-0003-0004 \(data/seals/0003-0004.yaml\)"):
        render(lowered, root)  # iteration 3 would render without its lock entries: DVC would re-run it
    assert list(unseal_changed(root, lowered, raw, upto=0)) == [Block(3, 4)]  # structural: at once
    stages = read_lock(root)["stages"]
    assert "credit-0003" in stages and "credit-0004" in stages and "iters-0003-0004" not in stages
    rendered = render(lowered, root)["stages"]
    assert Block(1, 2).dvcfile(root).is_file() and "rollout-0003" in rendered and "rollout-0004" not in rendered


def test_a_block_retention_thinned_is_never_unsealed(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    block = Block(1, 2)
    write_yaml(block.entries_path(root), {"rollout-0001": {"cmd": "x", "outs": [
        {"path": "data/iters/0001/trajectories.zarr", "md5": "a.dir"}]}})
    seal = read_seal(block.seal_path(root))
    seal["outs"].remove("data/iters/0001/trajectories.zarr")  # what `tpgrpo retain` does
    write_yaml(block.seal_path(root), seal)
    raw = _raw(iterations=4, block_size=2)
    raw["eval"]["num_steps"] += 1
    before = (root / "dvc.lock").read_bytes()
    with pytest.raises(PipelineError) as err:
        unseal_changed(root, config_from_dict(raw), raw)
    message = str(err.value)
    assert "\n" not in message and "iters-0001-0002" in message and "eval.num_steps" in message
    assert "data/iters/0001/trajectories.zarr" in message and "retain" in message
    assert (root / "dvc.lock").read_bytes() == before and block.seal_path(root).is_file()


def test_dvc_files_read_and_write_as_dvc_reads_them(tmp_path):
    """YAML 1.2 (DVC) vs 1.1 (PyYAML): a lock DVC wrote reads with DVC's types, and what we write reads back
    the same through DVC's parser (an md5 of digits and one e would otherwise become a float)."""
    from dvc.utils.serialize import parse_yaml

    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  a:\n    params:\n      params.yaml:\n"
                                       "        update.lr: 1e-05\n")
    lock = read_lock(tmp_path)
    assert lock["stages"]["a"]["params"]["params.yaml"]["update.lr"] == 1e-05
    data = {"md5": "1234567890123456789012345678e901", "lr": 1e-05, "s": "1e-4", "n": "1_000", "b": "on"}
    write_yaml(tmp_path / "x.yaml", data)
    assert parse_yaml((tmp_path / "x.yaml").read_text(), "x") == data and yaml.safe_load(
        (tmp_path / "x.yaml").read_text()) == data


def test_retention_keeps_tables_recent_trajectories_and_every_mth_adapter_plus_block_ends():
    raw = _raw(iterations=12, block_size=6)
    raw["retention"] = {"keep_trajectories": 3, "keep_adapter_every": 4}
    cfg = config_from_dict(raw)
    block = Block(7, 12)
    outs = block_out_paths(cfg, block)
    kept = kept_outs(cfg, block, outs, last_done=12)
    trajectories = sorted(int(Path(p).parent.name) for p in kept if p.endswith("trajectories.zarr"))
    adapters = sorted(int(Path(p).parent.name) for p in kept if p.endswith("/policy"))
    assert trajectories == [10, 11, 12] and adapters == [8, 12]
    for table in ("probe.parquet", "credit.parquet", "eval.parquet"):
        assert sum(p.endswith(table) for p in kept) == 6
    raw["retention"] = {"keep_trajectories": 0, "keep_adapter_every": 0}
    assert kept_outs(config_from_dict(raw), block, outs, last_done=12) == outs  # 0 = keep everything


def test_retain_drops_files_from_the_workspace_the_block_outs_and_the_lock(tmp_path):
    root = _project(tmp_path, iterations=4, block_size=2)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["retention"] = {"keep_trajectories": 1, "keep_adapter_every": 2}
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = config_from_dict(raw)
    lock = {"schema": "2.0", "stages": {}}
    _seal(root, cfg, Block(1, 2), lock)
    lock["stages"]["update-0003"] = {"cmd": "x"}  # iteration 3 finished too: the last finished is 3
    write_lock(root, lock)
    for path in block_out_paths(cfg, Block(1, 2)):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")
    dropped = retain(root, cfg, gc=False)
    assert sorted(dropped) == ["data/iters/0001/policy", "data/iters/0001/prompt_embeds.safetensors",
                               "data/iters/0001/trajectories.zarr", "data/iters/0002/prompt_embeds.safetensors",
                               "data/iters/0002/trajectories.zarr"]
    assert not any((root / p).exists() for p in dropped) and (root / "data/iters/0002/policy").exists()
    entry = read_as_dvc(Block(1, 2).lockfile(root))["stages"]["iters-0001-0002"]
    assert {o["path"] for o in entry["outs"]} == set(read_seal(Block(1, 2).seal_path(root))["outs"])
    rendered = yaml.safe_load(Block(1, 2).dvcfile(root).read_text())["stages"]["iters-0001-0002"]["outs"]
    assert [o if isinstance(o, str) else next(iter(o)) for o in rendered] == [o["path"] for o in entry["outs"]]
    assert retain(root, cfg, gc=False) == []  # applied twice: nothing more


def test_block_command_refuses_a_range_that_is_not_a_block(tmp_path):
    root = _project(tmp_path, iterations=4, block_size=2)
    done = subprocess.run([sys.executable, "-m", "tpgrpo", "block", "--first", "2", "--last", "3"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --first 2 --last 3: not a block of train.block_size = 2 inside 1..4")


def test_no_stage_reads_the_bookkeeping_params():
    assert not any(p.startswith(("retention", "train.block_size")) for ps in STAGE_PARAMS.values() for p in ps)


def _env() -> dict:
    import os

    e = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    return e


def _sh(root: Path, *args: str) -> str:
    done = subprocess.run(list(args), cwd=root, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return done.stdout


def _tpgrpo(root: Path, *args: str) -> str:
    return _sh(root, sys.executable, "-m", "tpgrpo", *args)


def _ran(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def _set(root: Path, section: str, values: dict) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def _clean(root: Path) -> None:
    assert _sh(root, sys.executable, "-m", "dvc", "status", "--json").strip() == "{}"
    assert _ran(_sh(root, sys.executable, "-m", "dvc", "repro")) == []


@pytest.mark.slow
def test_sealed_run_keeps_dvc_guarantees_retention_and_sharing_through_a_remote(tiny_project, tmp_path):
    root = tiny_project
    _set(root, "train", {"iterations": 3, "block_size": 2})
    _sh(root, "git", "init", "-q")
    _sh(root, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "init")
    first = _tpgrpo(root, "run")
    assert "sealed iters-0001-0002" in first
    # block by block: the first block was sealed before iteration 3 ran, so dvc.lock never held both
    assert first.index("sealed iters-0001-0002") < first.index("Running stage 'rollout-0003'")
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert "rollout-0003" in stages and "rollout-0001" not in stages and "iters-0001-0002" not in stages
    assert "iters-0001-0002" in yaml.safe_load(Block(1, 2).dvcfile(root).read_text())["stages"]  # its own file
    assert "iters-0001-0002" not in (root / "dvc.lock").read_text() and Block(1, 2).lockfile(root).is_file()
    _clean(root)
    cached = [p for i in (1, 3) for name in ("policy", "trajectories.zarr")
              for p in (root / "data" / "iters" / f"{i:04d}" / name).rglob("*") if p.is_file()]
    assert cached and all(p.stat().st_nlink == 1 for p in cached)  # copies: damage in place never reaches the cache

    # exactly credit onward re-runs, also in the block (and the code stage, which records whether the mode is
    # flow_grpo in the probe's manifest: the probe does not list the mode, so iteration 1's probe stays)
    _set(root, "credit", {"mode": "incremental"})
    changed = _tpgrpo(root, "run")
    assert "unsealed iters-0001-0002" in changed and "sealed iters-0001-0002" in changed
    assert [n for n in _ran(changed) if n != "code"][:1] == ["credit-0001"] and "rollout-0002" in _ran(changed)
    assert not any(n in _ran(changed) for n in ("rollout-0001", "probe-0001", "baseline"))
    _clean(root)

    _set(root, "retention", {"keep_trajectories": 1, "keep_adapter_every": 2})
    # last finished iteration 3, keep 1: trajectories + embeddings of 1 and 2 go, and adapter 1 (2 ends the block)
    assert "dropped 5 artifacts" in _tpgrpo(root, "retain")
    iters = root / "data" / "iters"
    assert not (iters / "0001" / "trajectories.zarr").exists() and not (iters / "0001" / "policy").exists()
    assert (iters / "0002" / "policy").exists() and (iters / "0001" / "credit.parquet").exists()
    _clean(root)

    remote = tmp_path / "remote"
    _sh(root, sys.executable, "-m", "dvc", "remote", "add", "-d", "shared", str(remote))
    _sh(root, "git", "add", "-A")
    _sh(root, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "run")
    _sh(root, sys.executable, "-m", "dvc", "push", "-q")
    clone = tmp_path / "clone"
    _sh(tmp_path, "git", "clone", "-q", str(root), str(clone))
    _sh(clone, sys.executable, "-m", "dvc", "pull", "-q")
    _clean(clone)
    for i in (1, 3):  # a sealed iteration and an open one: credit re-runs byte-identically from pulled inputs
        credit = Path("data", "iters", f"{i:04d}", "credit.parquet")
        before = (clone / credit).read_bytes()
        assert before == (root / credit).read_bytes()
        (clone / credit).unlink()
        _tpgrpo(clone, "stage", "credit", "--iter", str(i))
        assert (clone / credit).read_bytes() == before
    exported = _tpgrpo(clone, "export", "--iter", "2", "--out", str(tmp_path / "adapter"))
    assert "exported" in exported and (tmp_path / "adapter" / "pytorch_lora_weights.safetensors").is_file()


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_retain_never_frees_an_object_a_commit_or_an_experiment_records(tmp_path):
    """Objects of dropped outs are freed only when no dvc.lock or block entries in git (any commit, any
    ``refs/exps`` experiment) record them: ``git checkout`` + ``dvc checkout`` / ``dvc exp apply`` need them."""
    from types import SimpleNamespace

    from tpgrpo.pipeline.long_runs.blocks import committed_oids, object_path
    from tpgrpo.pipeline.long_runs.sealing import free_cache

    root, cache = tmp_path / "project", tmp_path / "project" / ".dvc" / "cache"
    (root / "data" / "seals").mkdir(parents=True)
    md5 = {name: f"{i:032x}" for i, name in enumerate(["branch", "sealed", "experiment", "nobody"], start=1)}
    out = lambda name: {"path": f"data/{name}", "hash": "md5", "md5": md5[name]}  # noqa: E731
    for name in md5:
        path = object_path(cache, md5[name], legacy=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
    _git(root, "init", "-q")
    write_lock(root, {"schema": "2.0", "stages": {"a": {"cmd": "x", "outs": [out("branch")]}}})
    write_yaml(root / "data/seals/0001-0002.stages", {"b": {"cmd": "y", "outs": [out("sealed")]}})
    _git(root, "add", "dvc.lock", "data/seals")
    _git(root, "commit", "-q", "-m", "a run")
    write_lock(root, {"schema": "2.0", "stages": {"a": {"cmd": "x", "outs": [out("experiment")]}}})
    _git(root, "commit", "-q", "-am", "an experiment")
    _git(root, "update-ref", "refs/exps/ab/cdef/exp-1", "HEAD")  # where `dvc exp run` keeps its commits
    _git(root, "reset", "-q", "--hard", "HEAD~1")
    (root / "data/seals/0001-0002.stages").unlink()
    assert committed_oids(root) == {(False, md5[n]) for n in ("branch", "sealed", "experiment")}
    repo = SimpleNamespace(config={}, cache=SimpleNamespace(local=SimpleNamespace(path=str(cache / "files" / "md5"))))
    gone = [out(name) for name in md5]
    assert free_cache(root, repo, {"stages": {}}, gone)[0] == 1  # only the object nothing records
    assert [n for n in md5 if object_path(cache, md5[n], legacy=False).exists()] == ["branch", "sealed", "experiment"]
    (tmp_path / "plain").mkdir()
    assert committed_oids(tmp_path / "plain") == set()  # not in git: nothing
