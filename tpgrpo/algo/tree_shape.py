"""A tree rollout's shape and its counts (issue 35): pure Python, so the config loader checks it without torch.

Counts are per root, for a schedule of T steps: lineages alive at each step, leaves (samples), edges, SDE edges
(trained transitions) and transformer rows (passes, x2 with CFG's doubled batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpgrpo.config_values import ConfigError


@dataclass(frozen=True)
class TreeShape:
    """A tree's shape: ``split_steps`` (schedule step indices, strictly increasing, each in [0, T - 2]),
    ``children`` m (SDE children per node per split, >= 1), ``roots`` R (independent roots per prompt)."""

    split_steps: tuple[int, ...]
    children: int
    roots: int

    def check(self, num_steps: int) -> None:
        """ValueError (one line) unless the shape fits a schedule of ``num_steps`` steps."""
        s = list(self.split_steps)
        if not s or any(b <= a for a, b in zip(s, s[1:])) or s[0] < 0 or s[-1] > num_steps - 2:
            raise ValueError(f"tree split steps {s}: expected a non-empty strictly increasing list in "
                             f"[0, {num_steps - 2}] (num_steps - 2: the last step to sigma 0 stays ODE)")
        if self.children < 1 or self.roots < 1:
            raise ValueError(f"tree children {self.children}, roots {self.roots}: expected both >= 1")

    @property
    def depth(self) -> int:
        """L, the number of split steps."""
        return len(self.split_steps)

    def lineages_at(self, step: int) -> int:
        """Lineages alive (rows through the model) at schedule ``step``, per root: (m+1)^(splits before it)."""
        return (self.children + 1) ** sum(1 for k in self.split_steps if k < step)

    def leaves_per_root(self) -> int:
        return (self.children + 1) ** self.depth

    def edges_per_root(self) -> int:
        """ODE and SDE edges per root: (m+1) * sum_{j<L} (m+1)^j."""
        return sum((self.children + 1) ** (j + 1) for j in range(self.depth))

    def nodes_per_root(self) -> int:
        """Distinct states a tree store keeps per root (``node_states``): at split j, the (m+1)^j lineages'
        states before the step (unless split j - 1 is the step just before: they are its children, already
        kept) and their (m+1)^(j+1) children after it."""
        s, m1 = self.split_steps, self.children + 1
        return sum(m1 ** (j + 1) + (0 if j and s[j] == s[j - 1] + 1 else m1 ** j) for j in range(self.depth))

    def sde_edges_per_root(self) -> int:
        """Trained transitions per root: m * sum_{j<L} (m+1)^j."""
        return self.children * sum((self.children + 1) ** j for j in range(self.depth))

    def passes_per_root(self, num_steps: int) -> int:
        """Transformer rows per root over the whole schedule (x2 with CFG's doubled batch)."""
        return sum(self.lineages_at(t) for t in range(num_steps))


def parse_split_steps(text: str) -> tuple[int, ...]:
    """``"0,3,6"`` -> ``(0, 3, 6)``; ValueError (one line) on anything that is not comma-separated ints."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"tree split steps {text!r}: expected comma-separated step indices such as 0,3,6") from None


def check_tree_params(cfg) -> None:
    """ConfigError (one line) unless ``cfg``'s (a :class:`tpgrpo.config.Config` with ``tree.enabled``) split
    steps fit its schedule and its probe completes nothing (a tree's Q are its leaves' rewards)."""
    t = cfg.tree
    try:
        TreeShape(parse_split_steps(t.split_steps), t.children, t.roots).check(cfg.sampling.num_steps)
    except ValueError as exc:
        raise ConfigError(f"params: tree.split_steps = {t.split_steps!r}: {exc}") from None
    if cfg.probe.completion != "exact":
        raise ConfigError(f"params: probe.completion = {cfg.probe.completion!r} with tree.enabled: expected exact "
                          "(a tree's Q are its leaves' rewards: the probe completes nothing)")
