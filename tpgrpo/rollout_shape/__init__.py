"""Chains and trees: the two shapes a rollout can have, one interface, and which shape a stage works on.

A **chain** (``tree.enabled: false``) stores, per prompt, ``rollout.group_size`` samples over the SDE window;
the probe ODE-completes every window state. A **tree** (``tree.enabled``, docs/tree.md) stores one row per edge
of ODE-anchored trees; every node's Q is a leaf's reward, so the probe runs no model.

Each stage asks :func:`implementation` once, at its top, for its shape's implementation and calls it; the
shape comes from the one record that stage depends on (:func:`shape_for`), never from a guess:

=======  ===================================================  =====================  ===================
stage    reads the shape from                                 chain                  tree
=======  ===================================================  =====================  ===================
rollout  the params (:func:`of_config`)                        :mod:`.chain_rollout`  :mod:`.tree_rollout`
probe    the store's ``shape`` attribute (:func:`of_store`)     ``probe_scoring``      :mod:`.tree_probe`
credit   the probe table (:func:`checked_probe_table`)          :mod:`.chains`         :mod:`.trees`
update   the store's attributes (:func:`of_store_attrs`)       :mod:`.chain_update`   :mod:`.tree_update`
=======  ===================================================  =====================  ===================

(``probe_scoring``: ``tpgrpo.policy.probe_scoring.run_chain_probe``, the chain's probe, which completes every
window state with the model; the tree's assembles each Q from its leaves.)

The interface, per stage (what the two modules of a row both provide, with the same signatures):

- rollout, probe: ``run(cfg, iteration, root) -> dict``, the stage's metrics (its files written);
- credit (:class:`ShapeTables`): ``read_probe``, ``credit_table``, ``trained_rows``;
- update (:class:`ShapeStates`): ``states`` (the lazily read ``(N, K+1, C, H, W)`` states) and ``units`` (the
  clean-sample units of ``update.objective`` nft / awm).

Each stage's implementations are modules of their own, not methods of one object per shape: what a stage
imports is the code it runs (``tpgrpo.pipeline.rendering.code_graph`` derives each stage's code manifest from its
imports), so the credit stage, which reads a table, stays free of the rollout's model code. The pure maths
stays in ``tpgrpo.algo`` (``credit``, ``credit_table``, ``tree``, ``tree_credit``, ``tree_shape``,
``objective_units``); these modules call it. This package imports nothing heavy at its top.

A store or table that cannot be read is one line naming it (no exception swallowed), and a shape this code
does not know is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, TypeVar

CHAIN, TREE = "chain", "tree"
SHAPES = (CHAIN, TREE)
SHAPE_ATTR = "shape"  # trajectories.zarr attribute; absent on chain stores (written before trees existed)
TREE_COLUMNS = ("parent_trajectory", "depth", "sde")  # the columns PROBE_TREE adds to PROBE
STAGES = ("rollout", "probe", "credit", "update")  # the stages that work on one shape or the other

StageRun = Callable[..., dict]  # run(cfg, iteration, root) -> the stage's metrics: a rollout's or a probe's
T = TypeVar("T")


class ShapeTables(Protocol):
    """What the credit stage needs of a shape (:mod:`.chains`, :mod:`.trees`)."""

    def read_probe(self, path: Path):
        """The ``probe.parquet`` at ``path`` read and checked against the shape's schema (a DataFrame)."""

    def credit_table(self, probe, cfg):
        """``credit.parquet``'s rows (``schemas.CREDIT``) from the probe table under the ``credit`` params."""

    def trained_rows(self, table, probe):
        """The credit rows ``credit.json``'s rates count: those the update trains."""


class ShapeStates(Protocol):
    """What the update needs of a shape (:mod:`.chain_update`, :mod:`.tree_update`)."""

    def states(self, arrays: dict, num_prompts: int):
        """The store's ``(N, K+1, C, H, W)`` states, read on use (a ``policy.states.LazyStates``)."""

    def units(self, arrays: dict, attrs: dict, advantages, split_levels: bool, source: str):
        """``(Units, latents)``: the nft / awm units of the store and the clean latents they index."""


def of_config(cfg) -> str:
    """The shape the rollout samples under ``cfg`` (a ``Config``): ``tree.enabled``."""
    return TREE if cfg.tree.enabled else CHAIN


def of_store_attrs(attrs: dict, source: str) -> str:
    """The shape of a store from its attributes (``read_trajectories``' second value); ``source`` names it in
    the error for an unknown value."""
    from tpgrpo.io.schemas import ArtifactError

    shape = attrs.get(SHAPE_ATTR, CHAIN)
    if shape not in SHAPES:
        raise ArtifactError(f"{source}: attribute '{SHAPE_ATTR}' = {shape!r}: expected one of {', '.join(SHAPES)}")
    return shape


def of_store(path: Path) -> str:
    """The shape of the ``trajectories.zarr`` at ``path``, from its attributes only (no array is read). A
    missing store is the rollout's missing output, a damaged one the reader's reason: one line either way."""
    import zarr

    from tpgrpo.io.artifacts import first_line, require
    from tpgrpo.io.schemas import ArtifactError

    require(path, "trajectories.zarr: run the rollout stage first")
    try:
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:  # noqa: BLE001 - any reader failure on a damaged store, reported as such
        raise ArtifactError(f"{path}: not a readable Zarr group ({first_line(exc)})") from None
    return of_store_attrs(attrs, str(path))


def of_probe_table(path: Path) -> str:
    """The shape of the rollout a ``probe.parquet`` scored: ``tree`` when the probe that wrote it says so in
    its ``tpgrpo.completion`` metadata, else ``chain``. An unreadable file is left to the table read that
    follows, which names it in one line."""
    import pyarrow.parquet as pq

    from tpgrpo.io.schemas import PROBE_COMPLETION_KEY

    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, ValueError):  # missing or damaged: read_table reports it with the stage's hint
        return CHAIN
    return TREE if meta.get(f"tpgrpo.{PROBE_COMPLETION_KEY}".encode()) == TREE.encode() else CHAIN


def checked_probe_table(path: Path, cfg) -> str:
    """The shape of the ``probe.parquet`` at ``path`` (:func:`of_probe_table`), refused in one line
    (``ArtifactError``) when the table disagrees with itself or with ``cfg`` (a ``Config``):

    - a tree's columns without ``tpgrpo.completion = tree``, or that metadata without them: a table rewritten
      by a tool that drops tpgrpo's metadata (``pd.read_parquet(p).to_parquet(p)``) would otherwise be
      credited as one-step chains;
    - a shape other than the one ``tree.enabled`` samples (:func:`of_config`).
    An unreadable file is left to the table read that follows, which names it in one line."""
    import pyarrow.parquet as pq

    from tpgrpo.io.schemas import PROBE_COMPLETION_KEY, ArtifactError

    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError):
        return CHAIN
    recorded = (schema.metadata or {}).get(f"tpgrpo.{PROBE_COMPLETION_KEY}".encode(), b"").decode() or None
    shape = TREE if recorded == TREE else CHAIN
    has_tree = [c for c in TREE_COLUMNS if c in schema.names]
    if (shape == TREE) != bool(has_tree):
        what = (f"has a tree's columns ({', '.join(has_tree)})" if has_tree
                else f"lacks a tree's columns ({', '.join(TREE_COLUMNS)})")
        raise ArtifactError(f"{path}: {what} but its metadata records tpgrpo.{PROBE_COMPLETION_KEY} = {recorded!r} "
                            "(a table rewritten without tpgrpo's metadata?): run the probe stage again")
    if shape != of_config(cfg):
        raise ArtifactError(f"{path}: a {shape} probe table (tpgrpo.{PROBE_COMPLETION_KEY} = {recorded!r}), but "
                            f"params has tree.enabled: {str(cfg.tree.enabled).lower()}: run the rollout and probe "
                            "stages again under these params")
    return shape


def shape_for(stage: str, cfg, paths, attrs: dict | None = None) -> str:
    """The shape ``stage`` (one of :data:`STAGES`) works on, from the one record it depends on (module
    docstring): the rollout from ``cfg``; the probe from the store at ``paths.trajectories`` (``paths`` an
    ``IterationPaths``); credit from ``paths.probe`` checked against ``cfg``; the update from the store's
    attributes ``attrs`` it has read (``read_trajectories``' second value)."""
    if stage == "rollout":
        return of_config(cfg)
    if stage == "probe":
        return of_store(paths.trajectories)
    if stage == "credit":
        return checked_probe_table(paths.probe, cfg)
    if stage == "update":
        if attrs is None:
            raise ValueError("shape_for('update', ...): pass the store's attrs (read_trajectories' second value)")
        return of_store_attrs(attrs, str(paths.trajectories))
    raise ValueError(f"shape_for: stage {stage!r} is not one of {', '.join(STAGES)}")


def pick(shape: str, chain: T, tree: T) -> T:
    """``chain`` or ``tree``: the implementation of ``shape`` (a name from :data:`SHAPES`) among a stage's two."""
    if shape not in SHAPES:
        raise ValueError(f"rollout shape {shape!r}: expected one of {', '.join(SHAPES)}")
    return chain if shape == CHAIN else tree


def implementation(stage: str, cfg, paths, chain: T, tree: T, attrs: dict | None = None) -> T:
    """The one dispatch a stage makes: its implementation for the shape :func:`shape_for` reads
    (``chain`` / ``tree``: the stage's two implementations, e.g. two modules or two ``run`` functions)."""
    return pick(shape_for(stage, cfg, paths, attrs), chain, tree)
