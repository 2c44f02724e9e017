"""From what `hyper-parallel calibrate` measured to a machine file (no framework, no tensor).

The calibration job (``hyper_parallel/measure/calibration_job.py``) runs, on ``n`` real processes, a
ping-pong between neighbouring ranks and the library's own runtime on sleep-cost stages with
step tracing on: a forward sleeps ``F`` and a backward ``B`` (``I = W = B / 2``), values and
micro-batch count of its own. This module turns that into `runtime_costs.RuntimeCosts`:

- every record's cost is counted from the end of the rank's previous record (so the
  runtime's book-keeping between two steps belongs to the next step), as the timed model does;
- ``send_ms``, ``recv_ms``, ``meta_ms`` (``SEND_META``), ``batch_ms``: the costs of
  those posts (``batch_ms`` from a run with ``p2p_transport="batch"``);
- ``meta_recv_ms``: from a ``RECV_META``'s start, or its message's post plus the latency when
  later, to the end of the data receive posted behind it, minus ``recv_ms``;
- ``compute_ms[k]``: a compute step of kind k minus its sleep, when its input was local, or
  received long before (then its nested wait is taken out and is a ``wait_ms`` sample);
- the one-way latency of the link (``p2p.latency_ms``): the time from the start of a send's
  post to the end of the receiver's wait on it, over the waits that began before that post (the
  runtime's own hand-over; the neighbours' ping-pong is kept in the ``machine`` notes);
- ``received_ms[k]``: such a compute step after its wait returned, minus its sleep;
- ``run_ms``: the median measured makespan of untraced runs of the first workload minus its
  prediction with every other figure (never below 0).

Each figure is a trimmed mean (``TRIM``): a makespan adds step costs up, so the mean is what
counts, while the trim keeps single stalls of a busy machine out. Kinds the workload has
no sample of take the figures of the kinds it has.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.simulation.machine import Machine
from hyper_parallel.core.pipeline_parallel.lowering.p2p import counterpart
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import (
    KIND_OF,
    KINDS,
    RUNTIME_LOWERING,
    PerKind,
    RuntimeCosts,
)

_T = MetaStepType
TRIM = 0.05
"""Share of the samples left out at each end before averaging."""
READY_MARGIN_MS = 0.5
"""A wait counts as "data already there" when its message was posted this long before it began."""


class Samples:
    """Per-step cost samples (ms) gathered from traced runs."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}
        self.meta_receives: list[tuple[float, float, float]] = []
        """(RECV_META start, its SEND_META's post start, end of the data receive behind it), ms."""

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def mean(self, name: str) -> float | None:
        """The mean of the middle ``1 - 2 * TRIM`` of the samples: a makespan adds step costs up,
        so their mean is what counts, without the rare stalls that a median of runs drops anyway."""
        found = sorted(self.values.get(name, ()))
        if not found:
            return None
        cut = int(len(found) * TRIM)
        kept = found[cut:len(found) - cut] or found
        return float(statistics.fmean(kept))

    def count(self, name: str) -> int:
        return len(self.values.get(name, ()))


def collect(records: Sequence[dict[str, Any]], nominal_ms: Callable[[MetaStep], float], samples: Samples) -> None:
    """Add the samples of one traced run (all ranks' records, seconds from one origin);
    ``nominal_ms(step)``: the sleep of a compute step."""
    sent: dict[str, float] = {}
    for rec in records:
        if rec["kind"] == "p2p-issue" and rec["step"].startswith(("SEND_F", "SEND_B", "SEND_META")):
            sent[rec["step"]] = rec["start"] * 1e3
    for rank in sorted({r["rank"] for r in records}):
        mine = sorted((r for r in records if r["rank"] == rank), key=lambda r: r["end"])
        prev: float | None = None
        meta_from: tuple[float, float] | None = None  # a RECV_META's start, its message's post
        waits: list[dict[str, Any]] = []
        for rec in mine:
            if rec["kind"] == "p2p-wait":
                waits.append(rec)
                continue
            end = rec["end"] * 1e3
            if rec["step"].startswith("RECV_META"):  # often a rank's first step: from its own start then
                meta = MetaStep.from_str(rec["step"])
                posted = sent.get(f"SEND_META.s{meta.stage_index - 1}.m{meta.micro_index}")
                begin = prev if prev is not None else rec["start"] * 1e3
                meta_from = (begin, posted) if posted is not None else None
            elif meta_from is not None and rec["step"].startswith(("RECV_F", "RECV_B")):
                samples.meta_receives.append((*meta_from, end))  # to the end of the data receive behind it
                meta_from = None
            elif prev is not None:
                _sample(rec, end - prev, waits, sent, nominal_ms, samples)
            prev, waits = end, []


def _sample(rec: dict[str, Any], cost: float, waits: list[dict[str, Any]], sent: dict[str, float],
            nominal_ms: Callable[[MetaStep], float], samples: Samples) -> None:
    text = rec["step"]
    if rec["kind"] == "p2p-issue":
        if text.startswith("BATCH"):
            samples.add("batch_ms", cost)
        elif text.startswith("SEND_META"):
            samples.add("meta_ms", cost)
        elif text.startswith(("SEND_F", "SEND_B")):
            samples.add("send_ms", cost)
        elif text.startswith(("RECV_F", "RECV_B")):
            samples.add("recv_ms", cost)
        return  # RECV_META waits for its data inside: no sample
    step = MetaStep.from_str(text)
    kind = KIND_OF.get(step.meta_type)
    if kind is None or len(step.parts) != 1:
        return
    sleep = nominal_ms(step)
    if not waits:
        samples.add(f"compute_ms.{kind}", cost - sleep)
        return
    if len(waits) != 1:
        return
    wait = waits[0]
    recv = MetaStep.from_str(wait["step"])
    if recv.meta_type not in (_T.FWD_RECV, _T.BWD_RECV):
        return
    posted = sent.get(str(counterpart(recv)))
    if posted is None:
        return
    begin, finish = wait["start"] * 1e3, wait["end"] * 1e3
    if posted + READY_MARGIN_MS < begin:  # the data was there: a wait that returns at once
        samples.add("wait_ms", finish - begin)
        samples.add(f"compute_ms.{kind}", cost - sleep - (finish - begin))
    elif posted > begin:  # the rank waited for this message: a hand-over
        samples.add("latency_ms", finish - posted)
        samples.add(f"received_ms.{kind}", rec["end"] * 1e3 - finish - sleep)


def runtime_costs(samples: Samples, run_ms: float = 0.0, latency_ms: float = 0.0) -> RuntimeCosts:
    """The figures of the module docstring from the samples (negative ones become 0)."""
    compute = {k: samples.mean(f"compute_ms.{k}") for k in KINDS}
    known = [v for v in compute.values() if v is not None]
    fallback = statistics.median(known) if known else 0.0
    compute = {k: (fallback if v is None else v) for k, v in compute.items()}
    received = {k: samples.mean(f"received_ms.{k}") for k in KINDS}
    extra = [received[k] - compute[k] for k in KINDS if received[k] is not None]
    more = statistics.median(extra) if extra else 0.0
    received = {k: (compute[k] + more if v is None else v) for k, v in received.items()}

    def scalar(name: str) -> float:
        return max(0.0, samples.mean(name) or 0.0)

    return RuntimeCosts(
        compute_ms=PerKind(**{k: max(0.0, v) for k, v in compute.items()}),
        received_ms=PerKind(**{k: max(0.0, v) for k, v in received.items()}),
        send_ms=scalar("send_ms"), recv_ms=scalar("recv_ms"), wait_ms=scalar("wait_ms"), meta_ms=scalar("meta_ms"),
        batch_ms=scalar("batch_ms"), run_ms=max(0.0, run_ms),
        meta_recv_ms=_meta_recv(samples, latency_ms, scalar("recv_ms")),
    )


def _meta_recv(samples: Samples, latency_ms: float, recv_ms: float) -> float:
    """``meta_recv_ms``: from the later of a RECV_META's start and its message's arrival to the end
    of the data receive behind it, less that receive's ``recv_ms``."""
    for start, posted, end in samples.meta_receives:
        samples.add("meta_recv_ms", end - max(start, posted + latency_ms) - recv_ms)
    return max(0.0, samples.mean("meta_recv_ms") or 0.0)


def link(pairs: Sequence[dict[str, float]]) -> tuple[float, float | None]:
    """(one-way ms, bandwidth GB/s or None) from the neighbour ping-pongs: the median
    small-message one-way time; the big message's extra bytes over its extra time."""
    small = statistics.median(p["small_ms"] for p in pairs)
    big = statistics.median(p["big_ms"] for p in pairs)
    nbytes = pairs[0]["big_bytes"]
    bandwidth = nbytes / ((big - small) * 1e6) if big > small else None
    return float(small), bandwidth


def sleep_costs(num_ranks: int, num_chunks: int, fwd_ms: float, bwd_ms: float,
                machine: Machine | None = None) -> CostModel:
    """The cost model of a sleep pipeline: a rank's share sleeps ``fwd_ms`` / ``bwd_ms``
    (``I = W = bwd_ms / 2``), split over its chunks; with a machine's link and runtime costs
    (with them the simulator runs the first stage's whole backward in its W, as the runtime does)."""
    costs = CostModel.per_rank_share(num_ranks, num_chunks, F=fwd_ms, B=bwd_ms)
    return machine.apply(costs) if machine is not None else costs


def sleep_of(fwd_ms: float, bwd_ms: float) -> Callable[[MetaStep], float]:
    """``nominal_ms`` for `collect`: the sleep of a compute step of a one-chunk sleep pipeline
    (F: ``fwd_ms``, B: ``bwd_ms``, I and W half of it; the first stage's I nothing, its W all)."""
    def sleep(step: MetaStep) -> float:
        kind = step.meta_type
        if kind is _T.FWD:
            return fwd_ms
        if kind is _T.BWD:
            return bwd_ms
        if step.stage_index == 0:
            return 0.0 if kind is _T.BWD_INPUT else bwd_ms
        return bwd_ms / 2
    return sleep


def predict_ms(schedule_class: Any, num_ranks: int, num_chunks: int, micro_batches: int, costs: CostModel,
               transport: str = "plain") -> float:
    """The makespan ``schedule.run()`` should take: the lowered lists as the runtime lowers them
    by default (prefetch on, metadata for the first micro-batch), in the transport's model."""
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule

    _, result = simulate_schedule(schedule_class, num_ranks, num_chunks, micro_batches, costs, lowered=True,
                                  transport=transport, **RUNTIME_LOWERING)
    return float(result.makespan)
