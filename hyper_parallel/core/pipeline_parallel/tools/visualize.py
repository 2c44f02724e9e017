"""Pictures of a schedule: terminal charts, Chrome/Perfetto traces, PNG/SVG.

- `ascii_chart`: one row per rank, time left to right, in the simulation's time unit, so two
  schedules simulated with the same costs (e.g. `CostModel.per_rank_share`) read on one scale.
  Too wide for the terminal, it wraps into blocks of columns, or compresses to one character
  per time slot (``mode``).
- `write_chrome_trace`: a simulated run (or measured records) as Chrome trace JSON.
- `plot_timelines`: PNG or SVG through matplotlib (optional: ``pip install
  'hyper-parallel[viz]'``), a plan and a measured run one above the other when both are given.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from functools import partial
from operator import attrgetter, itemgetter, lt, sub
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule
from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult, simulate
from hyper_parallel.core.pipeline_parallel.tools.trace import FACTS, Record, chrome_trace, combined_chrome_trace, convert

MODES = ("auto", "full", "wrap", "compact")
_MAX_WRAPPED_BLOCKS = 3
_LETTERS = {MetaStepType.FWD: "F", MetaStepType.BWD: "B", MetaStepType.BWD_INPUT: "I", MetaStepType.BWD_WEIGHT: "W",
            MetaStepType.PRE_FWD: "P", MetaStepType.PRE_BWD: "Q"}
_LETTER_OF = {kind: "O" if kind.is_overlap else _LETTERS.get(kind, "?") for kind in MetaStepType}
_CODES = "FBIWPQO?"  # a compact row's letters, by number (``_CODE_OF``)
_CODE_OF = {kind: _CODES.index(letter) for kind, letter in _LETTER_OF.items()}
_START, _END, _STEP = itemgetter(0), itemgetter(1), itemgetter(2)
_TYPE_OF = attrgetter("meta_type")


def infer_stage_to_rank(schedule: Schedule) -> dict[int, int]:
    """Stage -> rank read off the compute steps of a schedule."""
    placement: dict[int, int] = {}
    for rank, steps in schedule.items():
        for step in steps:
            for part in step.parts if step is not None else ():
                if part.stage_index is None:
                    continue
                owner = placement.setdefault(part.stage_index, rank)
                if owner != rank:
                    raise ValueError(f"stage {part.stage_index} appears on ranks {owner} and {rank}")
    return dict(sorted(placement.items()))


def terminal_width(default: int = 120) -> int:
    """Columns of the terminal (``COLUMNS`` or the real size), ``default`` when unknown."""
    return shutil.get_terminal_size((default, 24)).columns


def ascii_chart(
    schedule_or_result: Schedule | SimulationResult,
    stage_to_rank: dict[int, int] | None = None,
    costs: Any = None,
    comm_cost: float = 0.0,
    unit: float | None = None,
    width: int | None = None,
    mode: str = "auto",
) -> str:
    """Chart of a simulated schedule (simulated here from ``costs`` when given a schedule).

    ``full``: one column of ``unit`` time (default: the shortest step) per cell; a cell shows
    ``F3`` / ``B3`` / ``I3`` / ``W3`` (micro-batch 3), with ``.c`` appended for the rank's chunk
    c when ranks hold several stages; a step longer than one unit continues with ``-``; idle
    time is dots. ``wrap``: the full chart cut into blocks of at most ``width`` characters.
    ``compact``: one character per slot (``F B I W``, ``O`` an overlapped pair, lower case for
    its continuation, ``.`` idle), the slot widened until the chart fits ``width`` (or
    wrapped when even one shortest step per character does not fit). ``auto``: full if it
    fits, else wrap if that takes at most 3 blocks, else compact. ``width`` defaults to the
    terminal's. Footer: makespan, overall bubble, peak activations per rank.
    """
    if mode not in MODES:
        raise ValueError(f"unknown chart mode {mode!r}; valid: {', '.join(MODES)}")
    if isinstance(schedule_or_result, SimulationResult):
        result = schedule_or_result
    else:
        placement = stage_to_rank or infer_stage_to_rank(schedule_or_result)
        result = simulate(schedule_or_result, placement, costs, comm_cost)
    width = width or terminal_width()
    positive = partial(lt, 0.0)  # d > 0 (numpy scalars too), over every duration at C speed: millions
    durations = (d for steps in result.timeline.values() for d in filter(positive, map(sub, map(_END, steps),
                                                                                       map(_START, steps))))
    unit = unit or min(durations, default=1.0)
    head = f"rank {max(result.timeline, default=0)}"
    indent = len(head) + 2
    footer = _footer(result)
    if mode in ("full", "wrap") or (mode == "auto" and not _surely_compact(result.makespan, unit, width, indent)):
        ncells, cell, rows = _full_rows(result, unit)
        fits = indent + ncells * cell <= width
        blocks = math.ceil(ncells * cell / max(cell, (width - indent) // cell * cell))
        if mode == "full" or (mode == "auto" and fits):
            return "\n".join([_ruler(ncells, cell, unit, len(head)), *_row_lines(rows, head), footer])
        if mode == "wrap" or blocks <= _MAX_WRAPPED_BLOCKS:
            per_block = max(1, (width - indent) // cell)
            return _wrapped(rows, ncells, cell, unit, head, per_block, footer)
    slot = unit
    span = max(result.makespan, unit)
    if indent + math.ceil(span / slot - 1e-9) > width:
        slot = span / max(1, width - indent)
        slot = _nice(slot)
    exact = slot <= unit + 1e-12
    ncells, rows = _compact_rows(result, slot, exact)
    how = "lower case continues a step" if exact else "each column shows what filled most of it"
    kinds = set().union(*(map(_TYPE_OF, map(_STEP, steps)) for steps in result.timeline.values()))
    pre = bool(kinds & {MetaStepType.PRE_FWD, MetaStepType.PRE_BWD})
    legend = (f"one column = {slot:g} ms; F forward, B backward, I input backward, W weight backward, "
              f"O overlapped pair{', P/Q MPipe preprocess forward/backward' if pre else ''}; {how}; . idle")
    per_block = max(1, width - indent)
    if ncells <= per_block:
        body = [_ruler(ncells, 1, slot, len(head), every=10), *_row_lines(rows, head)]
        return "\n".join([*body, legend, footer])
    return _wrapped(rows, ncells, 1, slot, head, per_block, legend + "\n" + footer, every=10)


def _surely_compact(makespan: float, unit: float, width: int, indent: int) -> bool:
    """Whether ``auto`` must end compact without laying out the full chart: it has at least
    ``ceil(makespan / unit)`` cells of at least 2 characters, so it takes at least
    ``ceil(2 * cells / max(2, width - indent))`` blocks, which must not be more than 3."""
    cells = math.ceil(makespan / unit - 1e-9)
    return math.ceil(2 * cells / max(2, width - indent)) > _MAX_WRAPPED_BLOCKS


def _footer(result: SimulationResult) -> str:
    peaks = " ".join(f"r{rank}={peak}" for rank, peak in sorted(result.peak_activations.items()))
    return f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}, peak activations {peaks}"


def _nice(value: float) -> float:
    """The next value of the form 1, 2, 2.5 or 5 times a power of ten at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for factor in (1, 2, 2.5, 5, 10):
        if factor * power >= value - 1e-12:
            return factor * power
    return 10 * power


def _chunk_indices(result: SimulationResult) -> dict[int, dict[int, int]]:
    chunks: dict[int, dict[int, int]] = {}
    for rank, steps in result.timeline.items():
        stages = sorted({p.stage_index for _, _, s in steps for p in s.parts or (s,)} - {None})
        chunks[rank] = {stage: index for index, stage in enumerate(stages)}
    return chunks


def _part_label(part: MetaStep, chunk_of: dict[int, int] | None) -> str:
    text = part.meta_type.code + ("" if part.micro_index is None else str(part.micro_index))
    if chunk_of is not None and part.stage_index in chunk_of:
        text += f".{chunk_of[part.stage_index]}"
    return text


def _full_rows(result: SimulationResult, unit: float) -> tuple[int, int, dict[int, str]]:
    """(cells, characters per cell, rank -> row text of exactly cells * width characters)."""
    chunks = _chunk_indices(result)
    multi = any(len(stages) > 1 for stages in chunks.values())

    def label(rank: int, step: MetaStep) -> str:
        parts = step.parts or (step,)
        return "+".join(_part_label(part, chunks[rank] if multi else None) for part in parts)

    labels = {r: [label(r, step) for _, _, step in steps] for r, steps in result.timeline.items()}
    cell = max((len(text) for texts in labels.values() for text in texts), default=1) + 1
    ncells = math.ceil(result.makespan / unit - 1e-9)
    rows = {}
    for rank in sorted(result.timeline):
        row = ["." * (cell - 1) + " "] * ncells
        free = 0
        for (start, end, _), text in zip(result.timeline[rank], labels[rank]):
            first = max(free, round(start / unit))
            last = max(first + 1, round(end / unit))
            if last > len(row):
                row += ["." * (cell - 1) + " "] * (last - len(row))
            span = (last - first) * cell - 1
            row[first:last] = [text.ljust(span, "-") + " "] + [""] * (last - first - 1)
            free = last
        rows[rank] = "".join(row)
    ncells = max([ncells, *(len(text) // cell for text in rows.values())])
    rows = {rank: text.ljust(ncells * cell) for rank, text in rows.items()}
    for rank, text in rows.items():  # idle cells added by padding read as idle
        rows[rank] = "".join(
            text[k:k + cell] if text[k:k + cell].strip() else "." * (cell - 1) + " " for k in range(0, len(text), cell)
        )
    return ncells, cell, rows


def _compact_rows(result: SimulationResult, slot: float, exact: bool) -> tuple[int, dict[int, str]]:
    """One character per slot. ``exact`` (no step shorter than a slot): each step starts with
    its letter, continues in lower case. Otherwise each slot shows the step type that filled
    most of it (idle when idle time did)."""
    ncells = max(1, math.ceil(result.makespan / slot - 1e-9))
    rows = {}
    for rank in sorted(result.timeline):
        if exact:
            row = ["."] * ncells
            free = 0
            for start, end, step in result.timeline[rank]:
                first = max(free, round(start / slot))
                last = max(first + 1, round(end / slot))
                letter = _letter(step)
                for k in range(first, min(last, ncells)):
                    row[k] = letter if k == first else letter.lower()
                free = last
        else:
            row = _majority_row(result.timeline[rank], slot, ncells, result.makespan)
        rows[rank] = "".join(row)
    return ncells, rows


def _majority_row(timeline: list[tuple[float, float, MetaStep]], slot: float, ncells: int,
                  makespan: float) -> list[str]:
    """A compact row where steps may be shorter than a slot: each slot shows the letter whose
    steps filled most of it, idle when idle time filled more.

    The overlaps of every (step, slot) pair are made with numpy and summed per (slot, letter) by
    ``bincount``, which adds them in the order given, step by step as a loop over the timeline
    would: the sums, hence the ties, are the same floats (a row of a large job has a million
    steps; a Python loop per step cost seconds there)."""
    if not timeline:
        return ["."] * ncells
    count = len(timeline)
    starts = np.fromiter(map(_START, timeline), np.float64, count)
    ends = np.fromiter(map(_END, timeline), np.float64, count)
    codes = np.fromiter(map(_CODE_OF.__getitem__, map(_TYPE_OF, map(_STEP, timeline))), np.int64, count)
    first = (starts / slot).astype(np.int64)
    last = np.minimum(ncells, np.ceil(ends / slot - 1e-9)).astype(np.int64)
    spans = np.maximum(last - first, 0)
    step = np.repeat(np.arange(count), spans)  # one entry per (step, slot it touches), in timeline order
    offsets = np.arange(len(step)) - np.repeat(np.cumsum(spans) - spans, spans)
    cell = np.repeat(first, spans) + offsets
    overlap = np.minimum(ends[step], (cell + 1) * slot) - np.maximum(starts[step], cell * slot)
    keep = (overlap > 0) & (cell >= 0)  # what lies before time 0 (a hand-made result) is not drawn
    letters = len(_CODES)
    bins = cell[keep] * letters + codes[step[keep]]
    sums = np.bincount(bins, weights=overlap[keep], minlength=ncells * letters)
    present, first_seen = np.unique(bins, return_index=True)
    by_cell: dict[int, list[tuple[int, int]]] = {}
    for where, seen in zip(present.tolist(), first_seen.tolist(), strict=True):
        by_cell.setdefault(where // letters, []).append((seen, where))
    row = ["."] * ncells
    for k, entries in by_cell.items():
        entries.sort()  # the letters of the slot in the order the timeline first fills them
        amounts = [float(sums[where]) for _, where in entries]
        idle = min(slot, makespan - k * slot) - sum(amounts)
        top = max(range(len(amounts)), key=amounts.__getitem__)  # the first of equal largest
        if amounts[top] >= idle:
            row[k] = _CODES[entries[top][1] % letters]
    return row


def _letter(step: MetaStep) -> str:
    return _LETTER_OF[step.meta_type]


def _row_lines(rows: dict[int, str], head: str, lo: int = 0, hi: int | None = None) -> list[str]:
    return [f"{f'rank {rank}':<{len(head)}} |" + text[lo:hi].rstrip() for rank, text in sorted(rows.items())]


def _wrapped(rows: dict[int, str], ncells: int, cell: int, unit: float, head: str, per_block: int, footer: str,
             every: int = 5) -> str:
    blocks = []
    for first in range(0, ncells, per_block):
        last = min(ncells, first + per_block)
        ruler = _ruler(last - first, cell, unit, len(head), every=every, offset=first)
        blocks.append("\n".join([ruler, *_row_lines(rows, head, first * cell, last * cell)]))
    return "\n\n".join(blocks) + "\n" + footer


def _ruler(ncells: int, width: int, unit: float, indent: int, every: int = 5, offset: int = 0) -> str:
    chars = [" "] * (ncells * width)
    for cell in range(0, ncells):
        if (cell + offset) % every:
            continue
        mark = f"{(cell + offset) * unit:g}"
        at = cell * width
        if all(c == " " for c in chars[at : at + len(mark) + 1]):
            chars[at : at + len(mark)] = mark
    return f"{'time':<{indent}} |" + "".join(chars).rstrip()


# ---------------------------------------------------------------------- Chrome trace files


def write_chrome_trace(path: str | os.PathLike[str], planned: SimulationResult | Sequence[Record] | None = None,
                       measured: Sequence[Record] | None = None, measured_unit: str = "s",
                       measured_facts: dict[str, dict[int, Any]] | None = None) -> None:
    """Write a Chrome/Perfetto trace of a plan (a SimulationResult, times in ms), a measured
    run (records in ``measured_unit``), or both side by side. What the records cannot tell goes
    along in the trace's ``otherData`` (`trace.FACTS`, read back by `trace.load_trace_facts`):
    a SimulationResult's peak activations and peak activation memory per rank, and
    ``measured_facts`` (the same keys) for the run."""
    plan_records = planned.records if isinstance(planned, SimulationResult) else planned
    if plan_records is None and measured is None:
        raise ValueError("nothing to write: give a plan, a measured trace or both")
    if measured is None:
        trace = chrome_trace(plan_records or [], "ms")
    elif plan_records is None:
        trace = chrome_trace(measured, measured_unit)
    else:
        trace = combined_chrome_trace(plan_records, measured, "ms", measured_unit)
    both = plan_records is not None and measured is not None
    facts: dict[str, Any] = {}
    if isinstance(planned, SimulationResult):
        facts["plan" if both else ""] = {"peak_activations": planned.peak_activations,
                                         "peak_activation_bytes": planned.peak_activation_bytes}
    if measured is not None and measured_facts:
        facts["run" if both else ""] = measured_facts
    if facts:
        trace["otherData"] = {FACTS: {label: {key: {str(r): v for r, v in per_rank.items()}
                                              for key, per_rank in values.items()}
                                      for label, values in facts.items()}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
        f.write("\n")


# ---------------------------------------------------------------------- PNG / SVG

_COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#88D27A", "W": "#F58518", "OVERLAP_B_F": "#B279A2",
           "OVERLAP_F_B": "#B279A2"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"PNG/SVG charts need matplotlib, which could not be imported ({exc}); install it with "
            "pip install 'hyper-parallel[viz]'"
        ) from exc
    return plt


def plot_timelines(path: str | os.PathLike[str], panels: Sequence[tuple[str, Sequence[Record], str]],
                   title: str = "") -> None:
    """Draw each panel ``(title, records, unit)`` as a Gantt chart (one row per rank, compute
    steps coloured by type, p2p waits hatched), stacked in one picture; times in ms. The file
    type follows the extension (``.png`` or ``.svg``)."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"cannot tell the picture format of {path!r}: use a .png or .svg name")
    if not panels:
        raise ValueError("nothing to plot")
    plt = _pyplot()
    prepared = [(name, convert(records, unit, "ms")) for name, records, unit in panels]
    spans = [max((r["end"] for r in recs), default=0.0) - min((r["start"] for r in recs), default=0.0)
             for _, recs in prepared]
    heights = [max(1, len({r["rank"] for r in recs})) for _, recs in prepared]
    fig, axes = plt.subplots(len(prepared), 1, figsize=(12, 1.2 + 0.45 * sum(heights) + 0.6 * len(prepared)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, records), span in zip(axes[:, 0], prepared, spans):
        origin = min((r["start"] for r in records), default=0.0)
        ranks = sorted({r["rank"] for r in records})
        for r in records:
            y = ranks.index(r["rank"])
            left, wide = r["start"] - origin, r["end"] - r["start"]
            if r["kind"] == "compute":
                step = MetaStep.from_str(r["step"])
                ax.barh(y, wide, left=left, height=0.8, color=_COLORS.get(step.meta_type.code, "#999999"),
                        edgecolor="white", linewidth=0.5)
                if wide > span / 60 and step.parts and step.parts[0].micro_index is not None:
                    ax.text(left + wide / 2, y, str(step.parts[0].micro_index), ha="center", va="center",
                            fontsize=7, color="white")
            elif r["kind"] == "p2p-wait" and wide > 0:
                ax.barh(y, wide, left=left, height=0.5, color="none", edgecolor="#BBBBBB", hatch="///",
                        linewidth=0.0)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlim(0, max(span, 1e-9))
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{name}: makespan {span:.4g} ms" if name else f"makespan {span:.4g} ms", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C78A8", "#54A24B", "#88D27A", "#F58518", "#B279A2")]
    fig.legend(handles, ["F", "B", "I", "W", "F&B overlapped"], loc="upper right", ncol=5, fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)


def result_from_records(records: Sequence[Record], unit: str = "s",
                        facts: dict[str, dict[int, Any]] | None = None) -> SimulationResult:
    """A measured trace as a SimulationResult (times in ms from its first record), so the
    same charts and tables show plans and runs. ``facts`` (`trace.load_trace_facts`) gives the
    per-rank ``peak_activations`` / ``peak_activation_bytes`` the records cannot tell (else the
    peaks are counted from the compute steps and the memory is 0)."""
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import peak_activations
    from hyper_parallel.core.pipeline_parallel.tools.trace import summarize

    ms = convert(records, unit, "ms")
    origin = min((r["start"] for r in ms), default=0.0)
    ms = [{**r, "start": r["start"] - origin, "end": r["end"] - origin} for r in ms]
    timeline: dict[int, list[tuple[float, float, MetaStep]]] = {r["rank"]: [] for r in ms}
    for r in sorted(ms, key=lambda r: (r["start"], r["end"])):
        if r["kind"] == "compute":
            timeline[r["rank"]].append((r["start"], r["end"], MetaStep.from_str(r["step"])))
    numbers = summarize(ms)
    peaks = {rank: peak_activations([step for _, _, step in steps]) for rank, steps in timeline.items()}
    memory = dict.fromkeys(timeline, 0.0)
    facts = facts or {}
    peaks.update({r: v for r, v in facts.get("peak_activations", {}).items() if r in peaks and v is not None})
    memory.update({r: v for r, v in facts.get("peak_activation_bytes", {}).items() if r in memory and v is not None})
    return SimulationResult(numbers["makespan"], numbers["bubble_fraction"], peaks, timeline,
                            numbers["bubble_per_rank"], memory, numbers["busy"], ms)
