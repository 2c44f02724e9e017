"""Costs of a pipeline for the simulator: per-stage step times, memory, point-to-point links.

Time is in milliseconds everywhere (the default uniform costs, F = 1 and B = 2 for one rank's
share of the model, read as milliseconds too). Bytes are bytes.

The costs file (JSON, ``format: hyper-parallel-costs/1``)::

    {
      "format": "hyper-parallel-costs/1",
      "micro_batch_size": 4,                    # what the times were measured with (optional)
      "overlap": "sum",                         # OVERLAP_B_F / OVERLAP_F_B pair: "sum" or "max"
      "p2p": {"latency_ms": 0.02, "bandwidth_gb_per_s": 12.5},
      "stages": [                               # one entry per pipeline stage, in stage order
        {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "FB": null,
         "activation_bytes": 1048576, "activation_bytes_after_input": 524288,
         "output_bytes": 65536, "param_bytes": 4194304, "overhead_ms": 0.0}
      ],
      "layers": [ ... same fields, one entry per layer (optional; see ``for_stages``) ... ]
    }

Per entry: ``F`` forward, ``B`` full backward, ``I`` input backward, ``W`` weight backward
(defaults: ``B = I + W`` when both are given, else ``2 F``; ``I = W = B / 2``); ``FB`` the time
of an overlapped forward + backward pair on this stage (a pair of two stages, as in DualPipeV,
takes the larger of their two ``FB``; default: the model's ``overlap`` rule,
``sum`` of the two parts or their ``max``); ``activation_bytes`` what one micro-batch's forward
keeps until its backward (B, or W when split); ``activation_bytes_after_input`` what is still
kept between I and W (default: all of it); ``output_bytes`` the forward output sent to the next
stage (its gradient coming back has the same size); ``param_bytes`` the stage's parameters;
``overhead_ms`` the part of every step time that does not grow with the micro-batch size.

A message takes ``latency_ms + bytes / bandwidth``; without a bandwidth only the latency.

An optional ``"runtime"`` object holds the runtime's own cost per lowered step on a machine
(``runtime_costs.py``; `hyper-parallel calibrate` measures it); without it the runtime costs
nothing, as before. The free-form ``"machine"`` object of a machine file (``machine.py``: what
was calibrated) is read and ignored, so a machine file is a costs file too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import RuntimeCosts
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import non_negative as _number

FORMAT = "hyper-parallel-costs/1"
OVERLAP_RULES = ("sum", "max")
_T = MetaStepType
_KIND_KEYS = {_T.FWD: "F", _T.BWD: "B", _T.BWD_INPUT: "I", _T.BWD_WEIGHT: "W"}
_ENTRY_FIELDS = ("F", "B", "I", "W", "FB", "activation_bytes", "activation_bytes_after_input", "output_bytes",
                 "param_bytes", "overhead_ms")


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage (or one layer) for one micro-batch; see the module docstring."""

    F: float = 1.0
    B: float | None = None
    I: float | None = None  # noqa: E741 - the paper's name for the input backward
    W: float | None = None
    FB: float | None = None
    activation_bytes: float = 0.0
    activation_bytes_after_input: float | None = None
    output_bytes: float = 0.0
    param_bytes: float = 0.0
    overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in _ENTRY_FIELDS:
            value = getattr(self, name)
            optional = name in ("B", "I", "W", "FB", "activation_bytes_after_input")
            object.__setattr__(self, name, _number(name, value, allow_none=optional))
        full, i, w = self.B, self.I, self.W
        if full is None:
            full = i + w if i is not None and w is not None else 2.0 * self.F
        if i is None:
            i = full - w if w is not None else full / 2.0
        if w is None:
            w = full - i
        if i < 0 or w < 0:
            raise ValueError(f"stage costs B={full}, I={i}, W={w}: I and W must be >= 0 and add up to at most B")
        object.__setattr__(self, "B", full)
        object.__setattr__(self, "I", i)
        object.__setattr__(self, "W", w)
        if self.activation_bytes_after_input is None:
            object.__setattr__(self, "activation_bytes_after_input", self.activation_bytes)

    def time(self, kind: MetaStepType) -> float:
        """Time of an F, B, I or W step of this stage."""
        return float(getattr(self, _KIND_KEYS[kind]))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _ENTRY_FIELDS}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "entry") -> StageCost:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {data!r}")
        unknown = sorted(set(data) - set(_ENTRY_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(_ENTRY_FIELDS)}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def scaled(self, time_factor: float, bytes_factor: float) -> StageCost:
        """Times (above ``overhead_ms``) and per-micro-batch bytes multiplied by the factors."""
        def t(value: float | None) -> float | None:
            if value is None:
                return None
            fixed = min(self.overhead_ms, value)
            return fixed + (value - fixed) * time_factor
        return StageCost(
            F=t(self.F), B=t(self.B), I=t(self.I), W=t(self.W), FB=t(self.FB),
            activation_bytes=self.activation_bytes * bytes_factor,
            activation_bytes_after_input=self.activation_bytes_after_input * bytes_factor,
            output_bytes=self.output_bytes * bytes_factor, param_bytes=self.param_bytes,
            overhead_ms=self.overhead_ms,
        )


def combine(entries: Sequence[StageCost]) -> StageCost:
    """One stage made of consecutive layers: times, kept bytes and parameters add up; the
    output is the last layer's; an FB pair time is kept only if every layer gives one."""
    if not entries:
        raise ValueError("a stage needs at least one layer")
    fb = [e.FB for e in entries]
    return StageCost(
        F=sum(e.F for e in entries), B=sum(e.B for e in entries), I=sum(e.I for e in entries),
        W=sum(e.W for e in entries), FB=None if None in fb else sum(fb),
        activation_bytes=sum(e.activation_bytes for e in entries),
        activation_bytes_after_input=sum(e.activation_bytes_after_input for e in entries),
        output_bytes=entries[-1].output_bytes, param_bytes=sum(e.param_bytes for e in entries),
        overhead_ms=sum(e.overhead_ms for e in entries),
    )


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs, the overlap rule and the point-to-point link (see the module docstring)."""

    stages: tuple[StageCost, ...]
    p2p_latency_ms: float = 0.0
    p2p_bandwidth_gb_per_s: float | None = None
    overlap: str = "sum"
    micro_batch_size: int | None = None
    layers: tuple[StageCost, ...] = field(default=())
    runtime: RuntimeCosts | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "layers", tuple(self.layers))
        for k, entry in enumerate((*self.stages, *self.layers)):
            if not isinstance(entry, StageCost):
                raise TypeError(f"cost entry {k} must be a StageCost, got {entry!r}")
        _number("p2p_latency_ms", self.p2p_latency_ms)
        bandwidth = _number("p2p_bandwidth_gb_per_s", self.p2p_bandwidth_gb_per_s, allow_none=True)
        if bandwidth == 0:
            raise ValueError("p2p_bandwidth_gb_per_s must be > 0 (leave it out for an infinitely fast link)")
        if self.overlap not in OVERLAP_RULES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_RULES)}, got {self.overlap!r}")
        if self.micro_batch_size is not None and (
            isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int)
            or self.micro_batch_size < 1
        ):
            raise ValueError(f"micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(
        cls, num_stages: int, F: float = 1.0, B: float | None = None, I: float | None = None,  # noqa: E741
        W: float | None = None, **link: Any,
    ) -> CostModel:
        """Every stage costs the same; ``link`` takes the other CostModel fields."""
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        return cls(stages=(StageCost(F=F, B=B, I=I, W=W),) * num_stages, **link)

    @classmethod
    def per_rank_share(cls, num_ranks: int, num_chunks: int, F: float = 1.0, B: float | None = None,
                       I: float | None = None, W: float | None = None,  # noqa: E741
                       activation_bytes: float = 0.0, **link: Any) -> CostModel:
        """Uniform costs where F/B/I/W (and ``activation_bytes``) are one *rank's* share of the
        model: each of the ``num_chunks`` stages of a rank costs ``1 / num_chunks`` of it, so
        schedules with different chunk counts do the same work and compare directly."""
        share = StageCost(F=F, B=B, I=I, W=W)
        v = num_chunks
        stage = StageCost(F=share.F / v, B=share.B / v, I=share.I / v, W=share.W / v,
                          activation_bytes=activation_bytes / v)
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        return cls(stages=(stage,) * (num_ranks * v), **link)

    # ------------------------------------------------------------------ queries
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage(self, index: int) -> StageCost:
        if not 0 <= index < len(self.stages):
            raise ValueError(f"no costs for stage {index}: the cost model has {len(self.stages)} stage(s)")
        return self.stages[index]

    def step_time(self, step: MetaStep) -> float:
        """Time of a compute step (OVERLAP: its stage's FB if given, else the overlap rule)."""
        parts = step.parts
        if not parts:
            return 0.0
        if not step.meta_type.is_overlap:
            return self.stage(step.stage_index).time(step.meta_type)
        times = [self.stage(p.stage_index).time(p.meta_type) for p in parts]
        given = [self.stage(s).FB for s in sorted({p.stage_index for p in parts})]
        if all(fb is not None for fb in given):  # a pair across two stages (V placement) takes the slower one's
            return max(given)  # type: ignore[type-var]
        return sum(times) if self.overlap == "sum" else max(times)

    def message_bytes(self, key: DataKey) -> float:
        """Bytes of a message: a forward output or the gradient of that output (metadata: 0)."""
        kind, stage, _ = key
        if kind == "M":
            return 0.0
        producer = stage if kind == "F" else stage - 1  # the gradient of stage s's input
        return self.stage(producer).output_bytes if 0 <= producer < len(self.stages) else 0.0

    def message_time(self, key: DataKey) -> float:
        """Latency plus transfer time of one message."""
        nbytes = self.message_bytes(key)
        transfer = 0.0
        if self.p2p_bandwidth_gb_per_s and nbytes:
            transfer = nbytes / (self.p2p_bandwidth_gb_per_s * 1e6)  # GB/s = 1e6 bytes per ms
        return self.p2p_latency_ms + transfer

    # ------------------------------------------------------------------ reshaping
    def for_stages(self, num_stages: int, allow_even_split: bool = False) -> CostModel:
        """Costs for ``num_stages`` stages.

        The model's own stages when their number matches; one stage entry is used for every
        stage; ``layers`` are split into balanced consecutive groups (`partition`); with
        ``allow_even_split`` a model with too few entries is spread evenly: every stage gets
        ``1 / num_stages`` of the summed times, kept bytes and parameters.
        """
        if num_stages == len(self.stages):
            return self
        if len(self.stages) == 1 and not self.layers:
            return replace(self, stages=self.stages * num_stages)
        if self.layers and len(self.layers) >= num_stages:
            from hyper_parallel.core.pipeline_parallel.simulation.partition import balanced_ranges

            ranges = balanced_ranges([e.F + e.B for e in self.layers], num_stages).ranges
            return replace(self, stages=tuple(combine(self.layers[a:b]) for a, b in ranges))
        units = self.layers or self.stages
        if allow_even_split and units:
            total = combine(units)
            share = 1.0 / num_stages
            piece = StageCost(
                F=total.F * share, B=total.B * share, I=total.I * share, W=total.W * share,
                FB=None if total.FB is None else total.FB * share,
                activation_bytes=total.activation_bytes * share,
                activation_bytes_after_input=total.activation_bytes_after_input * share,
                output_bytes=sum(e.output_bytes for e in units) / len(units),
                param_bytes=total.param_bytes * share, overhead_ms=total.overhead_ms * share,
            )
            return replace(self, stages=(piece,) * num_stages)
        have = f"{len(self.stages)} stage(s)" + (f" and {len(self.layers)} layer(s)" if self.layers else "")
        raise ValueError(f"the cost model has {have}, which cannot describe {num_stages} stages; give one entry "
                         "per stage, a single entry for all stages, or at least that many 'layers'")

    def for_micro_batch_size(self, size: int) -> CostModel:
        """Times and bytes scaled linearly from ``micro_batch_size`` to ``size`` (the
        ``overhead_ms`` part of each time stays fixed)."""
        if self.micro_batch_size is None:
            raise ValueError("the cost model has no micro_batch_size to scale from")
        factor = size / self.micro_batch_size
        return replace(self, stages=tuple(s.scaled(factor, factor) for s in self.stages),
                       layers=tuple(s.scaled(factor, factor) for s in self.layers), micro_batch_size=size)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT,
            "micro_batch_size": self.micro_batch_size,
            "overlap": self.overlap,
            "p2p": {"latency_ms": self.p2p_latency_ms, "bandwidth_gb_per_s": self.p2p_bandwidth_gb_per_s},
            "stages": [s.to_json() for s in self.stages],
        }
        if self.layers:
            data["layers"] = [s.to_json() for s in self.layers]
        if self.runtime is not None:
            data["runtime"] = self.runtime.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        check_head(data, "costs file")
        latency, bandwidth = read_p2p(data)
        stages, layers = read_entries(data)
        read_settings(data)
        if not stages and not layers:
            raise ValueError("the costs file needs a non-empty 'stages' (or 'layers') list")
        if not stages:
            stages = [combine(layers)]
        runtime = RuntimeCosts.from_json(data["runtime"]) if data.get("runtime") is not None else None
        return cls(
            stages=tuple(stages), layers=tuple(layers), overlap=data.get("overlap", "sum"), runtime=runtime,
            micro_batch_size=data.get("micro_batch_size"),
            p2p_latency_ms=0.0 if latency is None else latency, p2p_bandwidth_gb_per_s=bandwidth,
        )


FIELDS = ("format", "comment", "micro_batch_size", "overlap", "p2p", "stages", "layers", "runtime", "machine")
"""The top-level fields of the costs format (``machine``: what a machine file says was calibrated)."""


def check_head(data: Any, what: str) -> None:
    """What a costs file and a machine file (``what``) both start with: a JSON object of this
    format with none but the known fields; ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"a {what} holds a JSON object, got {type(data).__name__}")
    if data.get("format", FORMAT) != FORMAT:
        raise ValueError(f"unknown costs format {data.get('format')!r}; expected {FORMAT!r}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) in the {what}: {', '.join(unknown)}")


def read_p2p(data: dict[str, Any]) -> tuple[float | None, float | None]:
    """The ``p2p`` object of a costs or machine file: (latency, bandwidth), None where not given."""
    if "p2p" not in data:
        return None, None
    p2p = data["p2p"]
    if not isinstance(p2p, dict):
        raise ValueError(f"p2p must be an object with latency_ms and bandwidth_gb_per_s, got {p2p!r}")
    bad = sorted(set(p2p) - {"latency_ms", "bandwidth_gb_per_s"})
    if bad:
        raise ValueError(f"unknown p2p field(s): {', '.join(bad)}; valid: latency_ms, bandwidth_gb_per_s")
    latency = _number("p2p.latency_ms", p2p.get("latency_ms"), allow_none=True)
    bandwidth = _number("p2p.bandwidth_gb_per_s", p2p.get("bandwidth_gb_per_s"), allow_none=True)
    if bandwidth == 0:
        raise ValueError("p2p.bandwidth_gb_per_s must be > 0 (leave it out for an infinitely fast link), got 0")
    return latency, bandwidth


def read_entries(data: dict[str, Any]) -> tuple[list[StageCost], list[StageCost]]:
    """The ``stages`` and ``layers`` lists of a costs file (each may be missing or null)."""
    found = []
    for key in ("stages", "layers"):
        entries = data.get(key)
        if entries is None:
            entries = []
        if not isinstance(entries, list):
            raise ValueError(f"{key} must be a list of objects, got {entries!r}")
        found.append([StageCost.from_json(e, f"{key}[{k}]") for k, e in enumerate(entries)])
    return found[0], found[1]


def read_settings(data: dict[str, Any]) -> None:
    """Check ``overlap``, ``micro_batch_size`` and the free-form ``machine`` object of a costs file."""
    overlap = data.get("overlap", "sum")
    if overlap not in OVERLAP_RULES:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_RULES)}, got {overlap!r}")
    size = data.get("micro_batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"micro_batch_size must be an int >= 1, got {size!r}")
    info = data.get("machine")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"machine must be an object, got {info!r}")


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON of a costs or machine file; ValueError naming the file when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def load_costs(path: str | os.PathLike[str]) -> CostModel:
    """Read a costs file; ValueError naming the file on bad content."""
    data = read_json(path)
    try:
        return CostModel.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_costs(costs: CostModel, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(costs.to_json(), f, indent=2)
        f.write("\n")


def legacy_costs(num_stages: int, costs: dict[MetaStepType, float] | None, comm_cost: float) -> CostModel:
    """A CostModel from the older per-type dict (``{FWD: 1.0, BWD: 2.0, ...}``, same for every
    stage; an OVERLAP type's entry is the pair time) and a fixed per-message ``comm_cost``."""
    table = dict(costs or {})
    for kind, value in table.items():
        if not isinstance(kind, MetaStepType):
            raise TypeError(f"cost keys must be MetaStepType, got {kind!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"cost of {kind.name} must be >= 0, got {value}")
    if isinstance(comm_cost, bool) or not isinstance(comm_cost, (int, float)) or comm_cost < 0:
        raise ValueError(f"comm_cost must be >= 0, got {comm_cost}")
    fb = {table[k] for k in (_T.OVERLAP_B_F, _T.OVERLAP_F_B) if k in table}
    if len(fb) > 1:
        raise ValueError("give one pair time for OVERLAP_B_F and OVERLAP_F_B")
    stage = StageCost(F=table.get(_T.FWD, 1.0), B=table.get(_T.BWD), I=table.get(_T.BWD_INPUT),
                      W=table.get(_T.BWD_WEIGHT), FB=next(iter(fb), None))
    return CostModel(stages=(stage,) * max(num_stages, 1), p2p_latency_ms=float(comm_cost))
