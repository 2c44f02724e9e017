"""Accumulating gradients over several runs keeps no second gradient buffer: the peak memory
growth over 4 runs of a 64 MiB parameter is native autograd accumulation's (+10%). Each case runs
in a fresh process, since a process's peak memory only grows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def _growth(mode: str) -> int:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", HYPER_PARALLEL_PLATFORM="torch")
    out = subprocess.run([sys.executable, os.path.join(HERE, "grad_memory_worker.py"), mode], capture_output=True,
                         text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_accumulation_over_runs_costs_what_native_accumulation_costs():
    native = _growth("native")
    ours = _growth("ours")  # keep_grads_on_error=False: nothing copied
    keep = _growth("ours-keep")  # the default: one host copy of the gradient that existed before each run
    assert native >= 100 * MIB, native  # the gradient and the transient per-backward one were both counted
    assert ours <= 1.10 * native, (ours / MIB, native / MIB)
    assert keep <= 1.10 * native + 64 * MIB, (keep / MIB, native / MIB)
