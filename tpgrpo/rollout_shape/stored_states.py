"""A store's states read by its shape's name, for callers outside the stages (studies, tests) that hold it.

The update reads them through its shape's module (:mod:`.chain_update`, :mod:`.tree_update`); this module is
apart from the package's ``__init__`` so that the credit stage, which imports the package, never imports the
policy code behind it.
"""

from __future__ import annotations

from tpgrpo.policy.states import LazyStates, NodeStates
from tpgrpo.rollout_shape import CHAIN, pick


def store_states(arrays: dict, num_prompts: int, shape: str = CHAIN) -> LazyStates:
    """The lazy states of a store of ``num_prompts`` prompts read with ``states`` / ``node_states`` lazy: a
    chain's ``states`` (:meth:`LazyStates.from_store`) or a tree's edges on its ``node_states``
    (:meth:`NodeStates.from_store`)."""
    return pick(shape, LazyStates, NodeStates).from_store(arrays, num_prompts)
