"""Sections 1-3 of ``make bench``: schedule efficiency, runtime overhead per lowered step, exposed P2P.

All three run on 4 gloo processes, ours (``hyper_parallel``) and ``torch.distributed.pipelining``
alternating in one job, through the same ``step`` call (torch's contract, which ours implements).

* **efficiency**: stages whose compute is a fixed sleep: each rank's share of the model costs
  F = 10 ms forward and B = 20 ms backward, split I = W = 10 ms for the schedules with a dx/dW
  split (a chunk of a rank holding v chunks sleeps 1/v of that). Sleeping processes do not compete
  for the 2 cores, so the run shows the schedule and the runtime, not the machine. Efficiency =
  ideal makespan (the schedule simulated with the same costs and free communication) / measured.
* **overhead**: one ``Linear(16, 16)`` per stage, m = 64: the step is all runtime and P2P; time per
  lowered step = step time / the busiest rank's number of lowered steps in our lists (the same
  divisor for both, so the ratio is the step-time ratio).
* **p2p**: the 1F1B sleep workload with 4 MiB activations per micro-batch against 64-byte ones,
  ours with ``overlap_p2p=False`` and with it on (the default) and torch's; the makespan difference, minus the extra local
  compute of the bigger tensors (measured in the same job), is the P2P time that shows.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
from bench_common import LIBS, alternate, alternate_pairs, median

import hyper_parallel as hp
from hyper_parallel.platform.torch.sleep_stage import SleepStage
from hyper_parallel.platform.torch.sleep_stage import squared_error as mse

P = 4
F_MS, B_MS, I_MS, W_MS = 10.0, 20.0, 10.0, 10.0
SCHEDULES = {  # name -> (chunks per rank, dx/dW split, V placement)
    "ScheduleGPipe": (1, False, False),
    "Schedule1F1B": (1, False, False),
    "ScheduleInterleaved1F1B": (2, False, False),
    "ScheduleLoopedBFS": (2, False, False),
    "ScheduleInterleavedZeroBubble": (2, True, False),
    "ScheduleZBVZeroBubble": (2, True, True),
    "ScheduleDualPipeV": (2, True, True),
}


def stage_indices(name: str, rank: int, world: int) -> list[int]:
    v, _, v_shape = SCHEDULES.get(name, (1, False, False))
    if v_shape:
        return [rank, 2 * world - 1 - rank]
    return [c * world + rank for c in range(v)]


def build(lib: str, name: str, make_module: Any, m: int, rows: int, width: int, data: Any = None,
          loss_fn: Any = None, **options: Any) -> tuple[Any, Any]:
    """A schedule of library ``lib`` on this rank and a no-argument call that runs one step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    indices = stage_indices(name, rank, world)
    num_stages = world * len(indices)
    modules = [make_module(i) for i in indices]
    if lib == "ours":
        stages = [hp.PipelineStage(mod, i, num_stages) for mod, i in zip(modules, indices)]
        cls = getattr(hp, name)
    else:
        stages = [tpp.PipelineStage(mod, i, num_stages, torch.device("cpu")) for mod, i in zip(modules, indices)]
        cls = getattr(tpp, name)
        options = {}
    single = len(stages) == 1 and name in ("ScheduleGPipe", "Schedule1F1B")
    schedule = cls(stages[0] if single else stages, m, loss_fn=loss_fn or mse, **options)
    torch.manual_seed(0)
    x, y = data if data is not None else (torch.randn(m * rows, width), torch.randn(m * rows, width))
    first, last = 0 in indices, num_stages - 1 in indices

    params = [p for mod in modules for p in mod.parameters()]

    def step() -> None:
        for p in params:  # a training step starts without gradients (optimizer.zero_grad())
            p.grad = None
        args = (x,) if first else ()
        kwargs = dict(target=y, losses=[]) if last else {}
        schedule.step(*args, return_outputs=False, **kwargs)

    return schedule, step


def _sleep_module(num_chunks: int, width: int = 16, split: bool = False, scale: float = 1.0):
    unit = scale / 1e3 / num_chunks  # ms of a rank's share -> s of one of its chunks
    def make(_index: int) -> torch.nn.Module:
        if split:
            return SleepStage(F_MS * unit, I_MS * unit, W_MS * unit, width)
        return SleepStage(F_MS * unit, B_MS / 2 * unit, B_MS / 2 * unit, width)
    return make


def ideal_makespan_ms(name: str, m: int, scale: float = 1.0, latency_ms: float = 0.0,
                      sleep_extra_ms: float = 0.0) -> float:
    """The schedule simulated with the sleep costs: free communication by default; with this
    machine's one-way message latency and the time each ``time.sleep`` overshoots, the best any
    runtime can do here (a chunk's F sleeps once, its B twice, its I and W once each)."""
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule

    v = SCHEDULES[name][0]
    extra = sleep_extra_ms * v  # per_rank_share divides a rank's share over its v chunks
    costs = CostModel.per_rank_share(P, v, F=F_MS * scale + extra, B=B_MS * scale + 2 * extra,
                                     I=I_MS * scale + extra, W=W_MS * scale + extra, p2p_latency_ms=latency_ms)
    _, result = simulate_schedule(getattr(hp, name), P, v, m, costs, lowered=False)
    return float(result.makespan)


def machine_costs(trips: int = 21) -> dict[str, float]:
    """This machine's share of a sleep-cost makespan, measured in the job: the one-way latency of a
    small message between neighbours (ranks 0-1 and 2-3 ping-pong at once, as a pipeline's
    neighbours talk at once) and how much longer than asked a 5 ms ``time.sleep`` takes."""
    rank = dist.get_rank()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    buf = torch.zeros(16)
    one_way = []
    for _ in range(trips):
        dist.barrier()
        start = time.perf_counter()
        if rank % 2 == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        one_way.append((time.perf_counter() - start) / 2)
    overshoot = []
    for _ in range(trips):
        start = time.perf_counter()
        time.sleep(0.005)
        overshoot.append(time.perf_counter() - start - 0.005)
    return {"latency_s": median(one_way), "sleep_extra_s": median(overshoot)}


def _lowered_steps(schedule: Any) -> int:
    return max(sum(1 for s in steps if s is not None) for steps in schedule.exec_order.values())


# ---------------------------------------------------------------------------- jobs (one per rank)
def efficiency_job(m: int, rounds: int, schedules: list[str], scale: float = 1.0) -> dict:
    out: dict[str, Any] = {}
    for name in schedules:
        v, split, _ = SCHEDULES[name]
        steps = {lib: build(lib, name, _sleep_module(v, split=split, scale=scale), m, 1, 16)[1] for lib in LIBS}
        out[name] = alternate_pairs(steps, rounds, dist.barrier)
    out["machine"] = machine_costs()
    return out


def overhead_job(m: int, rounds: int, schedules: list[str]) -> dict:
    out: dict[str, Any] = {}

    def linear(index: int) -> torch.nn.Module:
        torch.manual_seed(index)
        return torch.nn.Linear(16, 16)

    for name in schedules:
        built = {lib: build(lib, name, linear, m, 1, 16) for lib in LIBS}
        out[name] = alternate_pairs({lib: b[1] for lib, b in built.items()}, rounds, dist.barrier)
        out[name]["lowered_steps"] = _lowered_steps(built["ours"][0])
    return out


def p2p_job(m: int, rounds: int, big_width: int, scale: float = 1.0) -> dict:
    name = "Schedule1F1B"
    steps = {}
    for label, width in (("small", 16), ("big", big_width)):
        make = _sleep_module(1, width, scale=scale)
        steps[f"ours|{label}"] = build("ours", name, make, m, 1, width, overlap_p2p=False)[1]
        steps[f"ours+overlap_p2p|{label}"] = build("ours", name, make, m, 1, width, overlap_p2p=True)[1]
        steps[f"torch|{label}"] = build("torch", name, make, m, 1, width)[1]
    out: dict[str, Any] = alternate_pairs(steps, rounds, dist.barrier)
    # The extra local compute of a 4 MiB micro-batch (forward + backward of the stage, no sleep).
    compute = {}
    for label, width in (("small", 16), ("big", big_width)):
        module = SleepStage(0.0, 0.0, 0.0, width)
        x = torch.randn(1, width, requires_grad=True)

        def once(module: torch.nn.Module = module, x: torch.Tensor = x) -> float:
            start = time.perf_counter()
            module(x).sum().backward()
            return time.perf_counter() - start
        compute[label] = once
    local = alternate(compute, 9)
    out["extra_compute_s"] = median(local["big"]) - median(local["small"])
    # One 4 MiB message between two neighbours (rank 0 -> 1 and back), median of a few.
    buf = torch.zeros(1, big_width)
    trips = []
    for _ in range(7):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append((time.perf_counter() - start) / 2)
    out["message_s"] = median(trips)
    return out


# ---------------------------------------------------------------------------- summaries (parent)
def summarize_efficiency(per_rank: list[dict], m: int, scale: float = 1.0) -> list[dict]:
    rows = []
    machine = [r.get("machine", {}) for r in per_rank]
    latency_ms = max((mc.get("latency_s", 0.0) for mc in machine), default=0.0) * 1e3
    sleep_extra_ms = median([mc.get("sleep_extra_s", 0.0) for mc in machine]) * 1e3
    for name in per_rank[0]:
        if name == "machine":
            continue
        ideal = ideal_makespan_ms(name, m, scale)
        bound = ideal_makespan_ms(name, m, scale, latency_ms, sleep_extra_ms)
        spans = {lib: _spans(per_rank, name, lib) for lib in LIBS}
        med = {lib: median(spans[lib]) * 1e3 for lib in LIBS}
        rows.append({"schedule": name, "chunks": SCHEDULES[name][0], "split": SCHEDULES[name][1],
                     "ideal_ms": ideal, "ours_ms": med["ours"], "torch_ms": med["torch"],
                     "ours_eff": ideal / med["ours"], "torch_eff": ideal / med["torch"],
                     "ours_over_torch": med["ours"] / med["torch"], "rounds": len(spans["ours"]),
                     "machine_bound_ms": bound, "latency_ms": latency_ms, "sleep_extra_ms": sleep_extra_ms,
                     "ours_eff_of_bound": bound / med["ours"], "torch_eff_of_bound": bound / med["torch"]})
    return rows


def _spans(per_rank: list[dict], key: str, sub: str) -> list[float]:
    n = len(per_rank[0][key][sub])
    return [max(r[key][sub][i][1] for r in per_rank) - min(r[key][sub][i][0] for r in per_rank) for i in range(n)]


def summarize_overhead(per_rank: list[dict], m: int) -> list[dict]:
    rows = []
    for name in per_rank[0]:
        steps = per_rank[0][name]["lowered_steps"]
        med = {lib: median(_spans(per_rank, name, lib)) for lib in LIBS}
        rows.append({"schedule": name, "m": m, "lowered_steps": steps, "ours_step_ms": med["ours"] * 1e3,
                     "torch_step_ms": med["torch"] * 1e3, "ours_us_per_step": med["ours"] / steps * 1e6,
                     "torch_us_per_step": med["torch"] / steps * 1e6, "ours_over_torch": med["ours"] / med["torch"]})
    return rows


def summarize_p2p(per_rank: list[dict], m: int, big_width: int) -> list[dict]:
    first = per_rank[0]
    extra = max(r["extra_compute_s"] for r in per_rank)
    message = first["message_s"]
    rows = []
    for variant in ("ours", "ours+overlap_p2p", "torch"):
        spans = {label: median([max(r[f"{variant}|{label}"][i][1] for r in per_rank)
                                - min(r[f"{variant}|{label}"][i][0] for r in per_rank)
                                for i in range(len(first[f"{variant}|{label}"]))]) for label in ("small", "big")}
        delta = spans["big"] - spans["small"]
        exposed = delta - (m + P - 1) * extra
        rows.append({"variant": variant, "activation_kib": big_width * 4 / 1024, "small_ms": spans["small"] * 1e3, "big_ms": spans["big"] * 1e3,
                     "delta_ms": delta * 1e3, "compute_on_path_ms": (m + P - 1) * extra * 1e3,
                     "exposed_ms": exposed * 1e3, "message_ms": message * 1e3,
                     "exposed_messages": exposed / message if message else float("nan")})
    return rows
