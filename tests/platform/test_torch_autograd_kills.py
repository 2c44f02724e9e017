"""Torch stage autograd contracts that the mutation audit found unchecked
(benchmarks/results/mutation_audit.md): argument counts are checked with a message, and a graph
whose saved tensors the split backward freed says so when walked again."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.platform.torch import autograd as ag


def _record(module, x):
    return ag.stage_forward(module, (x,), {}, tuple(module.parameters()), (True,))


def test_forward_refuses_a_wrong_number_of_gradient_flags():
    with pytest.raises(ValueError, match="grad_args has 1 flags for 2 arguments"):
        ag.stage_forward(lambda a, b: a + b, (torch.ones(2), torch.ones(2)), {}, (), (True,))


@pytest.mark.parametrize("backward", [ag.stage_backward, ag.stage_backward_input])
def test_backward_refuses_a_wrong_number_of_output_gradients(backward):
    lin = torch.nn.Linear(2, 2)
    record = _record(lin, torch.ones(1, 2))
    with pytest.raises(ValueError, match="got 2 output gradients for 1 stage outputs"):
        backward(record, [torch.ones(1, 2), torch.ones(1, 2)])


def test_walking_a_graph_again_after_its_split_backward_names_the_cause():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    record = _record(block, torch.randn(2, 3))
    grad = torch.ones(2, 3)
    ag.stage_backward_input(record, [grad])
    ag.stage_backward_weight(record)
    with pytest.raises(RuntimeError, match="already ran and freed what the forward saved"):
        torch.autograd.backward(record.outputs[0], grad)


def test_a_full_backward_frees_the_graph():
    # The forward's saved activations are released by the backward (keep_graph off): walking
    # the graph again fails instead of silently finding every activation still held.
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    record = _record(block, torch.randn(2, 3))
    ag.stage_backward(record, [torch.ones(2, 3)])
    with pytest.raises(RuntimeError, match="second time|already been freed"):
        torch.autograd.backward(record.outputs[0], torch.ones(2, 3))
