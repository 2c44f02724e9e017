"""``hyper-parallel calibrate``: measure this machine's link and the runtime's own costs per step.

`calibrate` starts ``nproc`` processes of this machine (torch's launcher; gloo on CPU, NCCL on
CUDA, HCCL on Ascend) and in each runs `worker`:

1. neighbours (ranks 0-1, 2-3, ...) ping-pong a 64-byte and a 4 MiB message through the
   platform (``CALIBRATION["trips"]`` trips after a barrier each, medians): one-way latency and
   bandwidth;
2. the library's runtime trains a pipeline of sleep-cost stages (``sleep_pipeline.py``) with
   step tracing on: 1F1B and ZB-H1 (one chunk per rank, dx/dW split) with the plain transport,
   1F1B with the batched one; and 1F1B again untraced, timed from the first rank's start to the
   last rank's end (the four in turns, so that a busy phase of the machine hits them alike).

Its workload is its own (``CALIBRATION``: a forward of 4 ms, a backward of 6 ms, ``2 n + 1``
micro-batches), never a case the simulator is judged on. The parent turns the records into a
machine file (``core/pipeline_parallel/tools/calibrate.py``).
"""

from __future__ import annotations

import os
import platform as host
import statistics
import time
from dataclasses import replace
from typing import Any

BACKENDS = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
CALIBRATION: dict[str, Any] = {
    "fwd_ms": 4.0, "bwd_ms": 6.0, "warmup": 2, "rounds": 7, "trips": 40, "big_elements": 1 << 20,
    "workloads": [("1f1b", 1, "plain"), ("interleaved-zb", 1, "plain"), ("1f1b", 1, "batch")],
}


def check_backend(backend: str, nproc: int = 1) -> str:
    """The device type of a backend; ValueError when unknown, or when this machine lacks a device
    for each of the ``nproc`` processes (one device per process, as NCCL and HCCL need)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    device = BACKENDS[backend]
    if device == "cpu":
        return device
    import importlib.util

    if device == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise ValueError("backend hccl needs torch_npu (Ascend), which is not installed")
    from hyper_parallel.platform.torch.launch import device_count

    have = device_count(device)
    if have == 0:
        raise ValueError(f"backend {backend} needs {device.upper()} devices, and torch sees none")
    if have < nproc:
        raise ValueError(f"backend {backend} needs one {device.upper()} device per process: {nproc} processes, "
                         f"{have} device(s)")
    return device


def _ping_pong(p: Any, size: int, trips: int, paired: bool) -> float:
    """Median one-way time (ms) of a message of ``size`` float32 between this rank and its
    neighbour (a rank without one only joins the barriers and returns 0)."""
    rank = p.rank
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    out, back = p.zeros((size,), "float32"), p.zeros((size,), "float32")
    one_way = []
    for _ in range(trips):
        p.barrier()
        if not paired:
            continue
        start = time.perf_counter()
        recv = p.irecv(back, peer)
        if rank % 2 == 0:
            send = p.isend(out, peer)
            recv.wait()
        else:
            recv.wait()
            send = p.isend(out, peer)
        send.wait()
        one_way.append((time.perf_counter() - start) / 2 * 1e3)
    return float(statistics.median(one_way)) if one_way else 0.0


def worker(settings: dict[str, Any]) -> dict[str, Any]:
    """One rank of the calibration job (see the module docstring); JSON-able results."""
    from hyper_parallel.measure import sleep_pipeline
    from hyper_parallel.platform import get_platform, set_platform
    from hyper_parallel.platform.torch.launch import select_local_device
    from hyper_parallel.platform.torch.platform import TorchPlatform

    select_local_device(settings["device"])  # one device per rank (NCCL / HCCL), as torchrun jobs do
    set_platform(TorchPlatform(device_type=settings["device"]))
    p = get_platform()
    out: dict[str, Any] = {"rank": p.rank}
    p.barrier()
    paired = p.rank + 1 < p.world_size or p.rank % 2 == 1
    trips = settings["trips"]
    small = _ping_pong(p, 16, trips, paired)
    big = _ping_pong(p, settings["big_elements"], max(5, trips // 4), paired)
    if paired:
        out["link"] = {"small_ms": small, "big_ms": big, "big_bytes": 4 * settings["big_elements"]}
    p.barrier()
    m = 2 * p.world_size + 1
    fwd, bwd = settings["fwd_ms"], settings["bwd_ms"]
    steps, afters = [], []
    for name, chunks, transport in settings["workloads"]:
        sched, step = sleep_pipeline.build(name, chunks, m, fwd, bwd, transport=transport, trace=True)
        steps.append(step)
        afters.append(lambda sched=sched: sched.tracer.records())
    name, chunks, transport = settings["workloads"][0]
    steps.append(sleep_pipeline.build(name, chunks, m, fwd, bwd, transport=transport)[1])  # untraced, timed
    afters.append(None)
    rounds = sleep_pipeline.alternating_steps(steps, settings["rounds"], settings["warmup"], afters)
    out["traced"] = [{"schedule": w[0], "transport": w[2], "runs": [r[2] for r in rounds[k]]}
                     for k, w in enumerate(settings["workloads"])]
    out["untimed"] = [(a, b) for a, b, _ in rounds[-1]]
    out["threads"] = os.environ.get("OMP_NUM_THREADS")
    return out


def calibrate(nproc: int, backend: str = "gloo") -> dict[str, Any]:
    """Run the calibration job and return the machine file's JSON (see the module docstring)."""
    from hyper_parallel.core.pipeline_parallel.tools.calibrate import Samples, collect, link, predict_ms, runtime_costs, \
        sleep_costs, sleep_of
    from hyper_parallel.core.pipeline_parallel.tools.catalog import resolve_schedule
    from hyper_parallel.core.pipeline_parallel.simulation.machine import Machine
    from hyper_parallel.platform.torch.launch import launch_local

    device = check_backend(backend, nproc)
    settings = dict(CALIBRATION, device=device)
    results = launch_local(worker, nproc, settings)
    ping_pong, bandwidth = link([r["link"] for r in results if "link" in r])
    samples = Samples()
    fwd, bwd = settings["fwd_ms"], settings["bwd_ms"]
    for k, _workload in enumerate(settings["workloads"]):
        for run in range(len(results[0]["traced"][k]["runs"])):
            records = [rec for r in results for rec in r["traced"][k]["runs"][run]]
            collect(records, sleep_of(fwd, bwd), samples)
    latency = samples.mean("latency_ms")
    latency = ping_pong if latency is None else max(0.0, latency)
    machine = Machine(runtime_costs(samples, latency_ms=latency), latency, bandwidth)
    name, chunks, transport = settings["workloads"][0]
    m = 2 * nproc + 1
    spans = [(max(r["untimed"][k][1] for r in results) - min(r["untimed"][k][0] for r in results)) * 1e3
             for k in range(len(results[0]["untimed"]))]
    predicted = predict_ms(resolve_schedule(name)[1], nproc, chunks, m, sleep_costs(nproc, chunks, fwd, bwd, machine),
                           transport)
    run_ms = statistics.median(spans) - predicted
    info = {
        "backend": backend, "nproc": nproc, "host": host.node(), "python": host.python_version(),
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {"schedules": [f"{n} v={c} {t}" for n, c, t in settings["workloads"]], "micro_batches": m,
                     "fwd_ms": fwd, "bwd_ms": bwd, "rounds": settings["rounds"], "warmup": settings["warmup"]},
        "samples": {name: samples.count(name) for name in sorted(samples.values)},
        "ping_pong_one_way_ms": ping_pong, "untraced_makespan_ms": statistics.median(spans), "predicted_without_run_ms": predicted,
    }
    machine = Machine(replace(machine.runtime, run_ms=max(0.0, run_ms)), latency, bandwidth, info)
    return machine.to_json()
