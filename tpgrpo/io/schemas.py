"""The artifacts' schemas, declared once: the stages write through them and check what they read back.

Users open ``probe.parquet`` and ``credit.parquet`` with pandas and may save them again, so a stage must
not trust a file: every check here fails with one :class:`ArtifactError` line that names the file and
what is wrong (the CLI prints it and exits non-zero; the stage has written nothing yet).

Tables are long: one row per (trajectory, step). ``trajectory`` is the row of ``trajectories.zarr`` the
row belongs to (0..N-1); ``step`` runs over the stored states 0..K (probe) or the window steps 0..K-1
(credit). Every (trajectory, step) pair occurs exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from tpgrpo.errors import ArtifactError, PipelineError  # noqa: F401 - ArtifactError lives in errors (tasks read it)


@dataclass(frozen=True)
class Column:
    """One table column: ``kind`` is ``int`` (stored int64), ``float`` (float64), ``bool`` or ``str``."""

    name: str
    kind: str
    doc: str
    finite: bool = False  # NaN / inf refused
    per_trajectory: bool = False  # one value per trajectory, repeated on each of its rows


@dataclass(frozen=True)
class TableSchema:
    """A Parquet table: its file name, whether ``step`` covers the states (0..K) or the window (0..K-1)."""

    file: str
    steps: str  # "state" or "window"
    columns: tuple[Column, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]


_TRAJECTORY = Column("trajectory", "int", "row of trajectories.zarr (0..N-1)")
_PROMPT_ID = Column("prompt_id", "str", "id of the prompt (its group)", per_trajectory=True)
_SAMPLE = Column("sample", "int", "index within its prompt group", per_trajectory=True)

PROBE = TableSchema("probe.parquet", "state", (
    _TRAJECTORY, _PROMPT_ID,
    Column("prompt", "str", "the prompt text", per_trajectory=True),
    _SAMPLE,
    Column("seed", "int", "the trajectory's noise seed", per_trajectory=True),
    Column("step", "int", "stored state k (0..K); state K is the final latent"),
    Column("sigma", "float", "noise level of state k, unitless in [0, 1]", finite=True),
    Column("reward", "float", "Q_k: reward of state k completed as the metadata's tpgrpo.completion says "
           "(k = K: the rollout's R_fin; completion none: R_fin at every k)", finite=True),
    Column("strict", "bool", "all clauses of the prompt right in that completion"),
))

# probe.parquet's metadata key (stored as tpgrpo.completion): exact | ode:M | x0 | none (tpgrpo.algo.probe_modes).
PROBE_COMPLETION_KEY = "completion"

# tree.enabled: the same table, a trajectory being an edge (step 0 = Q(parent), 1 = Q(child)), plus the tree.
PROBE_TREE = TableSchema("probe.parquet", "state", PROBE.columns + (
    Column("parent_trajectory", "int", "trajectory of the edge into the parent node; -1 below a root",
           per_trajectory=True),
    Column("depth", "int", "split index of the edge (0..L-1)", per_trajectory=True),
    Column("sde", "bool", "an SDE edge (trained); False: the ODE child", per_trajectory=True),
))


CREDIT = TableSchema("credit.parquet", "window", (
    _TRAJECTORY, _PROMPT_ID, _SAMPLE,
    Column("step", "int", "window step k (0..K-1)"),
    Column("incremental", "float", "Q_{k+1} - Q_k", finite=True),
    Column("aggregated", "float", "the turning-point aggregated reward", finite=True),
    Column("trend", "float", "sign of the trajectory's overall reward change", finite=True, per_trajectory=True),
    Column("turning_point", "bool", "step k is a kept turning point"),
    Column("step_reward", "float", "the reward of step k under credit.mode", finite=True),
    Column("advantage", "float", "group-normalised step reward (the update's A)", finite=True),
))

_DTYPES = {"int": np.dtype(np.int64), "float": np.dtype(np.float64), "bool": np.dtype(bool)}
_NUMPY_KINDS = {"int": "iu", "float": "f", "bool": "b"}


def _fail(source: str, message: str) -> NoReturn:
    raise ArtifactError(f"{source}: {message}")


def _plain(value):
    """A numpy scalar as the Python value (so messages read ``1``, not ``np.int64(1)``)."""
    return value.item() if isinstance(value, np.generic) else value


def _check_column(frame, col: Column, source: str) -> None:
    from pandas.api import types

    series = frame[col.name]
    ok = {"int": types.is_integer_dtype, "float": types.is_float_dtype, "bool": types.is_bool_dtype,
          "str": lambda s: types.is_string_dtype(s) and s.dropna().map(lambda v: isinstance(v, str)).all()}[col.kind]
    if not ok(series):
        _fail(source, f"column '{col.name}' has dtype {series.dtype}; expected {col.kind} ({col.doc})")
    missing = series.isna().to_numpy()
    if missing.any() and not col.finite:  # (a float column's NaN is reported as non-finite below)
        _fail(source, f"column '{col.name}' has {int(missing.sum())} missing values "
                      f"(first at row {int(np.argmax(missing))})")
    if col.finite:
        bad = ~np.isfinite(series.to_numpy(dtype=np.float64))
        if bad.any():
            _fail(source, f"column '{col.name}' has {int(bad.sum())} non-finite values "
                          f"(first at row {int(np.argmax(bad))})")


def _grid(frame, source: str, trajectories: int | None, steps: int | None) -> tuple[int, int]:
    """Check that every (trajectory, step) pair occurs exactly once; returns (N, steps per trajectory)."""
    traj, step = frame["trajectory"].to_numpy(), frame["step"].to_numpy()
    if len(frame) == 0:
        _fail(source, "has no rows")
    n = int(traj.max()) + 1 if trajectories is None else trajectories
    s = int(step.max()) + 1 if steps is None else steps
    if traj.min() < 0 or step.min() < 0 or step.max() >= s:
        _fail(source, f"trajectory/step out of range: trajectory {traj.min()}..{traj.max()}, "
                      f"step {step.min()}..{step.max()} (expected steps 0..{s - 1})")
    if trajectories is not None and (traj.max() >= n or len(np.unique(traj)) != n):
        _fail(source, f"holds {len(np.unique(traj))} trajectories (ids {traj.min()}..{traj.max()}); "
                      f"expected {n} in trajectories.zarr")
    counts = np.bincount(traj * s + step, minlength=n * s)
    if (counts != 1).any():
        first = int(np.argmax(counts != 1))
        pair = f"(trajectory {first // s}, step {first % s})"
        _fail(source, f"no row for {pair}" if counts[first] == 0 else f"{counts[first]} rows for {pair}")
    return n, s


def check_table(frame, schema: TableSchema, source: str, trajectories: int | None = None,
                steps: int | None = None, expect: dict[str, Any] | None = None, exact: bool = False):
    """Validate a table against ``schema``; return it with exactly the schema's columns, in order, in the
    stored dtypes, rows sorted by (trajectory, step).

    ``trajectories`` / ``steps``: the N and the steps per trajectory it must cover (inferred from the
    table when None). ``expect``: per-trajectory columns' values that the trajectory store dictates,
    ``{column: array (N,)}``. ``exact``: refuse columns beyond the schema (when writing).
    """
    missing = [name for name in schema.names if name not in frame.columns]
    if missing:
        _fail(source, f"missing column '{missing[0]}' (expected columns {', '.join(schema.names)})")
    extra = [name for name in frame.columns if name not in schema.names]
    if exact and extra:
        _fail(source, f"unexpected column '{extra[0]}' (expected columns {', '.join(schema.names)})")
    for col in schema.columns:
        _check_column(frame, col, source)
    n, s = _grid(frame, source, trajectories, steps)
    frame = frame[schema.names].sort_values(["trajectory", "step"], kind="stable").reset_index(drop=True)
    frame = frame.astype({c.name: _DTYPES[c.kind] for c in schema.columns if c.kind in _DTYPES})
    for col in schema.columns:
        if col.per_trajectory:
            values = frame[col.name].to_numpy().reshape(n, s)
            changes = (values != values[:, :1]).any(axis=1)
            if changes.any():
                _fail(source, f"column '{col.name}' changes within trajectory {int(np.argmax(changes))} "
                              "(one value per trajectory expected)")
    for name, wanted in (expect or {}).items():
        got = frame[name].to_numpy()[::s]
        wrong = got != np.asarray(wanted)
        if wrong.any():
            i = int(np.argmax(wrong))
            _fail(source, f"column '{name}' is {_plain(got[i])!r} for trajectory {i}; trajectories.zarr has "
                          f"{_plain(np.asarray(wanted)[i])!r}")
    return frame


@dataclass(frozen=True)
class ArraySpec:
    """One array of ``trajectories.zarr``: named dimensions, stored dtype, meaning."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    meaning: str
    finite: bool = False  # checked on write, on an eager read and on each slice of a lazy one
    optional: bool = False  # written only by some settings (absent otherwise)
    bound: float | None = None  # |value| <= bound, checked where finite is


# Latents are data (tiny: pixels in [-1, 1]; SD3/FLUX: VAE latents of about unit variance) mixed with unit
# Gaussian noise: honest values stay within about +-10. Damaged floats decode to 1e20-1e27;
# anything beyond this bound is damage or a diverged policy, never a state worth training on.
LATENT_BOUND = 1.0e4

TRAJECTORIES_FILE = "trajectories.zarr"
TRAJECTORY_ARRAYS = (
    ArraySpec("states", ("trajectory", "state", "channel", "height", "width"), "float32",
              "latent z_k before window step k; z_K after the last", finite=True, bound=LATENT_BOUND),
    ArraySpec("log_probs", ("trajectory", "window_step"), "float32",
              "old log-prob of each window step (sampler's convention)", finite=True),
    ArraySpec("sigmas", ("trajectory", "state"), "float32", "noise level of each stored state, unitless in [0, 1]",
              finite=True),
    ArraySpec("seeds", ("trajectory",), "int64", "the trajectory's noise seed (tpgrpo.algo.seeds.sample_seed)"),
    ArraySpec("prompt_index", ("trajectory",), "int32", "row of attrs['prompts']"),
    ArraySpec("sample", ("trajectory",), "int32", "index within its prompt group"),
    ArraySpec("final_reward", ("trajectory",), "float64", "reward of the final image, R_fin", finite=True),
    ArraySpec("final_strict", ("trajectory",), "bool", "all clauses right in the final image"),
    ArraySpec("x0_estimates", ("trajectory", "window_step", "channel", "height", "width"), "float32",
              "z_k - s_k v_k with the rollout's guided velocity at z_k (probe.completion x0 only)", optional=True,
              finite=True, bound=LATENT_BOUND),
    ArraySpec("velocities", ("trajectory", "window_step", "channel", "height", "width"), "float32",
              "the rollout's guided velocity v_k at z_k, latent units per unit of sigma; each probe completion's "
              "first step (probe.completion exact and ode:M only; attribute velocities_kept)", optional=True,
              finite=True, bound=LATENT_BOUND),
    # tree.enabled (tpgrpo.rollout_shape.tree_rollout): a row is an edge, indices are within its prompt group
    ArraySpec("tree_parent", ("trajectory",), "int32", "sample of the edge into the parent node; -1 below a root",
              optional=True),
    ArraySpec("tree_depth", ("trajectory",), "int32", "split index of the edge (0..L-1)", optional=True),
    ArraySpec("tree_sde", ("trajectory",), "bool", "an SDE edge (trained); False: the ODE child", optional=True),
    ArraySpec("tree_root", ("trajectory",), "int32", "root of the edge within its prompt (0..R-1)", optional=True),
    ArraySpec("tree_leaf", ("trajectory",), "int32", "leaf (within the prompt) the child reaches by ODE children",
              optional=True),
    ArraySpec("tree_parent_leaf", ("trajectory",), "int32", "leaf the parent reaches by ODE children",
              optional=True),
    # a tree keeps each distinct state once (no 'states'): an edge's two states are rows of node_states
    ArraySpec("node_states", ("node", "channel", "height", "width"), "float32",
              "latent of each tree node, once (prompt-major, node_states rows / prompts per prompt)", optional=True,
              finite=True, bound=LATENT_BOUND),
    ArraySpec("tree_parent_node", ("trajectory",), "int32", "node (within the prompt) of the state before the "
              "edge's step", optional=True),
    ArraySpec("tree_child_node", ("trajectory",), "int32", "node (within the prompt) of the state after it",
              optional=True),
    # update.objective nft / awm (docs/objectives.md): the clean samples the objective noises
    ArraySpec("final_latents", ("trajectory", "channel", "height", "width"), "float32",
              "a chain trajectory's final latent at sigma 0 (update.objective nft / awm only)", optional=True,
              finite=True, bound=LATENT_BOUND),
    ArraySpec("leaf_latents", ("leaf", "channel", "height", "width"), "float32",
              "a tree's leaves at sigma 0, prompt-major, tree_leaf indexes them within the prompt (update.objective "
              "nft / awm only)", optional=True, finite=True, bound=LATENT_BOUND),
)
# Attribute the rollout sets True when it stored ``velocities``: the probe then refuses a store that lacks
# them (deleted) instead of recomputing, which it does for stores written before the array existed.
VELOCITIES_KEPT_ATTR = "velocities_kept"
TREE_ARRAYS = tuple(spec.name for spec in TRAJECTORY_ARRAYS if spec.name.startswith("tree_"))
TREE_NODE_ARRAYS = ("node_states", "tree_parent_node", "tree_child_node")  # required in a tree store
TRAJECTORY_ATTRS = ("prompts", "schedule_sigmas", "group_size", "num_steps", "shift", "window_start",
                    "window_size", "step_kind", "noise_level", "guidance_scale", "reward")


def check_trajectories(arrays: dict, attrs: dict, source: str, loaded: bool = True) -> None:
    """Validate the arrays (numpy or zarr arrays: only shape/dtype are read from a lazy one) and attributes
    of a trajectory store: every array present with its dims and dtype kind, sizes consistent along each
    named dimension (``state`` = ``window_step`` + 1 = window_size + 1), indices in range, finite where
    declared (for arrays in ``loaded``: all when True)."""
    for key in TRAJECTORY_ATTRS:
        if key not in attrs:
            _fail(source, f"missing attribute '{key}' (written by the rollout stage)")
    tree = attrs.get("shape") == "tree"
    if tree and "states" in arrays:
        _fail(source, "a tree store of the old layout (one parent and one child state per edge in 'states', no "
                      "'node_states'): re-run the rollout (`tpgrpo stage rollout`) to write the node layout")
    sizes: dict[str, tuple[int, str]] = {}
    for spec in TRAJECTORY_ARRAYS:
        if spec.name not in arrays:
            if not _required(spec, tree):
                continue
            _fail(source, f"missing array '{spec.name}' ({spec.meaning})")
        arr = arrays[spec.name]
        if len(arr.shape) != len(spec.dims) or np.dtype(arr.dtype).kind not in _kind(spec.dtype):
            _fail(source, f"array '{spec.name}' is {np.dtype(arr.dtype)} of shape {tuple(arr.shape)}; expected "
                          f"{spec.dtype} with dims ({', '.join(spec.dims)})")
        for dim, size in zip(spec.dims, arr.shape):
            if sizes.setdefault(dim, (size, spec.name))[0] != size:
                _fail(source, f"array '{spec.name}' has {size} along '{dim}'; '{sizes[dim][1]}' has {sizes[dim][0]}")
        if loaded is True or spec.name in loaded:
            check_array_values(spec, arr, source)
    _check_trajectory_structure(arrays, attrs, sizes, source)


def _required(spec: ArraySpec, tree: bool) -> bool:
    """Whether a store must hold ``spec``'s array: a chain its ``states``, a tree its node arrays and every
    ``tree_*`` array instead (the tree probe, credit and update read them all)."""
    if spec.name == "states":
        return not tree
    return (tree and (spec.name in TREE_NODE_ARRAYS or spec.name in TREE_ARRAYS)) or not spec.optional


def check_array_values(spec: ArraySpec, values, source: str, row_offset: int = 0) -> None:
    """Refuse non-finite values (``spec.finite``) and values beyond ``+-spec.bound`` in ``values`` (the
    array, or its rows from ``row_offset`` on): one line naming the array and the first bad index."""
    if not spec.finite:
        return
    arr = np.asarray(values)
    if arr.size == 0:
        return
    lo, hi = arr.min(), arr.max()  # NaN and inf propagate: no array-sized temporaries on the good path
    if np.isfinite(lo) and np.isfinite(hi) and (spec.bound is None or -spec.bound <= lo <= hi <= spec.bound):
        return
    bad, what, why = ~np.isfinite(arr), "non-finite values", ""
    if not bad.any():
        bad, what = np.abs(arr) > spec.bound, f"values beyond +-{spec.bound:g}"
        why = " (no honest latent is that large: damage, or a diverged policy)"
    first = np.argwhere(bad)[0]
    value = arr[tuple(first)]
    first[0] += row_offset
    _fail(source, f"array '{spec.name}' has {int(bad.sum())} {what} (first at {first.tolist()}: "
                  f"{_plain(value)!r}){why}")


def _kind(dtype: str) -> str:
    return {"f": "f", "i": "iu", "b": "b"}[np.dtype(dtype).kind]


def _check_trajectory_structure(arrays: dict, attrs: dict, sizes: dict, source: str) -> None:
    window = int(attrs["window_size"])
    if sizes["window_step"][0] != window or sizes["state"][0] != window + 1:
        _fail(source, f"holds {sizes['window_step'][0]} window steps and {sizes['state'][0]} states; "
                      f"attribute window_size is {window} (expected {window} and {window + 1})")
    n, groups, g = sizes["trajectory"][0], len(attrs["prompts"]), int(attrs["group_size"])
    if n != groups * g:
        _fail(source, f"holds {n} trajectories; {groups} prompts x group_size {g} expected")
    bounds = [("prompt_index", groups), ("sample", g)]
    if "node_states" in arrays:  # a tree: node indices are within the prompt's node_states rows
        nodes = sizes["node"][0]
        if nodes % groups:
            _fail(source, f"array 'node_states' has {nodes} nodes; expected a multiple of the {groups} prompts")
        bounds += [(name, nodes // groups) for name in ("tree_parent_node", "tree_child_node")]
    for name, bound in bounds:
        values = np.asarray(arrays[name])
        if values.size and (values.min() < 0 or values.max() >= bound):
            _fail(source, f"array '{name}' has values {values.min()}..{values.max()}; expected 0..{bound - 1}")


def conform_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays in their declared dtypes and order (for writing; ``check_trajectories`` first)."""
    return {spec.name: np.ascontiguousarray(arrays[spec.name], dtype=spec.dtype) for spec in TRAJECTORY_ARRAYS
            if spec.name in arrays}


EMBEDDINGS_FILE = "prompt_embeds.safetensors"
# PromptEmbeddings' tensors and their rows: one per prompt, or one (the empty prompt); None-able ones may be absent.
EMBEDDING_ROWS = {"embeds": "prompts", "pooled": "prompts", "uncond_embeds": 1, "uncond_pooled": 1}
EMBEDDING_FIELDS = tuple(EMBEDDING_ROWS)
EMBEDDING_REQUIRED = ("embeds", "uncond_embeds")
EMBEDDING_METADATA = ("prompts", "model")  # the prompts (JSON list) and the hash of the `model` params
EMBEDDING_CHECKSUM = "sha256"  # metadata key added on write: the tensors' sha256 (checked on read)


def check_embeddings(shapes: dict[str, tuple[int, ...]], metadata: dict, source: str) -> None:
    """A prompt-embeddings file (``shapes``: tensor name -> shape): its metadata keys, known tensor names,
    ``embeds`` and ``uncond_embeds`` present, rows as ``EMBEDDING_ROWS`` says, and the same (L, D) per
    token in ``embeds`` and ``uncond_embeds``."""
    import json

    if sorted(set(metadata) - {EMBEDDING_CHECKSUM}) != sorted(EMBEDDING_METADATA):
        _fail(source, f"metadata keys {sorted(metadata)}; expected {list(EMBEDDING_METADATA)}")
    if set(shapes) - set(EMBEDDING_FIELDS) or not set(EMBEDDING_REQUIRED) <= set(shapes):
        _fail(source, f"tensors {sorted(shapes)}; expected {list(EMBEDDING_REQUIRED)} and any of "
                      f"{sorted(set(EMBEDDING_FIELDS) - set(EMBEDDING_REQUIRED))}")
    try:
        prompts = json.loads(metadata["prompts"])
    except ValueError:
        _fail(source, "metadata 'prompts' is not JSON")
    for name, shape in shapes.items():
        rows = len(prompts) if EMBEDDING_ROWS[name] == "prompts" else EMBEDDING_ROWS[name]
        if not shape or shape[0] != rows:
            _fail(source, f"tensor '{name}' has shape {list(shape)}; expected {rows} rows")
    if tuple(shapes["embeds"][1:]) != tuple(shapes["uncond_embeds"][1:]):
        _fail(source, f"tensors 'embeds' {list(shapes['embeds'])} and 'uncond_embeds' "
                      f"{list(shapes['uncond_embeds'])} differ per row")
