"""A torch job started with plain ``python`` (no launcher) is told how to launch, not torch's bare KeyError."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

SCRIPT = """
from hyper_parallel import get_platform
p = get_platform()
print("rank", p.rank, "of", p.world_size)
"""


def _clean_env() -> dict[str, str]:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MS_ROLE", "OMPI_COMM_WORLD_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    env.update(PYTHONPATH=REPO_ROOT, HYPER_PARALLEL_PLATFORM="torch")
    return env


@pytest.mark.timeout(180)
def test_plain_python_process_is_told_how_to_launch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=150,
                          env=_clean_env())
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr
    assert "RuntimeError: torch.distributed is not initialised and RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT " \
           "are not set" in err, err[-3000:]
    assert "torchrun --nproc-per-node=N script.py" in err
    assert "msrun --worker_num=N" in err
    assert "hyper_parallel.platform.local.LocalCluster(N)" in err
    assert "environment variable RANK expected" not in err


@pytest.mark.timeout(180)
def test_a_partial_launcher_environment_names_what_is_missing():
    env = dict(_clean_env(), RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode != 0, proc.stdout
    assert "torch.distributed is not initialised and MASTER_PORT is not set" in proc.stderr, proc.stderr[-3000:]
