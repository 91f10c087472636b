"""The update's first-pass check as a record (:class:`tpgrpo.policy.update.FirstPass`): what update.json says,
when it stops the update, and the reduction over processes."""

from __future__ import annotations

import pytest
import torch

from tpgrpo.distributed import Dist
from tpgrpo.errors import PipelineError
from tpgrpo.policy.update import FirstPass


class _Optimizer:
    def __init__(self):
        self.cleared = False

    def zero_grad(self, set_to_none=True):
        self.cleared = True


def test_the_log_names_each_window_step_and_none_where_it_had_no_transition():
    first = FirstPass(0.25, torch.tensor([0.0, -1.0, 0.25], dtype=torch.float32))
    assert first.as_log() == {"first_pass_ratio_max_dev": 0.25, "first_pass_ratio_dev_per_step": [0.0, None, 0.25]}
    assert FirstPass.empty(3).as_log() == {"first_pass_ratio_max_dev": 0.0,
                                           "first_pass_ratio_dev_per_step": [None, None, None]}


@pytest.mark.parametrize("dev, tolerance, stops", [
    (1e-3, 1e-3, False), (2e-3, 1e-3, True), (5.0, None, False), (float("nan"), 1e-3, True)])
def test_the_check_stops_past_the_tolerance_and_names_the_window_step(dev, tolerance, stops):
    optimizer = _Optimizer()
    first = FirstPass(dev, torch.tensor([0.0, dev, -1.0], dtype=torch.float32))
    if not stops:
        first.check(tolerance, optimizer, " (iteration 3)")
        assert not optimizer.cleared
        return
    with pytest.raises(PipelineError) as info:
        first.check(tolerance, optimizer, " (iteration 3)")
    assert optimizer.cleared and "update (iteration 3)" in str(info.value) and "\n" not in str(info.value)
    if dev == dev:  # a NaN has no argmax to name
        assert "window step 1;" in str(info.value)


def test_one_process_reduces_to_itself_as_float32():
    first = FirstPass(0.1, torch.tensor([0.1, -1.0], dtype=torch.float32))
    reduced = first.reduced(Dist())
    assert reduced.max_dev == float(torch.tensor(0.1, dtype=torch.float32))  # what update.json always held
    assert torch.equal(reduced.per_step, first.per_step)
