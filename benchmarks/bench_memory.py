"""Section 4 of ``make bench``: peak live activations per rank, ours vs theory vs torch's.

Counted, not read from an allocator, the same way for both libraries: every stage module runs its
forward inside ``saved_tensors_hooks`` that hand the graph a small holder per saved tensor
(parameters excluded) and remember it weakly, so it counts exactly while a graph keeps it, and remembers its output. After every stage forward the live
ones are summed by distinct storage: *saved* = saved tensors still held by an autograd graph,
*outputs* = stage outputs still holding data (not yet released by the runtime). Units: one
stage micro-batch of saved activations (the stage ``sin(x * scale)`` saves ``x`` and
``x * scale``) and one micro-batch of output.

Theory: 1F1B keeps p - r micro-batches in flight on rank r; for interleaved 1F1B (v=2) it is the
peak the simulator gives for our schedule (stage micro-batches held from F to B).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from bench_schedules import build

P = 4
ROWS, WIDTH = 4, 256
SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B")


class _Held:
    """What a saved-tensor hook hands the graph: kept by the graph alone."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Tracker:
    def __init__(self) -> None:
        self.saved: weakref.WeakSet = weakref.WeakSet()
        self.outputs: weakref.WeakSet = weakref.WeakSet()
        self.peak_saved = self.peak_outputs = self.peak_total = 0

    def reset(self) -> None:
        self.__init__()

    @staticmethod
    def _live(tensors: Any) -> dict[tuple[int, int], int]:
        """(address, size) -> bytes of the tensors still holding data (a view counts its own bytes)."""
        return {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in list(tensors)
                if t.untyped_storage().nbytes()}

    def sample(self) -> None:
        saved, outs = self._live(h.t for h in list(self.saved)), self._live(self.outputs)
        self.peak_saved = max(self.peak_saved, sum(saved.values()))
        self.peak_outputs = max(self.peak_outputs, sum(outs.values()))
        self.peak_total = max(self.peak_total, sum({**saved, **outs}.values()))


TRACKER = _Tracker()


class MemStage(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.scale = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, torch.nn.Parameter):
                return t
            held = _Held(t)  # only the graph refers to it: it dies when the graph lets go
            TRACKER.saved.add(held)
            return held

        def unpack(held: Any) -> torch.Tensor:
            return held.t if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = torch.sin(x * self.scale)
        TRACKER.outputs.add(out)
        TRACKER.sample()
        return out


def theory(name: str, m: int) -> list[float]:
    if name == "Schedule1F1B":
        return [float(min(m, P - r)) for r in range(P)]
    import hyper_parallel as hp
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule

    _, result = simulate_schedule(getattr(hp, name), P, 2, m, lowered=False)
    return [float(result.peak_activations[r]) for r in range(P)]


def memory_job(m: int) -> dict:
    unit_saved = 2 * ROWS * WIDTH * 4
    unit_out = ROWS * WIDTH * 4
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        for lib in ("ours", "torch"):
            _, step = build(lib, name, MemStage, m, ROWS, WIDTH)
            step()  # first step: shapes exchanged, buffers made
            dist.barrier()
            TRACKER.reset()
            step()
            dist.barrier()
            out[f"{name}|{lib}"] = {"saved": TRACKER.peak_saved / unit_saved,
                                    "outputs": TRACKER.peak_outputs / unit_out,
                                    "total_bytes": TRACKER.peak_total}
    return out


def summarize(per_rank: list[dict], m: int) -> list[dict]:
    rows = []
    for name in SCHEDULES:
        expected = theory(name, m)
        for rank, result in enumerate(per_rank):
            ours, theirs = result[f"{name}|ours"], result[f"{name}|torch"]
            rows.append({"schedule": name, "rank": rank, "theory": expected[rank],
                         "ours_saved": ours["saved"], "torch_saved": theirs["saved"],
                         "ours_outputs": ours["outputs"], "torch_outputs": theirs["outputs"],
                         "ours_total_kib": ours["total_bytes"] / 1024, "torch_total_kib": theirs["total_bytes"] / 1024,
                         "ours_eq_theory": abs(ours["saved"] - expected[rank]) < 1e-9,
                         "ours_le_torch": ours["total_bytes"] <= theirs["total_bytes"]})
    return rows
