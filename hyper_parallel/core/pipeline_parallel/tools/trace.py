"""Step traces: the record format, merging, Chrome/Perfetto export, plan-versus-run comparison.

A trace is a list of records, one per step a rank ran::

    {"rank": 0, "step": "F.s0.m1", "kind": "compute", "start": 0.0132, "end": 0.0151}

- ``rank``: the pipeline rank (position in the pipeline group);
- ``step``: the step's text form (``str(MetaStep)``);
- ``kind``: ``compute`` (F/B/I/W/OVERLAP), ``p2p-issue`` (posting a send/recv or BATCH),
  ``p2p-wait`` (the rank's thread blocked on a receive; ``step`` names the receive), and in
  simulated traces also ``p2p`` (a message in flight, sender's rank);
- ``start`` / ``end``: seconds from a common origin (all ranks' clocks aligned at the start
  of the run; see `tracing.StepTracer`). Simulated traces (``SimulationResult.records``) use
  milliseconds: every function here takes the ``unit`` of its records.

Trace files: ``{"format": "hyper-parallel-trace/1", "unit": "s", "records": [...]}`` (a bare
list of records reads as seconds), or a Chrome trace written by `chrome_trace` (one process per
rank, one slice per step), which `load_trace` reads back.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.ir.trace_records import (  # noqa: F401 (the format, re-exported here)
    FACT_NAMES,
    FACTS,
    FORMAT,
    KINDS,
    UNITS,
    Record,
    check_record,
    merge_records,
)


def convert(records: Iterable[Record], unit: str, to: str) -> list[Record]:
    """The records with their times changed from ``unit`` to ``to`` (``s``, ``ms``, ``us``)."""
    for u in (unit, to):
        if u not in UNITS:
            raise ValueError(f"unknown time unit {u!r}; valid: {', '.join(UNITS)}")
    factor = UNITS[unit] / UNITS[to]
    return [{**r, "start": r["start"] * factor, "end": r["end"] * factor} for r in records]


# ---------------------------------------------------------------------- Chrome / Perfetto


def chrome_trace(records: Sequence[Record], unit: str = "s", label: str = "", pid_offset: int = 0
                 ) -> dict[str, Any]:
    """Chrome trace JSON (open in Perfetto or chrome://tracing): one process per rank named
    ``{label} rank r``; its thread ``steps`` holds one complete event per compute, p2p-issue
    and p2p-wait record (``cat`` = the kind); messages in flight (``p2p``) are async slices."""
    events: list[dict[str, Any]] = []
    to_us = UNITS[unit] / UNITS["us"] if unit in UNITS else None
    if to_us is None:
        raise ValueError(f"unknown time unit {unit!r}; valid: {', '.join(UNITS)}")
    ranks = sorted({r["rank"] for r in records})
    prefix = f"{label} " if label else ""
    for rank in ranks:
        pid = pid_offset + rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{prefix}rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "steps"}})
    for n, record in enumerate(records):
        r = check_record(record, f"record {n}")
        pid = pid_offset + r["rank"]
        ts, dur = r["start"] * to_us, (r["end"] - r["start"]) * to_us
        if r["kind"] == "p2p":
            common = {"cat": "p2p", "name": r["step"], "pid": pid, "tid": 0, "id": n}
            events.append({**common, "ph": "b", "ts": ts})
            events.append({**common, "ph": "e", "ts": ts + dur})
        else:
            events.append({"ph": "X", "cat": r["kind"], "name": r["step"], "pid": pid, "tid": 0, "ts": ts,
                           "dur": dur, "args": {"kind": r["kind"], "start_s": r["start"] * UNITS[unit]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def combined_chrome_trace(planned: Sequence[Record] | None, measured: Sequence[Record] | None,
                          planned_unit: str = "ms", measured_unit: str = "s") -> dict[str, Any]:
    """One Chrome trace holding a plan (processes ``plan rank r``) and a measured run
    (``run rank r``, process ids from 1000) for side-by-side viewing."""
    events: list[dict[str, Any]] = []
    if planned:
        events += chrome_trace(planned, planned_unit, "plan", 0)["traceEvents"]
    if measured:
        events += chrome_trace(measured, measured_unit, "run", 1000)["traceEvents"]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def records_from_chrome(trace: dict[str, Any]) -> dict[str, list[Record]]:
    """Records (in seconds) per label (``""`` when unlabeled) read back from a Chrome trace
    written by `chrome_trace` / `combined_chrome_trace`."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    names: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = str(e.get("args", {}).get("name", ""))
    out: dict[str, list[Record]] = defaultdict(list)
    for n, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"traceEvents[{n}] must be an object, got {e!r}")
        if e.get("ph") != "X":
            continue
        lacks = [k for k in ("pid", "ts") if not isinstance(e.get(k), (int, float)) or isinstance(e.get(k), bool)]
        if lacks or not isinstance(e.get("dur", 0.0), (int, float)):
            raise ValueError(f"traceEvents[{n}]: a complete event ('X') needs numbers pid, ts (and dur), got {e!r}")
        name = names.get(e["pid"], f"rank {e['pid']}")
        label, _, rank = name.rpartition("rank ")
        try:
            rank_id = int(rank)
        except ValueError:
            rank_id = int(e["pid"])
        kind = e.get("cat") if e.get("cat") in KINDS else "compute"
        start = float(e["ts"]) * 1e-6
        out[label.strip()].append({"rank": rank_id, "step": str(e.get("name", "")), "kind": kind, "start": start,
                                   "end": start + float(e.get("dur", 0.0)) * 1e-6})
    return {label: merge_records([records]) for label, records in out.items()}


# ---------------------------------------------------------------------- files


def save_trace(records: Sequence[Record], path: str | os.PathLike[str], unit: str = "s") -> None:
    """Write records as a trace file (``.json``; ``unit`` of the records is kept)."""
    checked = [check_record(r, f"record {k}") for k, r in enumerate(records)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "unit": unit, "records": checked}, f)
        f.write("\n")


def load_trace(path: str | os.PathLike[str]) -> dict[str, list[Record]]:
    """Records in seconds per label from a trace file, a bare list of records, or a Chrome
    trace written by this module (labels ``plan`` / ``run`` when it holds both)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        parts = _parts(data)
        for label, records in parts.items():
            for k, r in enumerate(records):
                if r["kind"] != "compute":
                    continue  # only compute steps are read as steps; a wait may name what it waits for
                try:
                    MetaStep.from_str(r["step"])
                except ValueError as exc:
                    raise ValueError(f"record {k}{f' ({label})' if label else ''}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return parts


def _parts(data: Any) -> dict[str, list[Record]]:
    if isinstance(data, list):
        return {"": merge_records([data])}
    if isinstance(data, dict) and "traceEvents" in data:
        return records_from_chrome(data)
    if isinstance(data, dict) and "records" in data:
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"unknown trace format {data.get('format')!r}")
        if not isinstance(data["records"], list):
            raise ValueError(f"records must be a list, got {data['records']!r}")
        unit = data.get("unit", "s")
        return {"": convert(merge_records([data["records"]]), unit, "s")}
    raise ValueError("neither a trace file, a list of records nor a Chrome trace")


def load_trace_facts(path: str | os.PathLike[str]) -> dict[str, dict[str, dict[int, float | None]]]:
    """What a Chrome trace written by `visualize.write_chrome_trace` carries beside its records,
    per label as `load_trace` names them: ``{"plan": {"peak_activation_bytes": {0: 4.0, ...}}}``;
    empty for other files. ValueError naming the file and the bad entry."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    other = data.get("otherData") if isinstance(data, dict) else None
    stored = other.get(FACTS, {}) if isinstance(other, dict) else {}  # otherData is free-form for other tools
    out: dict[str, dict[str, dict[int, float | None]]] = {}
    try:
        if not isinstance(stored, dict):
            raise ValueError(f"otherData.{FACTS} must be an object")
        for label, facts in stored.items():
            if not isinstance(facts, dict):
                raise ValueError(f"otherData.{FACTS}.{label} must be an object")
            out[label] = {}
            for name, per_rank in facts.items():
                if name not in FACT_NAMES or not isinstance(per_rank, dict):
                    raise ValueError(f"otherData.{FACTS}.{label}: unknown or malformed {name!r}")
                values: dict[int, float | None] = {}
                for rank, value in per_rank.items():
                    if not rank.isdigit():
                        raise ValueError(f"otherData.{FACTS}.{label}.{name}: the keys must be ranks, got {rank!r}")
                    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                              or value < 0):
                        raise ValueError(f"otherData.{FACTS}.{label}.{name}[{rank}] must be a number >= 0, "
                                         f"got {value!r}")
                    values[int(rank)] = value
                out[label][name] = values
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out


# ---------------------------------------------------------------------- plan versus run


def makespan(records: Sequence[Record]) -> float:
    """From the earliest start to the latest end of the records."""
    if not records:
        return 0.0
    return max(r["end"] for r in records) - min(r["start"] for r in records)


def compute_order(records: Sequence[Record]) -> dict[int, list[str]]:
    """Per rank, the compute steps in the order they ran."""
    order: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "compute":
            order[r["rank"]].append((r["start"], r["step"]))
    return {rank: [step for _, step in sorted(steps)] for rank, steps in sorted(order.items())}


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Makespan, busy time and bubble fraction per rank and overall (in the records' unit)."""
    span = makespan(records)
    busy: dict[int, float] = defaultdict(float)
    for r in records:
        busy[r["rank"]] += (r["end"] - r["start"]) if r["kind"] == "compute" else 0.0
    ranks = sorted({r["rank"] for r in records})
    per_rank = {rank: (1.0 - busy[rank] / span if span > 0 else 0.0) for rank in ranks}
    overall = 1.0 - sum(busy.values()) / (len(ranks) * span) if span > 0 and ranks else 0.0
    return {"makespan": span, "busy": {r: busy[r] for r in ranks}, "bubble_per_rank": per_rank,
            "bubble_fraction": overall}


def step_times(records: Sequence[Record]) -> dict[tuple[str, int], list[float]]:
    """Durations of compute steps per (type code, stage): ``("F", 0) -> [...]`` (an OVERLAP
    pair is listed under its own code)."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] != "compute":
            continue
        step = MetaStep.from_str(r["step"])
        stage = step.stage_index if step.stage_index is not None else step.parts[0].stage_index
        out[(step.meta_type.code, stage)].append(r["end"] - r["start"])
    return dict(out)


def compare(measured: Sequence[Record], planned: Sequence[Record], measured_unit: str = "s",
            planned_unit: str = "ms") -> dict[str, Any]:
    """How a measured run differs from its plan (times in milliseconds).

    Returns the makespans and their ratio, bubble fractions per rank and overall, the median
    time of each (step type, stage) in both, and per rank the first place where the order of
    compute steps differs (``None`` when the run followed the plan).
    """
    run = convert(measured, measured_unit, "ms")
    plan = convert(planned, planned_unit, "ms")
    run_sum, plan_sum = summarize(run), summarize(plan)
    run_times, plan_times = step_times(run), step_times(plan)
    steps = []
    for key in sorted(set(run_times) | set(plan_times), key=lambda k: (k[1], k[0])):
        got = statistics.median(run_times[key]) if key in run_times else None
        want = statistics.median(plan_times[key]) if key in plan_times else None
        steps.append({"step": key[0], "stage": key[1], "measured_ms": got, "planned_ms": want,
                      "ratio": got / want if got is not None and want else None})
    run_order, plan_order = compute_order(run), compute_order(plan)
    order = {}
    for rank in sorted(set(run_order) | set(plan_order)):
        mine, theirs = run_order.get(rank, []), plan_order.get(rank, [])
        first = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None and len(mine) != len(theirs):
            first = min(len(mine), len(theirs))
        order[rank] = None if first is None else {
            "index": first, "measured": mine[first] if first < len(mine) else None,
            "planned": theirs[first] if first < len(theirs) else None}
    ratio = run_sum["makespan"] / plan_sum["makespan"] if plan_sum["makespan"] else None
    return {
        "measured_makespan_ms": run_sum["makespan"], "planned_makespan_ms": plan_sum["makespan"],
        "makespan_ratio": ratio,
        "measured_bubble_fraction": run_sum["bubble_fraction"], "planned_bubble_fraction": plan_sum["bubble_fraction"],
        "bubble_per_rank": {rank: {"measured": run_sum["bubble_per_rank"].get(rank),
                                   "planned": plan_sum["bubble_per_rank"].get(rank)}
                            for rank in sorted(set(run_sum["bubble_per_rank"]) | set(plan_sum["bubble_per_rank"]))},
        "steps": steps,
        "order_mismatch": order,
    }


def costs_from_records(records: Sequence[Record], num_stages: int, unit: str = "s") -> Any:
    """A `CostModel` from a measured run: per stage the median F, B, I, W times (ms); what
    the run did not contain keeps the model's defaults."""
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost

    times = step_times(convert(records, unit, "ms"))
    stages = []
    for s in range(num_stages):
        fields = {code: statistics.median(times[(code, s)]) for code in ("F", "B", "I", "W") if (code, s) in times}
        if "B" in fields and ("I" in fields) != ("W" in fields):
            fields.pop("I", None)
            fields.pop("W", None)
        stages.append(StageCost(**fields))
    return CostModel(stages=tuple(stages))


# ---------------------------------------------------------------------- causality


def causality_violations(records: Sequence[Record], tolerance: float = 0.0) -> list[str]:
    """Where a measured trace contradicts itself: a compute step that starts, or a wait on a
    receive that ends, before the peer rank posted the send of what it consumes (times in the
    records' unit; ``tolerance`` forgives that much). Empty when the ranks' clocks agree.

    Stages are placed on ranks as their compute records show; a forward of stage ``s`` consumes
    ``SEND_F`` of stage ``s - 1``, a backward (B or I) ``SEND_B`` of stage ``s + 1``, where that
    stage is on another rank (plain sends or inside ``BATCH``). A compute step is judged by its
    first part (an OVERLAP pair runs its parts in order); the n-th consumer of a message is
    matched with its n-th send, so a trace of several runs is judged run by run.
    """
    steps = []
    for r in records:
        try:
            steps.append((r, MetaStep.from_str(r["step"])))
        except ValueError:
            if r["kind"] == "compute":
                raise
            # a wait of a plan without lowering names what it waits for ("B.s3.m0 or I.s3.m0")
    owner: dict[int, int] = {}
    for r, step in steps:
        for part in step.parts:
            if part.stage_index is not None:
                owner.setdefault(part.stage_index, r["rank"])
    sends: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for r, step in sorted(steps, key=lambda rs: rs[0]["start"]):
        if r["kind"] != "p2p-issue":
            continue
        for op in step.comm_parts:
            if op.meta_type.code in ("SEND_F", "SEND_B") and op.stage_index is not None:
                sends[(op.meta_type.code, op.stage_index, op.micro_index)].append(r["start"])
    used: dict[tuple[str, str, int, int], int] = defaultdict(int)
    out = []
    for r, step in sorted(steps, key=lambda rs: rs[0]["start"]):
        if r["kind"] == "compute" and step.parts:
            part, when, what = step.parts[0], r["start"], "starts"
            code = {"F": "F", "B": "B", "I": "B"}.get(part.meta_type.code)
        elif r["kind"] == "p2p-wait" and step.meta_type.code in ("RECV_F", "RECV_B"):
            part, when, what = step, r["end"], "ends its wait"
            code = step.meta_type.code[-1]
        else:
            continue
        if code is None or part.stage_index is None:
            continue
        producer = part.stage_index - 1 if code == "F" else part.stage_index + 1
        if producer not in owner or owner[producer] == r["rank"]:
            continue  # first/last stage, or the data is handed over on this rank
        key = (f"SEND_{code}", producer, part.micro_index)
        n = used[(r["kind"], *key)]
        used[(r["kind"], *key)] += 1
        posted = sends.get(key, [])
        if n >= len(posted):
            out.append(f"rank {r['rank']}: {r['step']} {what} at {when:.6g} but rank {owner[producer]} never "
                       f"posted {key[0]}.s{producer}.m{part.micro_index} (occurrence {n + 1})")
        elif when + tolerance < posted[n]:
            out.append(f"rank {r['rank']}: {r['step']} {what} at {when:.6g}, before rank {owner[producer]} posted "
                       f"{key[0]}.s{producer}.m{part.micro_index} at {posted[n]:.6g}")
    return out
