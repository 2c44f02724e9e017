"""Micro-batching details that the mutation audit found unchecked (benchmarks/results/mutation_audit.md)."""

from __future__ import annotations

import re

import pytest
import torch

from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec, merge_outputs, split_inputs
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
