"""The comparison's arms: credit modes, the lr sweep and the paper's ablations as named param overrides.

Pure data and parsing (no file or process work): tpgrpo.comparison.runs plans, prepares and launches the runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from tpgrpo.config import ConfigError

MODES = ("flow_grpo", "incremental", "tp", "tp_unconstrained")
BASELINE_MODE = "flow_grpo"  # every mode is compared against it
# The paper's ablations (section 8 / paper summary), run on the reference mode (tp) with one seed by default.
ABLATIONS = {
    "noise0.4": {"sampling.noise_level": 0.4}, "noise1.0": {"sampling.noise_level": 1.0},
    "window8": {"sampling.window_size": 8}, "window4": {"sampling.window_size": 4},
    "cps": {"sampling.step_kind": "cps"},
}

# The forward-process objectives (update.objective, docs/objectives.md) as arms: OBJECTIVE (--modes nft) is the
# published method (Flow-GRPO's credit, the group-normalised final reward); MODE-OBJECTIVE (--tree-modes tp-nft) a
# credit mode inside it, on a tree trained only at its splits' levels (update.split_levels).
OBJECTIVES = ("nft", "awm")


def arm_of(name: str, tree: bool = False) -> tuple[str, dict[str, Any]] | None:
    """An arm name's credit mode and overrides (``tp`` -> ``("tp", {})``, ``nft`` -> ``("flow_grpo",
    {"update.objective": "nft"})``, ``tp-nft``); None for a name that is neither."""
    if name in MODES:
        return name, {}
    mode, _, objective = name.rpartition("-")
    mode = mode or BASELINE_MODE
    if objective not in OBJECTIVES or mode not in MODES:
        return None
    return mode, {"update.objective": objective, **({"update.split_levels": True} if tree and name != objective else {})}


@dataclass(frozen=True)
class Variant:
    """One arm of the comparison: a credit mode and param overrides, trained with each of ``seeds``."""

    name: str                      # folder name under OUT, e.g. "tp" or "tp-noise0.4"
    mode: str                      # credit.mode
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted params key -> value
    seeds: tuple[int, ...] = (0, 1, 2)
    family: str = "main"           # main | ablation | lr_sweep
    reference: str = ""            # the variant this one is an ablation / sweep point of ("" = none)


@dataclass(frozen=True)
class RunSpec:
    variant: Variant
    seed: int
    folder: Path


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it (``0.4`` float, ``8`` int, ``cps`` str; ``3e-4`` stays a
    string that the config's float check accepts)."""
    return yaml.safe_load(text)


def parse_assignments(items: Sequence[str], what: str) -> dict[str, Any]:
    """``["update.lr=3e-4", ...]`` -> ``{"update.lr": "3e-4"}``; a malformed item is a one-line error."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key.count(".") != 1 or not value:
            raise ConfigError(f"{what} {item!r}: expected section.key=value, e.g. update.lr=3e-4")
        out[key.strip()] = parse_value(value.strip())
    return out


def lr_label(value: Any) -> str:
    return f"lr{float(value):g}"


def main_variants(modes: Sequence[str], seeds: Sequence[int], overrides: dict[str, Any] | None = None,
                  mode_overrides: dict[str, dict[str, Any]] | None = None) -> list[Variant]:
    """One variant per credit mode (named after it), with common and per-mode overrides."""
    bad = [m for m in modes if arm_of(m) is None]
    if bad or not modes:
        raise ConfigError(f"modes {list(modes)}: expected some of {', '.join(MODES)}, {', '.join(OBJECTIVES)} or "
                          "MODE-OBJECTIVE (tp-nft)")
    for mode in mode_overrides or {}:
        if mode not in modes:
            raise ConfigError(f"per-mode override for {mode!r}: not among the modes compared ({', '.join(modes)})")
    return [Variant(m, arm_of(m)[0], {**arm_of(m)[1], **(overrides or {}), **(mode_overrides or {}).get(m, {})},
                    tuple(seeds)) for m in modes]


TREE_PREFIX = "tree-"  # a tree arm's name: the prefix and its credit mode (tree-tp)


def tree_variants(modes: Sequence[str], seeds: Sequence[int], overrides: dict[str, Any] | None = None,
                  arm_overrides: dict[str, dict[str, Any]] | None = None) -> list[Variant]:
    """Credit modes trained on ODE-anchored trees (``tree.enabled``, docs/tree.md) instead of chains: main
    arms named ``tree-MODE``, compared with flow_grpo's chains like every main arm. ``arm_overrides``: per
    arm name (``tree-tp``), e.g. a tree shape for the tree arm alone."""
    bad = [m for m in modes if arm_of(m, tree=True) is None]
    if bad:
        raise ConfigError(f"tree modes {list(modes)}: expected some of {', '.join(MODES)}, {', '.join(OBJECTIVES)} "
                          "or MODE-OBJECTIVE (tp-nft)")
    names = [f"{TREE_PREFIX}{m}" for m in modes]
    for name in arm_overrides or {}:
        if name not in names:
            raise ConfigError(f"per-arm override for {name!r}: not among the tree arms ({', '.join(names)})")
    return [Variant(n, arm_of(m, tree=True)[0], {**arm_of(m, tree=True)[1], **(overrides or {}),
                                                 **(arm_overrides or {}).get(n, {}), "tree.enabled": True},
                    tuple(seeds)) for n, m in zip(names, modes)]


def lr_sweep_variants(main: Sequence[Variant], lrs: Sequence[float], seeds: Sequence[int]) -> list[Variant]:
    """Each main variant again at each learning rate of ``lrs`` (the step-size sweep)."""
    return [Variant(f"{v.name}-{lr_label(lr)}", v.mode, {**v.overrides, "update.lr": float(lr)}, tuple(seeds),
                    "lr_sweep", v.name) for v in main for lr in lrs]


def ablation_variants(reference: Variant, names: Sequence[str], seeds: Sequence[int]) -> list[Variant]:
    """The named :data:`ABLATIONS` of ``reference`` (its mode and overrides plus the ablation's)."""
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise ConfigError(f"ablations {unknown}: expected some of {', '.join(ABLATIONS)}")
    return [Variant(f"{reference.name}-{n}", reference.mode, {**reference.overrides, **ABLATIONS[n]},
                    tuple(seeds), "ablation", reference.name) for n in names]
