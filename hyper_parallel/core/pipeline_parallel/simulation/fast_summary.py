"""`simulate.peak_activations` and `simulate.peak_activation_bytes` of every rank at once, from
the compiled step lists (``fast_job.py``), with numpy.

Both walk a rank's compute steps in order: a forward adds (1, or its stage's
``activation_bytes``), the peak is taken, then a backward subtracts (B: 1 or
``activation_bytes``; I: 0 or ``activation_bytes - activation_bytes_after_input``; W: 1 or
``activation_bytes_after_input``). Here each step gives two terms, ``+added`` and ``-freed``, and
``np.add.accumulate`` sums them one after the other from the left, as the loop does (``x - y``
is ``x + (-y)`` and adding 0.0 changes nothing), so every running value, and the largest of
those after an addition, is the same float. Counts are ints. OVERLAP steps, stages without
costs or non-finite bytes: None, and the caller counts with the loop.
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.core.pipeline_parallel.ir.steps import Schedule
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.simulation.fast_job import CompiledJob


def fast_peaks(schedule: Schedule, job: CompiledJob, costs: CostModel) -> tuple[dict, dict] | None:
    """(peak activations, peak activation bytes) per rank, in the schedule's rank order; or None."""
    code, stage, rank = job.arrays.get("code"), job.arrays.get("stage"), job.arrays.get("rank")
    if code is None or np.any(code > 3):
        return None
    stages = costs.stages
    if stage.size and int(stage.max()) >= len(stages):
        return None
    full = np.asarray([s.activation_bytes for s in stages], dtype=np.float64)
    after = np.asarray([s.activation_bytes_after_input for s in stages], dtype=np.float64)
    freed_by_input = np.asarray([s.activation_bytes - s.activation_bytes_after_input for s in stages],
                                dtype=np.float64)
    if not (np.all(np.isfinite(full)) and np.all(np.isfinite(after)) and np.all(np.isfinite(freed_by_input))):
        return None
    forward = code == 0
    count = np.where(forward, 1, np.where((code == 1) | (code == 3), -1, 0))
    terms = np.empty(2 * code.size, dtype=np.float64)
    terms[0::2] = np.where(forward, full[stage], 0.0)
    terms[1::2] = -np.where(code == 1, full[stage], np.where(code == 2, freed_by_input[stage],
                                                             np.where(code == 3, after[stage], 0.0)))
    bounds = np.searchsorted(rank, job.ranks + [job.ranks[-1] + 1] if job.ranks else [])
    peaks: dict = {}
    peak_bytes: dict = {}
    where = {r: k for k, r in enumerate(job.ranks)}
    for r in schedule:
        k = where[r]
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        if hi == lo:
            peaks[r], peak_bytes[r] = 0, 0.0
            continue
        live = np.cumsum(count[lo:hi])  # the count only rises at a forward: its largest value is the peak
        peaks[r] = max(0, int(live.max()))
        running = np.add.accumulate(terms[2 * lo:2 * hi])[0::2]  # after each step's addition
        top = float(running.max())
        peak_bytes[r] = top if top > 0.0 else 0.0
    return peaks, peak_bytes
