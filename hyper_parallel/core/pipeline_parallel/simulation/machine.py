"""Machine files: the point-to-point link and the runtime's costs of one machine.

`hyper-parallel calibrate` writes one (costs format of ``costs.py``: ``format``, ``p2p``, the
``runtime`` object of ``runtime_costs.py``, and a free-form ``machine`` object saying what was
calibrated); ``simulate --machine`` and ``tune --machine`` put its link and runtime costs into
the stage costs they simulate (`Machine.apply`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from hyper_parallel.core.pipeline_parallel.simulation.costs import (
    FORMAT, CostModel, check_head, read_entries, read_json, read_p2p, read_settings,
)
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import RuntimeCosts


@dataclass(frozen=True)
class Machine:
    """A machine file: the link, the runtime's costs, and what was calibrated (free-form).
    A link figure that is None was not given (not measured) and leaves the costs file's."""

    runtime: RuntimeCosts
    p2p_latency_ms: float | None = None
    p2p_bandwidth_gb_per_s: float | None = None
    info: dict[str, Any] | None = None

    def apply(self, costs: CostModel) -> CostModel:
        """``costs`` with this machine's runtime costs and the link figures it gives (they replace
        the costs file's; one it does not give, such as a bandwidth calibrate could not measure,
        stays the costs file's)."""
        latency = costs.p2p_latency_ms if self.p2p_latency_ms is None else self.p2p_latency_ms
        bandwidth = costs.p2p_bandwidth_gb_per_s if self.p2p_bandwidth_gb_per_s is None else \
            self.p2p_bandwidth_gb_per_s
        return replace(costs, p2p_latency_ms=latency, p2p_bandwidth_gb_per_s=bandwidth, runtime=self.runtime)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT,
            "comment": "machine file of hyper-parallel calibrate: the point-to-point link and the runtime's own "
                       "cost per lowered step (docs/tools.md)",
            "p2p": {"latency_ms": self.p2p_latency_ms, "bandwidth_gb_per_s": self.p2p_bandwidth_gb_per_s},
            "runtime": self.runtime.to_json(),
        }
        if self.info:
            data["machine"] = self.info
        return data

    @classmethod
    def from_json(cls, data: Any) -> Machine:
        """A machine file's content; ValueError naming the field. The other fields of the costs
        format (``stages``, ``layers``, ``overlap``, ``micro_batch_size``) are checked as the
        costs file's are, and not used: the stage costs come from ``--costs``."""
        check_head(data, "machine file")
        if data.get("runtime") is None:
            raise ValueError("no 'runtime' object (write one with hyper-parallel calibrate)")
        latency, bandwidth = read_p2p(data)
        read_entries(data)
        read_settings(data)
        return cls(RuntimeCosts.from_json(data["runtime"]), latency, bandwidth, data.get("machine"))


def load_machine(path: str | os.PathLike[str]) -> Machine:
    """Read a machine file; ValueError naming the file (and the field) on bad content."""
    try:
        data = read_json(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return Machine.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_machine(machine: Machine, path: str | os.PathLike[str]) -> None:
    """Write a machine file (the JSON `load_machine` reads)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(machine.to_json(), f, indent=2)
        f.write("\n")
