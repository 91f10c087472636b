"""How the probe scores an intermediate state (``probe.completion``), as small pure functions.

Modes (spec section 4):
- ``exact``: ODE-complete ``z_k`` with the rest of the schedule, ``s_k -> s_{k+1} -> ... -> 0`` (one
  transformer pass per remaining step);
- ``ode:M``: ODE-complete ``z_k`` with at most M Euler steps on a re-spaced schedule picked from its own
  remaining sigmas (DenseGRPO's 1- and 2-step variants); M >= the remaining steps is ``exact``;
- ``x0``: score ``x0_hat = z_k - s_k v_k`` with the guided velocity the rollout already computed at ``z_k``
  (Stepwise-Flow-GRPO): no transformer pass at all;
- ``grid:M`` (common grid): one coarse grid of M + 1 nodes shared by every state (schedule steps
  ``respaced_steps(T, M)``: both ends and M - 1 between); ``z_k`` first steps to the next node after it, then
  follows the grid's nodes to 0, so adjacent states share every node after their first and their
  discretisation errors largely cancel in the increment ``Q_{k+1} - Q_k``;
- ``heun:M`` (second order): M steps on the state's own re-spaced schedule as ``ode:M``, each
  a Heun step (Euler predictor, trapezoidal corrector with a second pass at the target) except the last
  one, to sigma 0, which stays Euler (as EDM and diffusers' Heun schedulers do): 2M - 1 passes a state;
- ``heun-grid:M``: the two combined, Heun steps along ``grid:M``'s path.
Every transformer mode's first step starts at ``z_k`` with the velocity there, which the rollout stores
(``velocities``): one pass fewer per state than the counts above.
``credit.mode: flow_grpo``'s probe scores nothing: it writes ``Q_k = R_fin`` from the rollout (stages/probe.py).

No torch at import time: the config validates ``probe.completion`` with :func:`parse_completion`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

EXPECTED = "exact, x0, ode:M, grid:M, heun:M or heun-grid:M with an integer M >= 1"
STEPPED = ("ode", "grid", "heun", "heun-grid")  # the kinds that take ":M"


@dataclass(frozen=True)
class Completion:
    """A parsed ``probe.completion``: ``kind`` in exact | ode | grid | heun | heun-grid | x0; ``max_steps``
    = M for the stepped kinds (``STEPPED``), None otherwise."""

    kind: str
    max_steps: int | None = None

    @property
    def name(self) -> str:
        """The setting as written in params.yaml (and in the probe table's metadata)."""
        return f"{self.kind}:{self.max_steps}" if self.kind in STEPPED else self.kind

    @property
    def runs_transformer(self) -> bool:
        return self.kind != "x0"

    @property
    def order(self) -> int:
        """1: Euler steps; 2: Heun steps (a second pass at each step's target, except at sigma 0)."""
        return 2 if self.kind in ("heun", "heun-grid") else 1


EXACT = Completion("exact")  # every remaining step of the schedule, one Euler step each

def parse_completion(value: object) -> Completion:
    """``"exact"`` | ``"x0"`` | ``"ode:M"`` | ``"grid:M"`` | ``"heun:M"`` | ``"heun-grid:M"`` (M an integer
    >= 1, written in decimal) -> :class:`Completion`.

    Raises ValueError with a one-line message naming what was given and what is expected.
    """
    if value in ("exact", "x0"):
        return Completion(str(value))
    kind, _, digits = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind in STEPPED and digits.isascii() and digits.isdigit() and int(digits) >= 1:
        return Completion(kind, int(digits))
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


def visits(completion: Completion, start: int, num_steps: int) -> list[int]:
    """The schedule steps (indices into the T + 1 sigmas) a state at step ``start`` passes through, from
    ``start`` to ``num_steps`` (sigma 0), increasing: ``exact`` every one, ``ode:M`` / ``heun:M`` its own
    re-spaced ``respaced_steps``, ``grid:M`` / ``heun-grid:M`` ``start`` then the shared grid's nodes
    after it, ``x0`` one step to 0."""
    if not 0 <= start < num_steps:
        raise ValueError(f"start = {start}: a state to complete sits at a step in 0..{num_steps - 1}")
    if completion.kind == "x0":
        return [start, num_steps]
    if completion.kind in ("grid", "heun-grid"):
        return [start, *(n for n in respaced_steps(num_steps, completion.max_steps) if n > start)]
    return [start + offset for offset in respaced_steps(num_steps - start, completion.max_steps)]


def completion_passes(start_steps: Sequence[int], num_steps: int, completion: Completion,
                      first_step_given: bool = False) -> int:
    """Transformer passes (one per state per model evaluation, CFG doubling not counted) that completing
    states at schedule steps ``start_steps`` of a ``num_steps``-step schedule costs: per state its steps
    (``visits`` less one; ``exact`` ``T - j``, ``ode:M`` ``min(M, T - j)``), twice less one for ``heun:M``
    (no corrector at sigma 0), 0 for ``x0``. ``first_step_given``: each state's first step uses a velocity
    given with it (the rollout's stored ``v_k``): one pass fewer per state."""
    if not completion.runs_transformer:
        return 0
    steps = [len(visits(completion, j, num_steps)) - 1 for j in start_steps]
    per_state = [completion.order * n - (completion.order - 1) for n in steps]
    return sum(per_state) - (len(per_state) if first_step_given else 0)
