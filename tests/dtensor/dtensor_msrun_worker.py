"""One rank of the 2-process msrun job of test_dtensor_msrun.py (MindSpore's CPU build, MCCL).

On the CPU only the world group exists: a mesh is still built, a dimension without a group says
why when asked, a size-1 dimension needs none, and moves over the world fall back to the
collectives that exist (reduce-scatter -> all-reduce + slice, all-to-all -> all-gather + slice).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(out_dir: str) -> None:
    from dtensor_checks import check_errors, check_redistribute, mesh_1d

    from hyper_parallel.core.device_mesh import init_device_mesh
    from hyper_parallel.core.placement_types import Partial, Replicate, Shard
    from hyper_parallel.platform import get_platform

    p = get_platform()
    res: dict = {"rank": p.rank, "platform": p.name}
    line = mesh_1d(2)
    S0, S1, R = Shard(0), Shard(1), Replicate()
    pairs = [((S0,), (R,)), ((Partial(),), (R,)), ((Partial(),), (S1,)), ((S0,), (S1,)), ((R,), (S1,)),
             ((Partial("max"),), (S0,))]
    res["failures"] = check_redistribute(line, pairs) + check_errors(init_device_mesh("cpu", (2, 1),
                                                                                      mesh_dim_names=("dp", "tp")))
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    try:
        grid.get_group("pp")
        res["pp_group"] = None
    except RuntimeError as exc:
        res["pp_group"] = str(exc)
    res["dp_group"] = list(grid.get_group("dp").ranks)
    res["failures"] += check_redistribute(grid, [((R, S0), (R, R)), ((S0, S1), (R, S0))])
    with open(os.path.join(out_dir, f"rank_{p.rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
