"""DTensor on LocalCluster: every move against a dense numpy reference, torch (all pairs, autograd)
and MindSpore (a lean set that still covers every kind of step)."""

from __future__ import annotations

import pytest
from dtensor_checks import (
    all_pairs,
    check_distribute,
    check_errors,
    check_layouts,
    check_mixed_partials,
    check_redistribute,
    mesh_1d,
    mesh_2x2,
    mesh_reversed,
)

from hyper_parallel.core.placement_types import Partial, Replicate, Shard
from hyper_parallel.platform.local import LocalCluster

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()

# one of each step: gather, nested gather (inner first), all_to_all, all_reduce, reduce_scatter, slice
LEAN_PAIRS = [
    ((S0, S1), (R, R)),
    ((S0, S0), (R, S0)),
    ((S0, S0), (S1, R)),
    ((R, S0), (R, S1)),
    ((S1, R), (S0, R)),
    ((P, R), (R, R)),
    ((R, P), (R, S1)),
    ((P, P), (S0, S1)),
    ((R, R), (S1, S0)),
    ((R, R), (S0, S0)),
    ((Partial("avg"), S0), (R, S0)),
    ((S1, Partial("max")), (S1, R)),
]


def _torch_all():
    from dtensor_grad_checks import check_full_tensor_grad, check_grads

    mesh, line = mesh_2x2(), mesh_1d(4)
    return (
        check_redistribute(mesh, all_pairs(2))
        + check_redistribute(line, all_pairs(1, ("sum", "avg", "max", "min")))
        + check_redistribute(mesh_reversed(), all_pairs(2))
        + check_grads(mesh_reversed(), all_pairs(2)[::7])
        + check_layouts(mesh)
        + check_errors(mesh)
        + check_distribute(mesh)
        + check_grads(mesh, all_pairs(2))
        + check_grads(line, all_pairs(1))
        + check_full_tensor_grad(mesh)
    )


def test_torch_pending_reductions_of_several_kinds():
    """Finishing reductions that do not commute in one move is refused; one mesh dim at a time is exact."""
    for rank, failures in enumerate(LocalCluster(4, platform="torch").run(lambda: check_mixed_partials(mesh_2x2()))):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)


def test_torch_every_pair_and_gradient():
    for rank, failures in enumerate(LocalCluster(4, platform="torch").run(_torch_all)):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)


def _mindspore_lean():
    mesh = mesh_2x2()
    return check_redistribute(mesh, LEAN_PAIRS) + check_layouts(mesh) + check_errors(mesh) + check_distribute(mesh)


def test_mindspore_lean_pairs():
    pytest.importorskip("mindspore")
    for rank, failures in enumerate(LocalCluster(4, platform="mindspore").run(_mindspore_lean)):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)


def _mindspore_identity_grads():
    """from_local / to_local pass gradients through under ms.grad too (no stage autograd involved)."""
    import mindspore as ms
    import numpy as np

    from hyper_parallel.core.dtensor import DTensor

    mesh = mesh_1d(2)
    x = ms.Tensor(np.arange(4, dtype=np.float32).reshape(2, 2))

    def through_local(t):
        return (DTensor.from_local(t * 3, mesh, [Shard(0)]).to_local() ** 2).sum()

    return ms.grad(through_local)(x).asnumpy().tolist()


def test_mindspore_from_local_to_local_gradient():
    pytest.importorskip("mindspore")
    for grads in LocalCluster(2, platform="mindspore").run(_mindspore_identity_grads):
        assert grads == [[0.0, 18.0], [36.0, 54.0]]  # d/dx sum((3x)^2) = 18x


LEAN_GRAD_PAIRS = [((S0, S1), (R, R)), ((P, R), (R, R)), ((R, R), (S1, S0)), ((R, S0), (R, S1)), ((P, S0), (S1, S0))]


def _mindspore_grads():
    from dtensor_grad_checks import check_full_tensor_grad, check_grads

    mesh = mesh_2x2()
    return check_grads(mesh, LEAN_GRAD_PAIRS) + check_full_tensor_grad(mesh)


def test_mindspore_gradients():
    pytest.importorskip("mindspore")
    for rank, failures in enumerate(LocalCluster(4, platform="mindspore").run(_mindspore_grads)):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)
