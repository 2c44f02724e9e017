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

from hyper_parallel.core.pipeline_parallel.simulation.costs import FORMAT, CostModel, _number
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import RuntimeCosts


@dataclass(frozen=True)
class Machine:
    """A machine file: the link, the runtime's costs, and what was calibrated (free-form)."""

    runtime: RuntimeCosts
    p2p_latency_ms: float = 0.0
    p2p_bandwidth_gb_per_s: float | None = None
    info: dict[str, Any] | None = None

    def apply(self, costs: CostModel) -> CostModel:
        """``costs`` with this machine's link and runtime costs (they replace the costs file's)."""
        return replace(costs, p2p_latency_ms=self.p2p_latency_ms, p2p_bandwidth_gb_per_s=self.p2p_bandwidth_gb_per_s,
                       runtime=self.runtime)

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
        if not isinstance(data, dict):
            raise ValueError(f"a machine file holds a JSON object, got {type(data).__name__}")
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}; expected {FORMAT!r}")
        unknown = sorted(set(data) - {"format", "comment", "p2p", "runtime", "machine", "micro_batch_size",
                                      "overlap", "stages", "layers"})
        if unknown:
            raise ValueError(f"unknown field(s) in the machine file: {', '.join(unknown)}")
        if "runtime" not in data:
            raise ValueError("no 'runtime' object (write one with hyper-parallel calibrate)")
        p2p = data.get("p2p") or {}
        if not isinstance(p2p, dict):
            raise ValueError(f"p2p must be an object with latency_ms and bandwidth_gb_per_s, got {p2p!r}")
        bad = sorted(set(p2p) - {"latency_ms", "bandwidth_gb_per_s"})
        if bad:
            raise ValueError(f"unknown p2p field(s): {', '.join(bad)}; valid: latency_ms, bandwidth_gb_per_s")
        latency = _number("p2p.latency_ms", p2p.get("latency_ms", 0.0))
        bandwidth = _number("p2p.bandwidth_gb_per_s", p2p.get("bandwidth_gb_per_s"), allow_none=True)
        if bandwidth == 0:
            raise ValueError("p2p.bandwidth_gb_per_s must be > 0 (leave it out for an infinitely fast link), got 0")
        info = data.get("machine")
        if info is not None and not isinstance(info, dict):
            raise ValueError(f"machine must be an object, got {info!r}")
        return cls(RuntimeCosts.from_json(data["runtime"]), latency, bandwidth, info)


def load_machine(path: str | os.PathLike[str]) -> Machine:
    """Read a machine file; ValueError naming the file (and the field) on bad content."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return Machine.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_machine(machine: Machine, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(machine.to_json(), f, indent=2)
        f.write("\n")
