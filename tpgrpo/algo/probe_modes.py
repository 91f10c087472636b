"""How the probe scores an intermediate state (``probe.completion``), as small pure functions.

Modes (spec section 4 and issue 11):
- ``exact``: ODE-complete ``z_k`` with the rest of the schedule, ``s_k -> s_{k+1} -> ... -> 0`` (one
  transformer pass per remaining step);
- ``ode:M``: ODE-complete ``z_k`` with at most M Euler steps on a re-spaced schedule picked from its own
  remaining sigmas (DenseGRPO's 1- and 2-step variants); M >= the remaining steps is ``exact``;
- ``x0``: score ``x0_hat = z_k - s_k v_k`` with the guided velocity the rollout already computed at ``z_k``
  (Stepwise-Flow-GRPO): no transformer pass at all.
``credit.mode: flow_grpo``'s probe scores nothing: it writes ``Q_k = R_fin`` from the rollout (stages/probe.py).

No torch at import time: the config validates ``probe.completion`` with :func:`parse_completion`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

EXPECTED = "exact, x0 or ode:M with an integer M >= 1"


@dataclass(frozen=True)
class Completion:
    """A parsed ``probe.completion``: ``kind`` in exact | ode | x0; ``max_steps`` = M for ``ode``."""

    kind: str
    max_steps: int | None = None

    @property
    def name(self) -> str:
        """The setting as written in params.yaml (and in the probe table's metadata)."""
        return f"ode:{self.max_steps}" if self.kind == "ode" else self.kind

    @property
    def runs_transformer(self) -> bool:
        return self.kind in ("exact", "ode")


def parse_completion(value: object) -> Completion:
    """``"exact"`` | ``"x0"`` | ``"ode:M"`` (M an integer >= 1, written in decimal) -> :class:`Completion`.

    Raises ValueError with a one-line message naming what was given and what is expected.
    """
    if value in ("exact", "x0"):
        return Completion(str(value))
    if isinstance(value, str) and value.startswith("ode:"):
        digits = value[len("ode:"):]
        if digits.isascii() and digits.isdigit() and int(digits) >= 1:
            return Completion("ode", int(digits))
    raise ValueError(f"{value!r}: expected {EXPECTED}")


def respaced_steps(remaining: int, max_steps: int | None) -> list[int]:
    """Offsets into a state's own remaining schedule that its completion visits.

    A state with ``remaining`` steps left has sigmas ``s_j .. s_{j+remaining}`` (the last one 0); its
    completion uses ``min(max_steps, remaining) + 1`` of them at evenly spaced offsets rounded half up,
    always the first (0) and the last (``remaining``). ``max_steps`` None (``exact``) or >= ``remaining``
    gives every offset ``0..remaining``, i.e. the exact completion. Returns the increasing offsets.
    """
    if remaining < 1:
        raise ValueError(f"remaining = {remaining}: a state to complete has at least one step left")
    m = remaining if max_steps is None else min(max_steps, remaining)
    # (i * remaining) / m rounded half up, in integers: steps of remaining / m >= 1 keep them increasing.
    return [(2 * i * remaining + m) // (2 * m) for i in range(m + 1)]


def completion_passes(start_steps: Sequence[int], num_steps: int, completion: Completion,
                      first_step_given: bool = False) -> int:
    """Transformer passes (one per state per Euler step, CFG doubling not counted) that completing
    states at schedule steps ``start_steps`` of a ``num_steps``-step schedule costs: ``exact``
    ``sum(T - j)``, ``ode:M`` ``sum(min(M, T - j))``, ``x0`` 0. ``first_step_given``: each state's first
    step uses a velocity given with it (the rollout's stored ``v_k``): one pass fewer per state."""
    if not completion.runs_transformer:
        return 0
    per_state = [len(respaced_steps(num_steps - j, completion.max_steps)) - 1 for j in start_steps]
    return sum(per_state) - (len(per_state) if first_step_given else 0)
