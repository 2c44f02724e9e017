"""DeviceMesh inside LocalCluster on both frameworks."""

import numpy as np
import pytest

from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError


def _mesh_facts():
    p = get_platform()
    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh["pp"], mesh["dp"]
    swapped = mesh["pp", "dp"]
    total = p.all_reduce(p.from_numpy(np.array([p.rank], np.float32)), group=pp.get_group())
    return {
        "coord": mesh.get_coordinate(),
        "mesh": mesh.mesh,
        "pp": (pp.ranks, pp.get_local_rank(), pp.size(), pp.get_group().ranks),
        "dp": (dp.ranks, dp.get_local_rank(), dp.get_group().ranks),
        "swapped": (swapped.shape, swapped.mesh_dim_names, swapped.get_coordinate()),
        "pp_sum": float(p.to_numpy(total)[0]),
        "size": (mesh.size(), mesh.size("pp"), mesh.ndim),
    }


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_mesh_coordinates_submeshes_and_groups(framework):
    results = LocalCluster(6, platform=framework).run(_mesh_facts)
    for r, out in enumerate(results):
        d, q = divmod(r, 3)
        assert out["coord"] == (d, q)
        assert out["mesh"] == [[0, 1, 2], [3, 4, 5]]
        assert out["pp"] == ((3 * d, 3 * d + 1, 3 * d + 2), q, 3, (3 * d, 3 * d + 1, 3 * d + 2))
        assert out["dp"] == ((q, q + 3), d, (q, q + 3))
        assert out["swapped"] == ((3, 2), ("pp", "dp"), (q, d))
        assert out["pp_sum"] == sum(range(3 * d, 3 * d + 3))
        assert out["size"] == (6, 3, 2)


def _bad_shape():
    init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "pp"))


def test_shape_must_match_world_size():
    with pytest.raises(RankFailedError, match=r"mesh_shape \[3, 2\] has 6 ranks but the world size is 4"):
        LocalCluster(4).run(_bad_shape)


def _bad_names():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    errors = []
    for call in (lambda: mesh["tp"], lambda: mesh.get_group(), lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("a", "b")),
                 lambda: DeviceMesh("cpu", [0, 1, 1, 2], (2, 2))):
        try:
            call()
        except (KeyError, ValueError) as exc:
            errors.append(type(exc).__name__)
    return errors


def test_mesh_argument_errors():
    assert LocalCluster(4).run(_bad_names)[0] == ["KeyError", "ValueError", "ValueError", "ValueError"]


def _counting_new_group(p):
    """Count the groups the rank's platform creates (wraps the library's own method)."""
    calls = []
    create = p.new_group

    def counted(ranks):
        calls.append(tuple(ranks))
        return create(ranks)

    p.new_group = counted
    return calls


def _groups_created_once():
    p = get_platform()
    calls = _counting_new_group(p)
    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "pp"))
    after_init = len(calls)
    same = (
        mesh.get_group("dp") is mesh.get_group("dp") is mesh["dp"].get_group() is mesh["pp", "dp"].get_group("dp")
    )
    after_queries = len(calls)
    flat = mesh.flatten()
    again = mesh.flatten()
    return {
        "after_init": after_init,
        "after_queries": after_queries,
        "same": same,
        "flatten_groups": len(calls) - after_queries,
        "flat_cached": flat.get_group() is again.get_group(),
        "flat": (flat.mesh_dim_names, flat.ranks, flat.get_local_rank(), flat.get_group().ranks),
    }


def test_groups_are_created_with_the_mesh_and_cached():
    for r, out in enumerate(LocalCluster(6).run(_groups_created_once)):
        assert out["after_init"] == 3 + 2  # 3 dp lines + 2 pp lines, every rank creates every line
        assert out["after_queries"] == out["after_init"] and out["same"]
        assert out["flatten_groups"] == 1 and out["flat_cached"]
        assert out["flat"] == (("dp_pp",), (0, 1, 2, 3, 4, 5), r, (0, 1, 2, 3, 4, 5))


def _flatten_sub_mesh():
    p = get_platform()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    flat = mesh["dp", "tp"].flatten("dp_tp")
    via_name = mesh["dp_tp"]
    both = mesh["pp", "dp_tp"]
    total = p.all_reduce(p.from_numpy(np.array([p.rank], np.float32)), group=flat.get_group())
    errors = []
    for call in (lambda: mesh["pp", "dp"].flatten("tp"), lambda: mesh["pp", "tp"].flatten("dp_tp")):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return {
        "flat": (flat.ranks, flat.get_coordinate(), flat.get_group().ranks),
        "via_name": (via_name.ranks, via_name.get_group() is flat.get_group()),
        "both": (both.shape, both.mesh_dim_names, both.get_coordinate()),
        "sum": float(p.to_numpy(total)[0]),
        "errors": errors,
    }


def test_flatten_a_sub_mesh_and_find_it_by_name():
    for r, out in enumerate(LocalCluster(8).run(_flatten_sub_mesh)):
        pp, inner = divmod(r, 4)
        block = tuple(range(4 * pp, 4 * pp + 4))
        assert out["flat"] == (block, (inner,), block)
        assert out["via_name"] == (block, True)
        assert out["both"] == ((2, 4), ("pp", "dp_tp"), (pp, inner))
        assert out["sum"] == sum(block)
        assert "'tp' already names a dimension" in out["errors"][0]
        assert "'dp_tp' already names a flattened dimension" in out["errors"][1]


def _from_groups():
    p = get_platform()
    pairs = [p.new_group([0, 1]), p.new_group([2, 3])]
    cols = [p.new_group([0, 2]), p.new_group([1, 3])]
    row, col = divmod(p.rank, 2)
    line = DeviceMesh.from_group(pairs[row], mesh_dim_names=("x",))
    grid = DeviceMesh.from_group([cols[col], pairs[row]], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    nested = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    try:
        DeviceMesh.from_group([pairs[row], cols[col]], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return {
        "line": (line.ranks, line.get_group() is pairs[row], line.get_local_rank(), line.device_type),
        "grid": (grid.get_group("tp") is pairs[row], grid.get_group("dp") is cols[col], grid.get_coordinate()),
        "nested": (nested.shape, nested.ranks, nested == grid, hash(nested) == hash(grid), nested.line("dp")),
        "mismatch": mismatch,
    }


def test_meshes_from_existing_groups_and_nested_lists():
    for r, out in enumerate(LocalCluster(4).run(_from_groups)):
        row, col = divmod(r, 2)
        assert out["line"] == ((2 * row, 2 * row + 1), True, col, "cpu")
        assert out["grid"] == (True, True, (row, col))
        assert out["nested"] == ((2, 2), (0, 1, 2, 3), True, True, (col, col + 2))
        assert "mesh line through rank" in out["mismatch"]


def _outside_and_torch_only():
    mesh = DeviceMesh("cpu", [0, 1], (2,), ("x",))
    world = init_device_mesh("cpu", (4,))
    out = {"coord": mesh.get_coordinate(), "ascending": (world.lines_ascending(), mesh.lines_ascending())}
    reversed_mesh = DeviceMesh("cpu", [[3, 2], [1, 0]])
    out["reversed"] = (reversed_mesh.lines_ascending(), DeviceMesh("cpu", [[0, 2], [1, 3]]).lines_ascending())
    try:
        reversed_mesh.to_torch()
    except ValueError as exc:
        out["reversed_to_torch"] = str(exc)
    for name, call in (("group", mesh.get_group), ("torch_group", world.get_torch_group), ("to_torch", world.to_torch)):
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_ranks_outside_a_mesh_and_torch_only_calls_on_local_cluster():
    results = LocalCluster(4).run(_outside_and_torch_only)
    assert results[0]["coord"] == (0,) and results[0]["group"] is None
    assert results[2]["coord"] is None
    assert results[2]["group"] == "ValueError: mesh dim 'x': rank 2 is not part of mesh [0, 1]"
    for out in results:
        assert out["ascending"] == (True, True) and out["reversed"] == (False, True)
        assert "torch's DeviceMesh needs every line in increasing rank order" in out["reversed_to_torch"]
        assert out["torch_group"].startswith("TypeError: group [0, 1, 2, 3] has no torch.distributed ProcessGroup")
        assert out["to_torch"].startswith("TypeError: group [0, 1, 2, 3] has no torch.distributed ProcessGroup")
