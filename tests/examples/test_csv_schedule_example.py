"""examples/csv_schedule.py: the schedule loaded from CSV trains to the gradients and loss of one
non-pipelined step, and a CSV whose order is impossible is refused when the schedule is built."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import REPO_ROOT

from hyper_parallel.platform.local import LocalCluster, RankFailedError


def _example():
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    try:
        import csv_schedule
    finally:
        sys.path.pop(0)
    return csv_schedule


def test_csv_schedule_matches_a_non_pipelined_step(capsys):
    ex = _example()
    results = ex.main(["--steps", "2"])
    printed = capsys.readouterr().out
    assert "peak activations r0=3 r1=1" in printed and "step 1: loss" in printed

    model = ex.build_model()
    x, y = ex.data()
    loss = ex.loss_fn(model(x), y)
    loss.backward()
    assert results[0]["losses"] == [] and len(results[1]["losses"]) == 2
    torch.testing.assert_close(torch.tensor(results[1]["losses"][0]), loss.detach(), rtol=1e-5, atol=1e-7)
    for rank, names in ((0, ("0.weight", "0.bias")), (1, ("2.weight", "2.bias"))):
        grads = results[rank]["first_grads"]
        assert sorted(grads) == sorted(names)
        for name in names:
            torch.testing.assert_close(grads[name], model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)


def test_a_csv_with_a_backward_before_its_forward_is_refused(tmp_path):
    ex = _example()
    bad = tmp_path / "bad.csv"
    bad.write_text("F.s0.m0,B.s0.m1,F.s0.m1,B.s0.m0\nF.s1.m0,B.s1.m0,F.s1.m1,B.s1.m1\n")
    with pytest.raises(RankFailedError, match=r"ScheduleError: B.s0.m1 runs before its forward F.s0.m1"):
        LocalCluster(2).run(ex.train, str(bad), 1, 2)
