"""Micro-batching details that the mutation audit found unchecked (benchmarks/results/mutation_audit.md)."""

from __future__ import annotations

import re

import pytest
import torch

from hyper_parallel.core.pipeline_parallel.runtime.microbatch import BatchDimSpec, merge_outputs, split_inputs
from hyper_parallel.platform.torch import TorchPlatform

P = TorchPlatform()


def test_the_default_spec_splits_along_dim_zero():
    assert BatchDimSpec().dim == 0
    x = torch.arange(24.0).reshape(4, 6)
    pieces = split_inputs(P, (x,), {"k": x}, 2, (BatchDimSpec(),), {"k": BatchDimSpec()})
    assert [tuple(a[0].shape) for a, _ in pieces] == [(2, 6), (2, 6)]
    assert torch.equal(pieces[1][0][0], x[2:]) and torch.equal(pieces[1][1]["k"], x[2:])


def test_merge_names_the_first_micro_batch_whose_structure_differs():
    t = torch.ones(2)
    with pytest.raises(ValueError, match=re.escape("micro-batch 1 gives a tuple of 1 where micro-batch 0 gives a "
                                                   "tuple of 2")):
        merge_outputs(P, [(t, t), (t,), [t]], 0)


@pytest.mark.timeout(60)
def test_a_dtensor_input_is_split_along_its_spec_and_keeps_its_layout():
    from hyper_parallel.core.device_mesh import init_device_mesh
    from hyper_parallel.core.dtensor import DTensor
    from hyper_parallel.core.placement_types import Replicate
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    def body():
        p = get_platform()
        mesh = init_device_mesh("cpu", (1,))
        x = torch.arange(24.0).reshape(4, 6)
        dt = DTensor.from_local(x, mesh, [Replicate()])
        split = split_inputs(p, (dt, dt), {}, 2, (BatchDimSpec(1), BatchDimSpec(None)), None)
        with pytest.raises(ValueError, match=re.escape("micro-batch 1 gives a tensor where micro-batch 0 gives a "
                                                       "DTensor laid out as")):
            merge_outputs(p, [dt, x], 0)
        return [(a[0].to_local().clone(), a[0].layout == dt.layout, a[1] is dt) for a, _ in split]

    pieces = LocalCluster(1).run(body)[0]
    x = torch.arange(24.0).reshape(4, 6)
    for i, (local, same_layout, whole) in enumerate(pieces):
        assert torch.equal(local, x[:, 3 * i:3 * i + 3]) and same_layout and whole
