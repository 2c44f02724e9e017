"""What the runtime itself costs per lowered step on one machine: the ``runtime`` costs.

`hyper-parallel calibrate` measures these figures with real processes (``calibrate.py``) and
writes them, with the point-to-point link, in the costs format of ``costs.py`` (a *machine
file*, ``machine.py``). The timed model (``timed_model.py``) charges them on the steps the runtime executes, so
a simulation with a machine file predicts what ``schedule.run()`` takes. Times in milliseconds::

    "runtime": {
      "compute_ms":  {"F": 0.3, "B": 0.4, "I": 0.3, "W": 0.2},   # beyond its compute, input local
      "received_ms": {"F": 0.6, "B": 0.7, "I": 0.6, "W": 0.2},   # beyond its compute, counted from
                                                                  # the arrival of a just-received input
      "send_ms": 0.06, "recv_ms": 0.05, "wait_ms": 0.05,          # post a send / a receive; wait on arrived data
      "meta_ms": 0.3, "meta_recv_ms": 2.0, "batch_ms": 0.12,      # post a metadata send; a metadata
                                                                  # receive once its message arrived;
                                                                  # post one batched group
      "run_ms": 1.0                                               # once per run (set-up, last sends)
    }

How a rank's clock advances (every cost counted from the end of the previous step, so the
runtime's own book-keeping between two steps is part of the next step's cost):

- a data send or receive step (``SEND_F``/``SEND_B``/``RECV_F``/``RECV_B``) takes ``send_ms``
  / ``recv_ms``; a ``BATCH`` group ``batch_ms``; ``SEND_META`` ``meta_ms``; a ``RECV_META``
  waits for its message and then takes ``meta_recv_ms`` (with what the first data receive
  behind it costs beyond ``recv_ms``: its buffers are made from the shapes that just came);
  a message leaves when its post begins;
- a compute step of kind k whose inputs are all local ends at ``clock + compute + compute_ms[k]``;
  with ``n`` received inputs it ends at
  ``max(clock + n * wait_ms + compute + compute_ms[k], arrival + compute + received_ms[k])``,
  ``arrival`` being when the last of them arrived (post start + message time): the first term is
  a wait on data already there, the second the hand-over of data that just came;
- a rank finishes ``run_ms`` after its last step.

An overlapped pair (``OVERLAP_B_F``) costs the sum over its parts. With runtime costs the
simulator also runs the first stage's whole backward in its W step, as the runtime does (that
stage has no input gradient, so its I computes nothing), whenever a ``runtime`` object is given,
even one whose fields are all 0 (so raising any figure from 0 never shortens a prediction).
Without a ``runtime`` object the simulation is exactly the one of old, without runtime costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType

_T = MetaStepType
KINDS = ("F", "B", "I", "W")
KIND_OF = {_T.FWD: "F", _T.BWD: "B", _T.BWD_INPUT: "I", _T.BWD_WEIGHT: "W"}
SCALARS = ("send_ms", "recv_ms", "wait_ms", "meta_ms", "meta_recv_ms", "batch_ms", "run_ms")
PER_KIND = ("compute_ms", "received_ms")


def non_negative(name: str, value: Any, allow_none: bool = False) -> Any:
    """``value`` as a float when it is a finite number >= 0 (None too with ``allow_none``);
    ValueError naming the field otherwise. The one check of every figure of a costs or machine file."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


RUNTIME_LOWERING: dict[str, Any] = {"prefetch": True, "metadata": "first"}
"""How ``schedule.run()`` lowers by default (``overlap_p2p=True``, static shapes): simulate so."""


def run_lowering(transport: str, runtime: bool, overlap_p2p: bool = True) -> dict[str, Any]:
    """The `lower` options for simulating the lists ``schedule.run(overlap_p2p=...)`` executes on
    ``transport`` (receives posted ahead with ``overlap_p2p``; shapes sent for the first micro-batch).

    One exception, without runtime costs (``runtime`` false) on ``plain``: the lists without
    prefetch or metadata. There a post costs nothing and a message leaves when its send is
    posted, wherever its receive is, so both lists give every compute step the same times, and
    these are several times cheaper to lower for the whole job (4 s against 16 s at p = 64,
    v = 4, m = 1024). On ``batch`` the lists differ in time: without prefetch a receive goes into
    the stream's group of its boundary and waits there (docs/tools.md, simulate: 928 ms without
    against 270 ms with, for 210 ms of compute)."""
    if transport == "plain" and not runtime:
        return {}
    return {"prefetch": bool(overlap_p2p), "metadata": "first"}


@dataclass(frozen=True)
class PerKind:
    """One figure per compute kind (forward, backward, input backward, weight backward)."""

    F: float = 0.0
    B: float = 0.0
    I: float = 0.0  # noqa: E741 - the paper's name for the input backward
    W: float = 0.0

    def get(self, kind: str) -> float:
        return float(getattr(self, kind))

    def to_json(self) -> dict[str, float]:
        return {k: self.get(k) for k in KINDS}

    @classmethod
    def from_json(cls, data: Any, where: str) -> PerKind:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            value = non_negative(where, data)
            return cls(value, value, value, value)
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object with F, B, I, W (ms) or one number, got {data!r}")
        bad = sorted(set(data) - set(KINDS))
        if bad:
            raise ValueError(f"{where}: unknown field(s) {', '.join(bad)}; valid: F, B, I, W")
        return cls(**{k: non_negative(f"{where}.{k}", data.get(k, 0.0)) for k in KINDS})


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's own cost per lowered step (see the module docstring)."""

    compute_ms: PerKind = PerKind()
    received_ms: PerKind = PerKind()
    send_ms: float = 0.0
    recv_ms: float = 0.0
    wait_ms: float = 0.0
    meta_ms: float = 0.0
    meta_recv_ms: float = 0.0
    batch_ms: float = 0.0
    run_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in SCALARS:
            object.__setattr__(self, name, non_negative(f"runtime.{name}", getattr(self, name)))
        for name in PER_KIND:
            if not isinstance(getattr(self, name), PerKind):
                raise TypeError(f"runtime.{name} must be a PerKind, got {getattr(self, name)!r}")

    def compute_cost(self, step: MetaStep, received: bool = False) -> float:
        """What a compute step costs beyond its compute (``received``: counted from the arrival
        of its input, which only the first part of an overlapped pair consumes)."""
        parts = step.parts
        total = sum(self.compute_ms.get(KIND_OF.get(p.meta_type, "F")) for p in parts)
        if received and parts:
            first = KIND_OF.get(parts[0].meta_type, "F")
            total += self.received_ms.get(first) - self.compute_ms.get(first)
        return total

    def post_cost(self, step: MetaStep) -> float:
        """What issuing a communication step costs the rank's thread."""
        kind = step.meta_type
        if kind is _T.BATCH_SEND_RECV:
            return self.batch_ms
        if kind.is_meta:
            return self.meta_ms if kind.is_send else 0.0  # a metadata receive: meta_recv_ms once arrived
        return self.send_ms if kind.is_send else self.recv_ms

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: getattr(self, name).to_json() for name in PER_KIND}
        data.update({name: getattr(self, name) for name in SCALARS})
        return data

    @classmethod
    def from_json(cls, data: Any) -> RuntimeCosts:
        if not isinstance(data, dict):
            raise ValueError(f"runtime must be an object of per-step costs (ms), got {data!r}")
        bad = sorted(set(data) - set(SCALARS) - set(PER_KIND))
        if bad:
            raise ValueError(f"unknown runtime field(s) {', '.join(bad)}; valid: {', '.join(PER_KIND + SCALARS)}")
        kinds = {name: PerKind.from_json(data.get(name, 0.0), f"runtime.{name}") for name in PER_KIND}
        return cls(**kinds, **{name: non_negative(f"runtime.{name}", data.get(name, 0.0)) for name in SCALARS})
