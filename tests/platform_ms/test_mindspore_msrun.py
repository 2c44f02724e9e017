"""MindSporePlatform collectives in a real 2-process ``msrun`` job on the CPU (MCCL)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mindspore")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "msrun_worker.py"
WORLD = 2
JOB_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _msrun() -> str | None:
    local = Path(sys.executable).with_name("msrun")
    return str(local) if local.exists() else shutil.which("msrun")


def _logs(log_dir: Path) -> str:
    parts = [f"--- {p.name} ---\n{p.read_text(errors='replace')[-6000:]}" for p in sorted(log_dir.glob("*.log"))]
    return "\n".join(parts) or "(no worker logs)"


def _rank_input(rank: int) -> np.ndarray:
    return np.array([rank + 1.0, 10.0 * (rank + 1), -float(rank), 0.5], np.float32)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    msrun = _msrun()
    if msrun is None:
        pytest.skip("msrun is not installed")
    root = tmp_path_factory.mktemp("msrun")
    out_dir, log_dir, cwd = root / "out", root / "logs", root / "cwd"
    for d in (out_dir, cwd):
        d.mkdir()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # msrun runs `python`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["HYPER_PARALLEL_PLATFORM"] = "mindspore"
    cmd = [msrun, f"--worker_num={WORLD}", f"--local_worker_num={WORLD}", f"--master_port={_free_port()}",
           f"--log_dir={log_dir}", "--join=True", str(WORKER), str(out_dir)]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"msrun job timed out after {JOB_TIMEOUT_S} s\n{_logs(log_dir)}\n{exc.stdout}\n{exc.stderr}")
    files = [out_dir / f"rank_{r}.json" for r in range(WORLD)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"msrun job failed (rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n"
                    f"{_logs(log_dir)}")
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
