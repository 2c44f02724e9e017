"""Shared pieces of ``make bench``: launching gloo jobs, timing ours and torch's alternately, medians.

A *job* is one function of a bench module run on ``n`` gloo processes started directly (the
variables ``torch.distributed.run`` would set: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), on a free port, with a timeout; each rank returns a JSON-able value and
`run_job` gives them back in rank order. Inside a job, `alternate` runs the variants of a
comparison (ours, torch's, ...) in turns, swapping who goes first every round, so a slow phase
of the shared machine hits all of them alike; results are medians of the rounds and ratios of
medians, never a lone absolute time.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBS = ("ours", "torch")


class JobError(RuntimeError):
    """A benchmark job failed or hung; the message carries the ranks' log tails."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(module: str, func: str, nprocs: int, kwargs: dict[str, Any] | None = None,
            timeout: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``module.func(**kwargs)`` on ``nprocs`` gloo processes; the per-rank results in rank order.

    A port taken between choosing and binding it is retried once on a new port."""
    for attempt in range(2):
        try:
            return _run_once(module, func, nprocs, kwargs or {}, timeout, env or {})
        except JobError as exc:
            if attempt == 1 or "address already in use" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


def _run_once(module: str, func: str, nprocs: int, kwargs: dict[str, Any], timeout: float,
              extra_env: dict[str, str]) -> list[Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hp_bench_") as tmp:
        procs, logs = [], []
        for rank in range(nprocs):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       HYPER_PARALLEL_PLATFORM="torch", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
            env.update(extra_env)
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            out = os.path.join(tmp, f"rank{rank}.json")
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", module, func,
                                           json.dumps(kwargs), out], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=ROOT))
        deadline = time.monotonic() + timeout
        failed = None
        try:
            for rank, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed = f"job {module}.{func} hung for {timeout:.0f} s (rank {rank} still running)"
                    break
                if code != 0:
                    failed = f"job {module}.{func}: rank {rank} exited with {code}"
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {rank} ---\n{log.read()[-3000:]}")
            log.close()
        if failed:
            raise JobError(failed + "\n" + "\n".join(tails))
        results = []
        for rank in range(nprocs):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _worker(module: str, func: str, kwargs_json: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = getattr(importlib.import_module(module), func)(**json.loads(kwargs_json))
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- timing helpers
def alternate(variants: dict[str, Callable[[], float]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call every variant once per round (after ``warmup`` untimed rounds), the order rotating each
    round; each call returns its own measured time. The times per variant, in round order."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            value = variants[name]()
            if r >= warmup:
                times[name].append(value)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def timed_pair(fn: Callable[[], Any], barrier: Callable[[], None]) -> list[float]:
    """Barrier, then ``fn`` timed on this rank: ``[start, end]`` in ``perf_counter`` seconds."""
    barrier()
    start = time.perf_counter()
    fn()
    return [start, time.perf_counter()]


def alternate_pairs(variants: dict[str, Callable[[], Any]], rounds: int, barrier: Callable[[], None],
                    warmup: int = 1) -> dict[str, list[list[float]]]:
    """`alternate` for a multi-process job: every call is fenced by a barrier and timed as a
    ``[start, end]`` pair on this rank (combine the ranks with `span_per_round`). All ranks must
    call it with the same variants and rounds."""
    names = list(variants)
    pairs: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            pair = timed_pair(variants[name], barrier)
            if r >= warmup:
                pairs[name].append(pair)
    barrier()
    return pairs


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.path[:0] = [ROOT, HERE]
        _worker(*sys.argv[2:])
    else:
        sys.exit("usage: bench_common.py --worker MODULE FUNC KWARGS_JSON OUT (started by run_job)")


def write_result(path: str, lines: Sequence[str]) -> str:
    """Write a table of an on-demand benchmark (``benchmarks/results/*.md``), print it and return it."""
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
    print(text)
    return text
