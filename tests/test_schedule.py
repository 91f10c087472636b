"""Tests of the flow-matching schedule (spec section 1)."""

from __future__ import annotations

import pytest
import torch

from tpgrpo.algo.schedule import flow_sigmas


@pytest.mark.parametrize("num_steps", [1, 2, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_endpoints_length_and_monotone(num_steps, shift):
    s = flow_sigmas(num_steps, shift)
    assert s.shape == (num_steps + 1,) and s.dtype == torch.float32
    assert float(s[0]) == pytest.approx(1.0, abs=1e-6)
    assert float(s[-1]) == 0.0
    assert (s[1:] < s[:-1]).all(), "sigmas must strictly decrease"
    assert ((s >= 0) & (s <= 1)).all()


def test_shift_raises_intermediate_sigmas():
    plain, shifted = flow_sigmas(10, 1.0), flow_sigmas(10, 3.0)
    assert (shifted[1:-1] > plain[1:-1]).all()
    assert torch.equal(shifted[[0, -1]], plain[[0, -1]])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(0)
    with pytest.raises(ValueError, match="shift"):
        flow_sigmas(10, 0.0)
