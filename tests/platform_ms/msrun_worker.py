"""One rank of the msrun job of test_mindspore_msrun.py.

Usage (under msrun): ``msrun_worker.py OUT_DIR``. Exercises the collectives of the platform that
``get_platform()`` chooses (HYPER_PARALLEL_PLATFORM=mindspore) and writes ``OUT_DIR/rank_<r>.json``.
Inputs depend on the rank as in ``rank_input``; the test computes the expected values itself.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np


def rank_input(rank: int) -> list[float]:
    return [rank + 1.0, 10.0 * (rank + 1), -float(rank), 0.5]


def run(out_dir: Path) -> None:
    from hyper_parallel.platform import get_platform

    plat = get_platform()
    r = plat.rank
    res: dict[str, Any] = {"platform": plat.name, "rank": r, "world": plat.world_size,
                           "world_group": list(plat.world_group.ranks)}

    def values(t: Any) -> list[Any]:
        return plat.to_numpy(t).tolist()

    base = np.array(rank_input(r), np.float32)
    for op in ("sum", "max", "min", "prod", "avg"):
        t = plat.from_numpy(base.copy())
        out = plat.all_reduce(t, op)
        res[f"all_reduce_{op}"] = values(out)
        res[f"all_reduce_{op}_in_place"] = values(t) == values(out)
    res["all_reduce_sum_int64"] = values(plat.all_reduce(plat.tensor([r + 1, 2**40 + r], "int64"), "sum"))
    res["all_reduce_max_bf16"] = values(plat.all_reduce(plat.tensor([r + 1.0, -r], "bfloat16"), "max"))
    res["all_gather"] = [values(t) for t in plat.all_gather(plat.from_numpy(base.reshape(2, 2)))]
    res["all_gather_bool"] = [values(t) for t in plat.all_gather(plat.tensor([r == 0, True], "bool"))]
    res["all_gather_int64"] = [values(t) for t in plat.all_gather(plat.tensor([2**40 + r], "int64"))]
    res["all_gather_float64"] = [values(t) for t in plat.all_gather(plat.tensor(np.array([1 / 3 + r])))]
    res["all_gather_float16"] = [values(t) for t in plat.all_gather(plat.tensor([r + 0.5], "float16"))]
    bt = plat.from_numpy(base.copy())
    plat.broadcast(bt, 1)
    res["broadcast_from_1"] = values(bt)
    res["broadcast_int64_from_0"] = values(plat.broadcast(plat.tensor([2**40 + r, -r], "int64"), 0))
    res["broadcast_float64_from_1"] = values(plat.broadcast(plat.tensor(np.array([1 / 3 + r]), "float64"), 1))
    res["broadcast_object"] = plat.broadcast_object({"from": r, "text": "x" * (1000 * (r + 1))}, 1)
    res["all_gather_object"] = plat.all_gather_object({"rank": r, "items": list(range(100 * r))})
    plat.barrier()
    res["barrier"] = True
    errors = {}
    for name, call in {
        "isend": lambda: plat.isend(bt, 1 - r),
        "irecv": lambda: plat.irecv(bt, 1 - r),
        "reduce_scatter": lambda: plat.reduce_scatter([bt, bt]),
        "new_group": lambda: plat.new_group([0]),
        "send_object": lambda: plat.send_object({"a": 1}, 1 - r),
    }.items():
        try:
            call()
            errors[name] = None
        except RuntimeError as exc:
            errors[name] = str(exc)
    res["errors"] = errors
    res["new_group_world"] = list(plat.new_group([1, 0]).ranks)
    (out_dir / f"rank_{r}.json").write_text(json.dumps(res))


def main() -> None:
    out_dir = Path(sys.argv[1])
    try:
        run(out_dir)
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
