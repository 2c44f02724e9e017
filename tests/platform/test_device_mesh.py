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
