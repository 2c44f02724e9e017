"""Shared test helpers: free ports, framework-neutral model builders."""

from __future__ import annotations

import os
import socket
import sys

from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def free_port() -> int:
    """A TCP port nobody listens on right now (each launcher job gets its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    # MindSpore writes rank_*/ dump folders into the working directory on compile failures.
    monkeypatch.chdir(tmp_path)
    yield


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 240) -> str:
    """Run ``script`` on ``nproc`` gloo ranks with torch's own launcher; fail with the logs, else return
    them (stdout, then stderr).

    The job gets a free port; if another process grabbed that port before the launcher bound
    it (a race no test can exclude), the job is started once more on a new port.
    """
    import subprocess

    env = dict(os.environ, PYTHONPATH=REPO_ROOT, HYPER_PARALLEL_PLATFORM="torch", OMP_NUM_THREADS="1")
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, *args,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"torchrun job {script} hung for {timeout}s:\n{exc.stdout}\n{exc.stderr}") from exc
        if proc.returncode == 0:
            return proc.stdout + proc.stderr
        port_taken = "address already in use" in (proc.stdout + proc.stderr).lower()
        if not port_taken or attempt == 1:
            raise AssertionError(
                f"torchrun job {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )


def load_rank_results(out_dir: str | os.PathLike[str], nproc: int) -> list[Any]:
    """What each of ``nproc`` worker ranks pickled to ``out_dir/rank<r>.pkl``, in rank order."""
    import pickle
    from pathlib import Path

    return [pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes()) for r in range(nproc)]


def run_msrun(script: str, world: int, *args: str, cwd: str | os.PathLike[str], timeout: float = 180) -> None:
    """Run ``script`` on ``world`` MindSpore workers with MindSpore's launcher (``msrun``) on a free
    port, in ``cwd`` (its logs go to ``cwd/msrun_logs``); skip when msrun is not installed, fail
    with the worker logs when the job fails or hangs."""
    import shutil
    import subprocess
    from pathlib import Path

    local = Path(sys.executable).with_name("msrun")
    msrun = str(local) if local.exists() else shutil.which("msrun")
    if msrun is None:
        pytest.skip("msrun is not installed")
    log_dir = Path(cwd) / "msrun_logs"
    env = dict(os.environ, HYPER_PARALLEL_PLATFORM="mindspore")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # msrun runs `python`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = [msrun, f"--worker_num={world}", f"--local_worker_num={world}", f"--master_port={free_port()}",
           f"--log_dir={log_dir}", "--join=True", script, *args]

    def logs() -> str:
        parts = [f"--- {p.name} ---\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(log_dir.glob("*.log"))]
        return "\n".join(parts) or "(no worker logs)"

    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"msrun job {script} timed out after {timeout} s\n{exc.stdout}\n{exc.stderr}\n{logs()}")
    if proc.returncode != 0:
        pytest.fail(f"msrun job {script} failed (rc={proc.returncode})\n{proc.stdout[-2000:]}\n"
                    f"{proc.stderr[-2000:]}\n{logs()}")
