"""The step-trace record format: what a traced run writes and every trace tool reads.

A trace is a list of records, one per step a rank ran (the fields are described in
``tools/trace.py`` and docs/tools.md). This module holds only the format (its constants, the
record check and the merge of per-rank parts), so that the runtime's tracer writes records
without importing the offline tools that analyse them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FORMAT = "hyper-parallel-trace/1"
FACTS = "hyper_parallel"
"""The key, inside a Chrome trace's ``otherData``, of what its records cannot tell: per label
(``""``, ``plan``, ``run``) and per fact (``peak_activations``, ``peak_activation_bytes``) a
number per rank (JSON keys: the rank as text)."""
FACT_NAMES = ("peak_activations", "peak_activation_bytes")
KINDS = ("compute", "p2p-issue", "p2p-wait", "p2p")
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
Record = dict[str, Any]


def check_record(record: Any, where: str = "record") -> Record:
    """Return the record with numbers as floats; ValueError naming the bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} must be a dict, got {type(record).__name__}")
    missing = [k for k in ("rank", "step", "kind", "start", "end") if k not in record]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}: {record!r}")
    rank = record["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{where}: rank must be an int >= 0, got {rank!r}")
    if record["kind"] not in KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {record['kind']!r}")
    start, end = record["start"], record["end"]
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    if end < start:
        raise ValueError(f"{where}: ends ({end}) before it starts ({start})")
    return {**record, "step": str(record["step"]), "start": float(start), "end": float(end)}


def merge_records(per_rank: Iterable[Iterable[Record]]) -> list[Record]:
    """All ranks' records in one list, checked, sorted by (start, rank)."""
    merged = [check_record(r, f"record {k} of part {n}") for n, part in enumerate(per_rank)
              for k, r in enumerate(part)]
    merged.sort(key=lambda r: (r["start"], r["rank"], r["end"]))
    return merged
