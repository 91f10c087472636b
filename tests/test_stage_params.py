"""dvc.yaml declares every param a stage reads: run each stage with a config that records its reads."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tpgrpo.config import load_config
from tpgrpo.stage_params import EXECUTION_KNOBS, stage_inputs, switches


class Recorder:
    """Wraps a Config (or one section) and records every ``section.key`` the code reads."""

    def __init__(self, target, reads: set, prefix: str = ""):
        self._target, self._reads, self._prefix = target, reads, prefix

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if callable(value):  # e.g. params_hash(keys): the keys it hashes count as read
            def recorded(keys, *args, **kwargs):
                self._reads.update(keys)
                return value(keys, *args, **kwargs)
            return recorded
        if not self._prefix:
            return Recorder(value, self._reads, name)
        self._reads.add(f"{self._prefix}.{name}")
        return value


def covered(read: str, declared: list[str]) -> bool:
    """Whether a read is declared, or is an execution knob: read on purpose without being declared (DVC must
    not re-run a stage for where or in what memory it runs: tpgrpo.stage_params.EXECUTION_KNOBS)."""
    return read in EXECUTION_KNOBS or any(read == d or read.startswith(d + ".") for d in declared)


def declared(name: str, cfg) -> list[str]:
    """What stage ``name`` declares under ``cfg`` (dvc.yaml's list, tpgrpo.stage_params.stage_inputs), plus the
    keys that switch its conditional sections on (``tree.enabled``): a chain rollout reads the switch to stay a
    chain, and its value is recorded by the list it decides (``tree`` listed or not)."""
    return [*stage_inputs(name, cfg), *switches(name)]


def test_every_param_a_stage_reads_is_declared_in_dvc_yaml(tiny_project):
    root = tiny_project
    cfg = load_config(root / "params.yaml")
    plan = [("eval_prompts", None), ("rollout", 1), ("probe", 1), ("credit", 1), ("update", 1), ("eval", 1),
            ("baseline", None)]
    every: set[str] = set()
    for name, iteration in plan:
        reads: set[str] = set()
        importlib.import_module(f"stages.{name}").run(Recorder(cfg, reads), iteration, root)
        undeclared = sorted(r for r in reads if not covered(r, declared(name, cfg)))
        assert not undeclared, f"stage {name} reads {undeclared} but dvc.yaml does not list them"
        assert reads, name
        every |= reads
        assert not any(r.startswith("tree.") and r != "tree.enabled" for r in reads), name  # off: inert
    # No stale knob: each is read (reward_models.device only with model rewards: test_rewards_combine).
    assert set(EXECUTION_KNOBS) - {"reward_models.device"} <= every


def test_update_micro_batch_is_an_input_of_the_update_only(tiny_project):
    """update.micro_batch moves the adapter (AdamW amplifies its round-off), so the update lists it:
    dvc.yaml, the params-read notes and the update's config_hash; no other stage does (credit's table and the
    rollout's store keep their hashes)."""
    import yaml

    from tpgrpo.pipeline.rendering.dvcfile import dvc_yaml_text
    from tpgrpo.stage_common import provenance

    cfg = load_config(tiny_project / "params.yaml")
    other = load_config(tiny_project / "params.yaml", overrides={"update.micro_batch": cfg.update.micro_batch + 1})
    assert "update.micro_batch" in stage_inputs("update", cfg) and "update.micro_batch" not in EXECUTION_KNOBS
    stages = yaml.safe_load(dvc_yaml_text(cfg, tiny_project))["stages"]
    listing = [n for n, st in stages.items() if "update.micro_batch" in st.get("params", [])]
    assert listing == [f"update-{i:04d}" for i in range(1, cfg.train.iterations + 1)], listing
    for stage in ("rollout", "probe", "credit", "update", "eval"):
        same = provenance(cfg, 1, stage)["config_hash"] == provenance(other, 1, stage)["config_hash"]
        assert same == (stage != "update"), stage


def test_the_committed_dvc_yaml_is_what_params_yaml_renders(tmp_path):
    """A fresh clone's dvc.yaml (what `dvc dag` and `dvc status` read before any `tpgrpo run`) must be the
    rendering of its params.yaml: it went stale once (an eval_prompts output missing) with no test noticing.
    Rendered against an empty root (no sealed blocks), as in a clean clone."""
    from tpgrpo.config import load_config
    from tpgrpo.pipeline.rendering.dvcfile import dvc_yaml_text

    repo = Path(__file__).resolve().parents[1]
    if (repo / "data" / "iters").exists():
        pytest.skip("this checkout has a run: `tpgrpo run` re-renders dvc.yaml for its sealed blocks")
    expected = dvc_yaml_text(load_config(repo / "params.yaml"), tmp_path)
    assert (repo / "dvc.yaml").read_text() == expected, "dvc.yaml is stale: run `tpgrpo dvc-yaml` and commit it"
