"""Stable per-sample seeds, so any trajectory can be regenerated alone (spec section 3)."""

from __future__ import annotations

import hashlib


def sample_seed(run_seed: int, iteration: int, prompt_id: str, sample: int, purpose: str = "rollout") -> int:
    """A 63-bit seed from (run seed, iteration, prompt id, sample index, purpose) by sha256.

    Unlike Python's ``hash`` it does not change between processes, and unlike ``seed + i`` it does not
    depend on the batch a sample lands in or on how many processes share the work.
    """
    key = f"{purpose}|{run_seed}|{iteration}|{prompt_id}|{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") & ((1 << 63) - 1)
