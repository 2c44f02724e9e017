"""MindSporePlatform collectives in a real 2-process ``msrun`` job on the CPU (MCCL)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_msrun

pytest.importorskip("mindspore")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "msrun_worker.py"
WORLD = 2
JOB_TIMEOUT_S = 180


def _rank_input(rank: int) -> np.ndarray:
    return np.array([rank + 1.0, 10.0 * (rank + 1), -float(rank), 0.5], np.float32)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("msrun")
    out_dir = root / "out"
    out_dir.mkdir()
    run_msrun(str(WORKER), WORLD, str(out_dir), cwd=root, timeout=JOB_TIMEOUT_S)
    files = [out_dir / f"rank_{r}.json" for r in range(WORLD)]
    assert all(f.exists() for f in files), list(out_dir.iterdir())
    return [json.loads(f.read_text()) for f in files]


pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def test_ranks_and_world(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert (res["platform"], res["rank"], res["world"]) == ("mindspore", r, WORLD)
        assert res["world_group"] == list(range(WORLD)) and res["new_group_world"] == list(range(WORLD))


def test_all_reduce(results: list[dict[str, Any]]) -> None:
    inputs = np.stack([_rank_input(r) for r in range(WORLD)])
    expected = {"sum": inputs.sum(0), "max": inputs.max(0), "min": inputs.min(0), "prod": inputs.prod(0),
                "avg": inputs.sum(0) / WORLD}
    for res in results:
        for op, want in expected.items():
            np.testing.assert_allclose(res[f"all_reduce_{op}"], want, rtol=1e-6, err_msg=op)
            assert res[f"all_reduce_{op}_in_place"], op
        assert res["all_reduce_sum_int64"] == [sum(r + 1 for r in range(WORLD)),
                                               sum(2**40 + r for r in range(WORLD))]
        assert res["all_reduce_max_bf16"] == [float(WORLD), 0.0]


def test_all_gather_and_broadcast(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["all_gather"] == [_rank_input(r).reshape(2, 2).tolist() for r in range(WORLD)]
        assert res["all_gather_bool"] == [[r == 0, True] for r in range(WORLD)]
        assert res["all_gather_int64"] == [[2**40 + r] for r in range(WORLD)]
        assert res["all_gather_float64"] == [[1 / 3 + r] for r in range(WORLD)]
        assert res["all_gather_float16"] == [[r + 0.5] for r in range(WORLD)]
        assert res["broadcast_from_1"] == _rank_input(1).tolist()
        assert res["broadcast_int64_from_0"] == [2**40, 0]
        assert res["broadcast_float64_from_1"] == [1 / 3 + 1]


def test_objects_and_barrier(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["broadcast_object"] == {"from": 1, "text": "x" * 2000}
        assert res["all_gather_object"] == [{"rank": r, "items": list(range(100 * r))} for r in range(WORLD)]
        assert res["barrier"] is True


def test_cpu_build_limits_raise_clear_errors(results: list[dict[str, Any]]) -> None:
    for res in results:
        for name, message in res["errors"].items():
            assert message is not None, f"{name} did not raise on the CPU build"
            assert "CPU build" in message and "LocalCluster" in message, (name, message)
        assert "point-to-point" in res["errors"]["isend"]
