"""Layout: tensor maps, placements, shapes, and the redistribution plan between two layouts."""

import pytest

from hyper_parallel.core.device_mesh import init_device_mesh
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.placement_types import Partial, Replicate, Shard
from hyper_parallel.core.redistribute import Step, plan
from hyper_parallel.platform.local import LocalCluster

L = Layout((2, 2), ("dp", "tp"))


def test_alias_tensor_maps():
    x = L("dp", "None")
    assert x.alias_tensor_map == ("dp", "None")
    assert x.tensor_map == (1, -1)  # MindSpore's convention: device-matrix dims counted from the right
    assert x.shard_dims == ((0,), ()) and x.ndim == 2
    w = L("None", ("dp", "tp"))
    assert w.alias_tensor_map == ("None", ("dp", "tp")) and w.tensor_map == (-1, (1, 0))
    assert L("tp", "dp", "None").shard_dims == ((1,), (0,), ())
    assert L().ndim == 0 and L().to_placements() == (Replicate(), Replicate())


def test_to_placements():
    assert L("dp", "None").to_placements() == (Shard(0), Replicate())
    assert L("None", "dp").to_placements() == (Shard(1), Replicate())
    assert L(("dp", "tp"), "None").to_placements() == (Shard(0), Shard(0))
    assert L("tp", "None").with_partial("dp").to_placements() == (Partial("sum"), Shard(0))
    assert L("None").with_partial("dp", "tp", reduce_op="max").partial == {"dp": "max", "tp": "max"}
    with pytest.raises(ValueError, match=r"tensor dim 0 is split over \('tp', 'dp'\).*placements cannot express it"):
        L(("tp", "dp"), "None").to_placements()


def test_layout_errors():
    with pytest.raises(ValueError, match="alias 'cp' is not a dimension of the device matrix"):
        L("cp", "None")
    with pytest.raises(ValueError, match=r"alias 'dp' shards tensor dims 0 and 1; each alias may be used once"):
        L("dp", "dp")
    with pytest.raises(ValueError, match="'None' cannot appear inside a tuple"):
        L(("dp", "None"))
    with pytest.raises(ValueError, match="has no tensor map yet"):
        _ = L.shard_dims
    with pytest.raises(ValueError, match="cannot shard a tensor dim and be partial"):
        L("None").with_partial("tp")("tp")
    with pytest.raises(ValueError, match="it cannot also be partial"):
        L("tp").with_partial("tp")
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        L("tp").with_partial("dp", reduce_op="prod")
    with pytest.raises(ValueError, match="mesh_shape must be a non-empty sequence of positive ints"):
        Layout((2, 0), ("a", "b"))
    with pytest.raises(ValueError, match=r"alias_name \['a'\] has 1 names for mesh_shape \[2, 2\]"):
        Layout((2, 2), ("a",))
    with pytest.raises(ValueError, match="alias names must be distinct"):
        Layout((2, 2), ("a", "a"))
    with pytest.raises(ValueError, match="other than 'None'"):
        Layout((2,), ("None",))
    with pytest.raises(TypeError, match="got the string 'dp'"):
        Layout((2,), "dp")
    with pytest.raises(ValueError, match="rank_list"):
        Layout((2,), ("a",), rank_list=[0, 0])


def test_shapes_and_uneven_sizes():
    w = L("None", ("dp", "tp"))
    assert w.local_shape((3, 8)) == (3, 2) and w.global_shape((3, 2)) == (3, 8)
    with pytest.raises(ValueError, match=r"tensor dim 1 of size 6 cannot be split evenly over \('dp', 'tp'\) "
                                         r"\(4 pieces\); uneven shards are not supported"):
        w.local_shape((3, 6))


def test_equality_and_repr():
    assert L("dp", "None") == Layout((2, 2), ("dp", "tp"))("dp", "None")
    assert L("dp", "None") != L("tp", "None") and L("dp") != L("dp").with_partial("tp")
    assert len({L("dp"), Layout((2, 2), ("dp", "tp"))("dp")}) == 1
    assert repr(L("dp", "None").with_partial("tp")) == (
        "Layout(mesh_shape=(2, 2), alias_name=('dp', 'tp'), tensor_map=('dp', 'None'), partial={'tp': 'sum'})"
    )


def _round_trip():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = (Partial("avg"), Shard(1))
    layout = Layout.from_placements(mesh, placements, 3)
    derived = Layout.from_device_mesh(mesh)("None", "tp", "None").with_partial("dp", reduce_op="avg")
    return layout.to_placements(), layout.alias_tensor_map, layout == derived, layout.mesh is mesh


def test_from_placements_round_trip():
    for out in LocalCluster(4).run(_round_trip):
        assert out == ((Partial("avg"), Shard(1)), ("None", "tp", "None"), True, True)




def test_plan_steps():
    g = "gather"
    # Shard -> Replicate: gather; nested shards are gathered inner first and re-split outer first
    assert plan(L("dp", "tp"), L("None", "None")) == [Step(g, 0, 0), Step(g, 1, 1)]
    assert plan(L(("dp", "tp"), "None"), L("tp", "None")) == [Step(g, 1, 0), Step(g, 0, 0), Step("slice", 1, 0)]
    assert plan(L(("dp", "tp"), "None"), L("dp", "None")) == [Step(g, 1, 0)]
    # Shard(i) -> Shard(j) on one mesh dim: one all_to_all
    assert plan(L("tp", "None"), L("None", "tp")) == [Step("all_to_all", 1, 0, 1)]
    # Partial -> Replicate / Shard
    assert plan(L("None", "None").with_partial("dp"), L("None", "None")) == [Step("all_reduce", 0, op="sum")]
    assert plan(L("None", "None").with_partial("dp", reduce_op="max"), L("None", "dp")) == [
        Step("reduce_scatter", 0, 1, op="max")
    ]
    # Replicate -> Shard: local slices, outer first
    assert plan(L("None", "None"), L(("tp", "dp"), "None")) == [Step("slice", 1, 0), Step("slice", 0, 0)]
    assert plan(L("dp", "tp"), L("dp", "tp")) == []


def test_plan_refuses_partial_targets_and_other_meshes():
    with pytest.raises(ValueError, match=r"cannot redistribute to Partial\(sum\) on mesh dim 'tp' \(the tensor is "
                                         r"not partial\)"):
        plan(L("dp", "None"), L("dp", "None").with_partial("tp"))
    with pytest.raises(ValueError, match="cannot redistribute between different meshes"):
        plan(L("dp"), Layout((4,), ("dp",))("dp"))
    with pytest.raises(ValueError, match="describes 1 tensor dims, the tensor has 2"):
        plan(L("dp", "None"), L("dp"))
