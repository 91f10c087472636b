"""A tree rollout's shape and its counts: pure Python, so the config loader checks it without torch.

Counts are per root, for a schedule of T steps: lineages alive at each step, leaves (samples), edges, SDE edges
(trained transitions) and transformer rows (passes, x2 with CFG's doubled batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tpgrpo.errors import ConfigError


@dataclass(frozen=True)
class TreeShape:
    """A tree's shape: ``split_steps`` (schedule step indices, strictly increasing, each in [0, T - 2]),
    ``children`` (SDE children per node per split, each >= 1: one int m for every split, or a tuple with one
    count m_j per split step), ``roots`` R (independent roots per prompt). Below, P_j = prod_{i<j} (m_i + 1)
    is the number of lineages a root has before split j."""

    split_steps: tuple[int, ...]
    children: int | tuple[int, ...]
    roots: int

    def check(self, num_steps: int) -> None:
        """ValueError (one line) unless the shape fits a schedule of ``num_steps`` steps."""
        s = list(self.split_steps)
        if not s or any(b <= a for a, b in zip(s, s[1:])) or s[0] < 0 or s[-1] > num_steps - 2:
            raise ValueError(f"tree split steps {s}: expected a non-empty strictly increasing list in "
                             f"[0, {num_steps - 2}] (num_steps - 2: the last step to sigma 0 stays ODE)")
        per_split = isinstance(self.children, tuple)
        if per_split and len(self.children) != len(s):
            raise ValueError(f"tree children {list(self.children)}: expected one count per split step {s} "
                             f"({len(s)}), or one count for all")
        if min(self.counts) < 1 or self.roots < 1:
            raise ValueError(f"tree children {self.children}, roots {self.roots}: expected both >= 1")

    @property
    def depth(self) -> int:
        """L, the number of split steps."""
        return len(self.split_steps)

    @property
    def counts(self) -> tuple[int, ...]:
        """m_j, the SDE children per node at split j, one per split step."""
        if isinstance(self.children, tuple):
            return self.children
        return (self.children,) * self.depth

    def _lineages_before(self, j: int) -> int:
        """P_j: lineages per root before split j (1 before the first)."""
        return prod(m + 1 for m in self.counts[:j])

    def lineages_at(self, step: int) -> int:
        """Lineages alive (rows through the model) at schedule ``step``, per root: P_(splits before it)."""
        return self._lineages_before(sum(1 for k in self.split_steps if k < step))

    def leaves_per_root(self) -> int:
        return self._lineages_before(self.depth)

    def edges_per_root(self) -> int:
        """ODE and SDE edges per root: sum_j P_(j+1)."""
        return sum(self._lineages_before(j + 1) for j in range(self.depth))

    def nodes_per_root(self) -> int:
        """Distinct states a tree store keeps per root (``node_states``): at split j, the P_j lineages'
        states before the step (unless split j - 1 is the step just before: they are its children, already
        kept) and their P_(j+1) children after it."""
        s, P = self.split_steps, self._lineages_before
        return sum(P(j + 1) + (0 if j and s[j] == s[j - 1] + 1 else P(j)) for j in range(self.depth))

    def sde_edges_per_root(self) -> int:
        """Trained transitions per root: sum_j m_j P_j."""
        return sum(m * self._lineages_before(j) for j, m in enumerate(self.counts))

    def passes_per_root(self, num_steps: int) -> int:
        """Transformer rows per root over the whole schedule (x2 with CFG's doubled batch)."""
        return sum(self.lineages_at(t) for t in range(num_steps))


def parse_split_steps(text: str) -> tuple[int, ...]:
    """``"0,3,6"`` -> ``(0, 3, 6)``; ValueError (one line) on anything that is not comma-separated ints."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"tree split steps {text!r}: expected comma-separated step indices such as 0,3,6") from None


def parse_children(value: int | str) -> int | tuple[int, ...]:
    """``tree.children`` as loaded (:func:`tpgrpo.config_values.child_counts`): ``3`` -> 3, ``"3,1"`` -> (3, 1)."""
    return value if isinstance(value, int) else tuple(int(part) for part in value.split(","))


def shape_of(tree_params) -> TreeShape:
    """The :class:`TreeShape` of a config's ``tree`` section (unchecked)."""
    return TreeShape(parse_split_steps(tree_params.split_steps), parse_children(tree_params.children),
                     tree_params.roots)


def check_tree_params(cfg) -> None:
    """ConfigError (one line) unless ``cfg``'s (a :class:`tpgrpo.config.Config` with ``tree.enabled``) split
    steps fit its schedule and its probe completes nothing (a tree's Q are its leaves' rewards)."""
    t = cfg.tree
    try:
        shape_of(t).check(cfg.sampling.num_steps)
    except ValueError as exc:
        raise ConfigError(f"params: tree.split_steps = {t.split_steps!r}, tree.children = {t.children!r}: "
                          f"{exc}") from None
    if cfg.probe.completion != "exact":
        raise ConfigError(f"params: probe.completion = {cfg.probe.completion!r} with tree.enabled: expected exact "
                          "(a tree's Q are its leaves' rewards: the probe completes nothing)")
