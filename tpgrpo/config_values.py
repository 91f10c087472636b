"""Checking one params value against its declaration (:func:`tpgrpo.config.param`): its type, its bounds,
a reward spec; and the one-line ``ConfigError`` (:mod:`tpgrpo.errors`) a bad value raises. Split out of
``tpgrpo.config``, which declares the sections and loads them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, get_type_hints

from tpgrpo.errors import ConfigError  # noqa: F401 - lives in errors, which tpgrpo.algo may import too


# Bounds the loader checks: a tuple of choices, one of these ranges, or a value kind checked by its own code.
RANGES = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, "[0, 1]": lambda v: 0.0 <= v <= 1.0}
RANGE_TEXT = {"> 0": "a value > 0", ">= 0": "a value >= 0", "[0, 1]": "a value in [0, 1]"}


def coerce(key: str, value: Any, kind: type) -> Any:
    """Check ``value`` against the annotated type; ints are accepted where floats are expected."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string: accept what float() reads
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"params: {key} = {value!r}: expected {kind.__name__}")
    return value


def check_range(key: str, value: Any, bounds: str | tuple[str, ...]) -> None:
    """Check ``value`` against the field's declared ``bounds`` (see :func:`param`)."""
    if bounds == "completion":
        from tpgrpo.algo.probe_modes import EXPECTED, parse_completion  # no torch: a few pure functions

        try:
            parse_completion(value)
        except ValueError:
            raise ConfigError(f"params: {key} = {value!r}: expected {EXPECTED}") from None
    elif isinstance(bounds, tuple) and value not in bounds:
        raise ConfigError(f"params: {key} = {value!r}: expected one of {', '.join(bounds)}")
    elif bounds in RANGES and not RANGES[bounds](value):
        raise ConfigError(f"params: {key} = {value!r}: expected {RANGE_TEXT[bounds]}")


def build_section(name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"params: {name}: expected a mapping of keys, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"params: unknown key {name}.{key} (known: {', '.join(fields)})")
    values = {}
    for key, spec in fields.items():
        if key not in raw:
            raise ConfigError(f"params: missing key {name}.{key}")
        bounds = spec.metadata["bounds"]
        if bounds == "reward":
            values[key] = reward_spec(f"{name}.{key}", raw[key])
            continue
        if bounds == "steps":
            values[key] = step_list(f"{name}.{key}", raw[key])
            continue
        if bounds == "children":
            values[key] = child_counts(f"{name}.{key}", raw[key])
            continue
        values[key] = coerce(f"{name}.{key}", raw[key], hints[key])
        check_range(f"{name}.{key}", values[key], bounds)
    return cls(**values)


def _plain_int(value: Any) -> bool:
    """An int as YAML gives one, not a bool (YAML's ``true`` is no step or count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def step_list(key: str, value: Any) -> str:
    """Schedule step indices as the comma-separated text the key holds: text as written (``"0,3,6"``: the
    config hash of a run that wrote it is unchanged), a YAML int (``3``) as ``"3"`` and a YAML list
    (``[0, 3, 6]``) as ``"0,3,6"``, so the same steps hash the same however they are written. Whether the
    steps fit the schedule is checked with the other tree params (tpgrpo.algo.tree_shape)."""
    if isinstance(value, str):
        return value
    if _plain_int(value):
        return str(value)
    if isinstance(value, list) and value and all(_plain_int(v) for v in value):
        return ",".join(str(v) for v in value)
    raise ConfigError(f"params: {key} = {value!r}: expected step indices: comma-separated text (0,3,6), a list "
                      "of ints ([0, 3, 6]) or one int")


def child_counts(key: str, value: Any) -> int | str:
    """SDE children per split: one int for every split (kept an int, so the config hash of a run that wrote
    one is unchanged), or one count per split step as comma-separated text (``"3,1"``) or a YAML list
    (``[3, 1]``), held as ``"3,1"``; a text of one int (``"3"``, as ``--set`` may pass it) is that int. Each
    count > 0; one per split step is checked with the other tree params (tpgrpo.algo.tree_shape)."""
    counts = None
    if _plain_int(value):
        counts = [value]
    elif isinstance(value, list) and value and all(_plain_int(v) for v in value):
        counts = value
    elif isinstance(value, str):
        try:
            counts = [int(part) for part in value.split(",")]
        except ValueError:
            pass
    if not counts or min(counts) < 1:
        raise ConfigError(f"params: {key} = {value!r}: expected a count > 0 for every split (1) or one per split "
                          "step, comma-separated (3,1) or a list of ints ([3, 1])")
    return counts[0] if len(counts) == 1 else ",".join(str(c) for c in counts)


def reward_spec(key: str, value: Any) -> str | dict[str, float]:
    """A reward name, or a non-empty mapping name -> finite weight; names from the reward registry."""
    from tpgrpo.tasks.reward_names import REWARD_NAMES  # not the registry: it imports the task code

    known = f"known rewards: {', '.join(REWARD_NAMES)}"
    if isinstance(value, str):
        if value not in REWARD_NAMES:
            raise ConfigError(f"params: {key} = {value!r}: unknown reward ({known})")
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"params: {key} = {value!r}: expected a reward name or a mapping name -> weight "
                          f"({known})")
    spec = {}
    for name, weight in value.items():
        if name not in REWARD_NAMES:
            raise ConfigError(f"params: {key}.{name}: unknown reward ({known})")
        spec[name] = coerce(f"{key}.{name}", weight, float)
    return spec
