"""Section 7 of ``make bench``: where one step's time goes (cProfile of one rank).

4 gloo processes, 1F1B, one ``Linear(16, 16)`` per stage, m = 64 (the overhead workload: the
step is all pipeline machinery). Rank 1 (a middle stage: it receives and sends both ways) runs a
few steps of ours and of torch's under ``cProfile``; the functions' own time (tottime) is summed
into categories by where the function lives:

* *library Python*: ``hyper_parallel/`` (ours) or ``torch/distributed/pipelining/`` (torch's),
  metadata excluded;
* *metadata*: our ``meta.py`` / shape exchange, torch's ``_shape_inference`` and friends;
* *waits*: ``Work.wait`` (blocking on a peer: mostly the pipeline's own bubbles);
* *send/recv*: posting ``isend``/``irecv`` (``torch/distributed/distributed_c10d.py`` and the C calls);
* *compute*: ``torch/nn``, ``torch/autograd`` and torch's C functions;
* *other*: the rest (Python's own, torch's other Python).
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Any

import torch
import torch.distributed as dist
from bench_common import LIBS
from bench_schedules import build

PROFILED_RANK = 1
CATEGORIES = ("library Python", "metadata", "waits", "send/recv", "compute", "other")


def _category(lib: str, key: tuple[str, int, str]) -> str:
    path, _, func = key
    path = path.replace("\\", "/")
    if "wait" in func and ("Work" in func or path == "~"):
        return "waits"
    if "meta" in path.split("/")[-1] or "shape_inference" in func or "_get_recv_ops" in func and lib == "torch":
        return "metadata"
    if "hyper_parallel/" in path or "torch/distributed/pipelining/" in path:
        return "library Python"
    if "distributed_c10d" in path or func in ("isend", "irecv") or "_distributed_c10d" in func:
        return "send/recv"
    if "torch/nn/" in path or "torch/autograd/" in path or (path == "~" and "torch" in func):
        return "compute"
    return "other"


def profile_job(m: int, steps: int) -> dict:
    def linear(index: int) -> torch.nn.Module:
        torch.manual_seed(index)
        return torch.nn.Linear(16, 16)

    out: dict[str, Any] = {}
    for lib in LIBS:
        _, step = build(lib, "Schedule1F1B", linear, m, 1, 16)
        step()
        profiler = cProfile.Profile()
        for _ in range(steps):
            dist.barrier()
            if dist.get_rank() == PROFILED_RANK:
                profiler.enable()
            step()
            if dist.get_rank() == PROFILED_RANK:
                profiler.disable()
        if dist.get_rank() != PROFILED_RANK:
            continue
        stats = pstats.Stats(profiler)
        totals = dict.fromkeys(CATEGORIES, 0.0)
        funcs = []
        calls = 0
        for key, (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
            totals[_category(lib, key)] += tottime
            calls += ncalls
            funcs.append((tottime, ncalls, f"{key[0].split('site-packages/')[-1].split('/work/')[-1]}:{key[1]}({key[2]})"))
        funcs.sort(reverse=True)
        out[lib] = {"totals_ms": {k: v / steps * 1e3 for k, v in totals.items()},
                    "calls_per_step": calls / steps,
                    "top": [[t / steps * 1e3, n // steps, name] for t, n, name in funcs[:8]]}
    return out


def summarize(per_rank: list[dict]) -> dict:
    result = per_rank[PROFILED_RANK]
    rows = []
    for cat in CATEGORIES:
        row = {"category": cat}
        for lib in LIBS:
            total = sum(result[lib]["totals_ms"].values())
            row[f"{lib}_ms"] = result[lib]["totals_ms"][cat]
            row[f"{lib}_share"] = result[lib]["totals_ms"][cat] / total if total else 0.0
        rows.append(row)
    return {"rows": rows, "calls_per_step": {lib: result[lib]["calls_per_step"] for lib in LIBS},
            "top": {lib: result[lib]["top"] for lib in LIBS}}
