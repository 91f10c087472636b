"""Chains and trees side by side: which shape an iteration's rollout has, decided once per stage, from the one
record that stage depends on.

A **chain** (the default) stores, per prompt, ``rollout.group_size`` samples over the SDE window; the probe
ODE-completes every window state. A **tree** (``tree.enabled``, docs/tree.md) stores one row per edge of
ODE-anchored trees; every node's Q is a leaf's reward, so the probe runs no model.

=========  ===========================================  ================================  ==================================
stage      reads the shape from                          chain                             tree
=========  ===========================================  ================================  ==================================
rollout    the params (:func:`of_config`)                ``stages.rollout`` (chains)        ``tpgrpo.policy.tree_rollout``
probe      the store's ``shape`` attribute (:func:`of_store`)  completions (``probe.completion``)  ``tpgrpo.io.tree_probe`` (leaves)
credit     the probe table's ``tpgrpo.completion`` (:func:`checked_probe_table`)  ``tpgrpo.algo.credit``  ``tpgrpo.algo.tree_credit``
update     the store's ``shape`` attribute (:func:`of_store_attrs`)  ``LazyStates`` of ``states``  ``NodeStates`` of ``node_states``
=========  ===========================================  ================================  ==================================

A stage never guesses: a store or table that cannot be read is one line naming it (no exception swallowed), and
a shape this code does not know is refused.
"""

from __future__ import annotations

from pathlib import Path

CHAIN, TREE = "chain", "tree"
SHAPES = (CHAIN, TREE)
SHAPE_ATTR = "shape"  # trajectories.zarr attribute; absent on chain stores (written before trees existed)


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


TREE_COLUMNS = ("parent_trajectory", "depth", "sde")  # the columns PROBE_TREE adds to PROBE


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
