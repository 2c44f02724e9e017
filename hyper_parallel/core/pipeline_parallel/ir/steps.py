"""Schedule IR: `MetaStep`, its text form and the data flow of each step.

Text form of one step (``str(step)`` / ``MetaStep.from_str``)::

    CODE[SUB+SUB+...].s<stage>.m<micro>

where every part after ``CODE`` is optional: ``F.s0.m1`` (forward, stage 0, micro 1),
``RECV_B.s2.m3``, ``FSDP_UNSHARD.s0`` (no micro), ``BATCH[SEND_F.s0.m1+RECV_B.s0.m0]``,
``OVERLAP_B_F[B.s1.m0+F.s1.m2]``, ``SEND_META.s0.m0`` (the shapes of a forward output, sent
ahead of it). ``CODE[]`` is a composite with no sub-steps. The text
never contains a comma or whitespace, so it fits in a CSV cell as is.

A schedule is ``dict[rank, list[MetaStep | None]]`` (``None`` = idle slot); `schedule_csv`
reads and writes it as CSV.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.ir.placement import is_int
from typing import Union

Schedule = dict[int, list[Union["MetaStep", None]]]
DataKey = tuple[str, int, int]
"""A value flowing between stages: ``("F", s, i)`` is the forward output of stage ``s``
for micro-batch ``i``; ``("G", s, i)`` is the gradient of the input of stage ``s``;
``("W", s, i)`` marks that stage ``s`` finished its weight gradient for micro-batch ``i``;
``("M", s, i)`` is the metadata (shapes, dtypes) of ``("F", s, i)``, sent ahead of it."""


class MetaStepType(enum.Enum):
    """Kind of a schedule step; the value is the short code used in text. Its flags (``is_comm``...)
    are computed once per member: lowering reads them millions of times for a large schedule."""

    FWD = "F"
    BWD = "B"
    BWD_INPUT = "I"
    BWD_WEIGHT = "W"
    FWD_SEND = "SEND_F"
    FWD_RECV = "RECV_F"
    BWD_SEND = "SEND_B"
    BWD_RECV = "RECV_B"
    META_SEND = "SEND_META"
    META_RECV = "RECV_META"
    BATCH_SEND_RECV = "BATCH"
    OVERLAP_B_F = "OVERLAP_B_F"
    OVERLAP_F_B = "OVERLAP_F_B"
    FSDP_UNSHARD = "FSDP_UNSHARD"
    FSDP_RESHARD = "FSDP_RESHARD"
    FSDP_REDUCE_GRAD = "FSDP_REDUCE_GRAD"
    SWAP_LAUNCH_OFFLOAD = "SWAP_LAUNCH_OFFLOAD"
    SWAP_WAIT_OFFLOAD = "SWAP_WAIT_OFFLOAD"
    SWAP_LAUNCH_LOAD = "SWAP_LAUNCH_LOAD"
    SWAP_WAIT_LOAD = "SWAP_WAIT_LOAD"
    # MPipe transpose (mpipe.py): the preprocess of micro-batch m on the rank that owns it, the
    # stage-0 inputs it makes travelling to stage 0's rank, their gradient travelling back
    PRE_FWD = "PF"
    PRE_BWD = "PB"
    PRE_SEND = "SEND_P"
    PRE_RECV = "RECV_P"
    PRE_GRAD_SEND = "SEND_PG"
    PRE_GRAD_RECV = "RECV_PG"

    # members are singletons compared by identity: hash them by identity too, in C (Enum's own
    # hash is a Python method, called for every dictionary lookup by step kind: hundreds per
    # pipeline step, millions in a large lowering)
    __hash__ = object.__hash__

    @property
    def code(self) -> str:
        """Short code used in the text form."""
        return self.value

    @functools.cached_property
    def is_compute(self) -> bool:
        """True for F, B, I, W and the OVERLAP composites."""
        return self in _COMPUTE

    @functools.cached_property
    def is_comm(self) -> bool:
        """True for the four point-to-point steps and BATCH."""
        return self in _COMM

    @functools.cached_property
    def is_overlap(self) -> bool:
        """True for OVERLAP_B_F and OVERLAP_F_B."""
        return self in (MetaStepType.OVERLAP_B_F, MetaStepType.OVERLAP_F_B)

    @functools.cached_property
    def is_send(self) -> bool:
        """True for FWD_SEND, BWD_SEND and META_SEND."""
        return self in (MetaStepType.FWD_SEND, MetaStepType.BWD_SEND, MetaStepType.META_SEND)

    @functools.cached_property
    def is_recv(self) -> bool:
        """True for FWD_RECV, BWD_RECV and META_RECV."""
        return self in (MetaStepType.FWD_RECV, MetaStepType.BWD_RECV, MetaStepType.META_RECV)

    @functools.cached_property
    def is_meta(self) -> bool:
        """True for META_SEND and META_RECV (the shapes of a forward output, sent ahead of it)."""
        return self in (MetaStepType.META_SEND, MetaStepType.META_RECV)

    @functools.cached_property
    def towards_next(self) -> bool:
        """Whether a send/recv step talks to the next stage (else to the previous one)."""
        return self in (MetaStepType.FWD_SEND, MetaStepType.META_SEND, MetaStepType.BWD_RECV)


_T = MetaStepType
_COMPUTE = frozenset({_T.FWD, _T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT, _T.OVERLAP_B_F, _T.OVERLAP_F_B})
_COMM = frozenset({
    _T.FWD_SEND, _T.FWD_RECV, _T.BWD_SEND, _T.BWD_RECV, _T.META_SEND, _T.META_RECV, _T.BATCH_SEND_RECV,
})
_BY_CODE = {t.code: t for t in MetaStepType}


def _check_index(name: str, value: object) -> None:
    if value is not None and not is_int(value):
        raise TypeError(f"MetaStep.{name} must be an int or None, got {value!r}")


_new = object.__new__
_set = object.__setattr__


def _checked(micro_index: object, meta_type: object, stage_index: object, sub_steps: object
             ) -> tuple[MetaStep, ...] | None:
    """MetaStep's argument checks (TypeError naming the field), in field order; the sub-steps as a
    tuple."""
    if not isinstance(meta_type, MetaStepType):
        raise TypeError(f"MetaStep.meta_type must be a MetaStepType, got {meta_type!r}")
    _check_index("micro_index", micro_index)
    _check_index("stage_index", stage_index)
    if sub_steps is None:
        return None
    subs = tuple(sub_steps)  # type: ignore[call-overload]
    for sub in subs:
        if not isinstance(sub, MetaStep):
            raise TypeError(f"MetaStep.sub_steps must hold MetaSteps, got {sub!r}")
    return subs


@dataclass(frozen=True, repr=False)
class MetaStep:
    """One step of a per-rank schedule; hashable, compared by value."""

    micro_index: int | None
    meta_type: MetaStepType
    stage_index: int | None
    sub_steps: tuple[MetaStep, ...] | None = None

    # Written out, so `dataclass` keeps it instead of generating one that sets the fields and then
    # calls __post_init__ to check them: millions are made, nearly all of plain ints and no
    # sub-steps, which need no check. Anything else goes through the checks of __post_init__, in
    # the same order with the same errors; the fields are set in order, one by one, as the
    # generated __init__ sets them (the same instance layout).
    def __init__(
        self,
        micro_index: int | None,
        meta_type: MetaStepType,
        stage_index: int | None,
        sub_steps: tuple[MetaStep, ...] | None = None,
    ) -> None:
        if sub_steps is not None or type(meta_type) is not MetaStepType \
                or not (micro_index is None or type(micro_index) is int) \
                or not (stage_index is None or type(stage_index) is int):
            sub_steps = _checked(micro_index, meta_type, stage_index, sub_steps)
        _set(self, "micro_index", micro_index)
        _set(self, "meta_type", meta_type)
        _set(self, "stage_index", stage_index)
        _set(self, "sub_steps", sub_steps)

    def __post_init__(self) -> None:
        """The checks, for the ``__init__`` a dataclass subclass generates (it sets the fields, then
        calls this); MetaStep's own ``__init__`` makes them before setting the fields."""
        sub_steps = _checked(self.micro_index, self.meta_type, self.stage_index, self.sub_steps)
        if sub_steps is not None:
            _set(self, "sub_steps", sub_steps)

    def __str__(self) -> str:
        text = self.meta_type.code
        if self.sub_steps is not None:
            text += "[" + "+".join(str(sub) for sub in self.sub_steps) + "]"
        if self.stage_index is not None:
            text += f".s{self.stage_index}"
        if self.micro_index is not None:
            text += f".m{self.micro_index}"
        return text

    def __repr__(self) -> str:
        return f"<MetaStep {self}>"

    @classmethod
    def from_str(cls, text: str) -> MetaStep:
        """Parse the text form written by ``str(step)``; raise ValueError on bad text."""
        if not isinstance(text, str):
            raise ValueError(f"cannot parse {text!r} as a MetaStep: not a string")
        source = text.strip()
        try:
            step, end = _parse_step(source, 0)
        except _ParseError as exc:
            raise ValueError(f"cannot parse {text!r} as a MetaStep: {exc}") from None
        if end != len(source):
            raise ValueError(f"cannot parse {text!r} as a MetaStep: unexpected {source[end:]!r}")
        return step

    @property
    def parts(self) -> tuple[MetaStep, ...]:
        """The compute steps this step runs: its sub-steps for OVERLAP, itself for
        F/B/I/W, nothing for any other type."""
        if self.meta_type.is_overlap:
            return self.sub_steps or ()
        return (self,) if self.meta_type.is_compute else ()

    @property
    def comm_parts(self) -> tuple[MetaStep, ...]:
        """The point-to-point ops of this step: BATCH sub-steps, itself for a plain
        send/recv, nothing otherwise."""
        if self.meta_type is MetaStepType.BATCH_SEND_RECV:
            return self.sub_steps or ()
        return (self,) if self.meta_type.is_comm else ()


def unchecked_step(
    micro_index: int | None,
    meta_type: MetaStepType,
    stage_index: int | None,
    sub_steps: tuple[MetaStep, ...] | None = None,
) -> MetaStep:
    """``MetaStep(micro_index, meta_type, stage_index, sub_steps)`` without the argument checks, for
    a caller that passes a `MetaStepType`, plain ints (or None) it made itself and a tuple of
    MetaSteps or None: the schedule generators make millions. The fields are set as ``__init__``
    sets them, so the step is the same in every respect."""
    step = _new(MetaStep)
    _set(step, "micro_index", micro_index)
    _set(step, "meta_type", meta_type)
    _set(step, "stage_index", stage_index)
    _set(step, "sub_steps", sub_steps)
    return step


class _ParseError(Exception):
    pass


_CODE_RE = re.compile(r"[A-Z][A-Z_]*")
_FIELD_RE = re.compile(r"\.([sm])(-?\d+)")


def _parse_step(text: str, pos: int) -> tuple[MetaStep, int]:
    match = _CODE_RE.match(text, pos)
    if match is None:
        raise _ParseError(f"expected a step code at position {pos}")
    meta_type = _BY_CODE.get(match.group())
    if meta_type is None:
        raise _ParseError(f"unknown step code {match.group()!r}")
    pos = match.end()
    subs: list[MetaStep] | None = None
    if pos < len(text) and text[pos] == "[":
        subs, pos = _parse_subs(text, pos + 1)
    fields: dict[str, int] = {}
    for key in "sm":
        field = _FIELD_RE.match(text, pos)
        if field is not None and field.group(1) == key:
            fields[key] = int(field.group(2))
            pos = field.end()
    return MetaStep(fields.get("m"), meta_type, fields.get("s"), subs), pos


def _parse_subs(text: str, pos: int) -> tuple[list[MetaStep], int]:
    subs: list[MetaStep] = []
    if text.startswith("]", pos):
        return subs, pos + 1
    while True:
        sub, pos = _parse_step(text, pos)
        subs.append(sub)
        if text.startswith("+", pos):
            pos += 1
        elif text.startswith("]", pos):
            return subs, pos + 1
        else:
            raise _ParseError(f"expected '+' or ']' at position {pos}")


# --- data flow -------------------------------------------------------------------------------


def consumes(part: MetaStep, num_stages: int) -> list[DataKey]:
    """Values a compute part (F/B/I/W) needs before it can run."""
    stage, micro, kind = part.stage_index, part.micro_index, part.meta_type
    if stage is None or micro is None:
        return []
    if kind is MetaStepType.FWD:
        return [("F", stage - 1, micro)] if stage > 0 else []
    if kind in (MetaStepType.BWD, MetaStepType.BWD_INPUT):
        needs = [("F", stage, micro)]
        if stage < num_stages - 1:
            needs.append(("G", stage + 1, micro))
        return needs
    if kind is MetaStepType.BWD_WEIGHT:
        return [("G", stage, micro)]
    return []


def produces(part: MetaStep) -> list[DataKey]:
    """Values a compute part (F/B/I/W) makes available once it finished."""
    stage, micro, kind = part.stage_index, part.micro_index, part.meta_type
    if stage is None or micro is None:
        return []
    if kind is MetaStepType.FWD:
        return [("F", stage, micro)]
    if kind is MetaStepType.BWD:
        return [("G", stage, micro), ("W", stage, micro)]
    if kind is MetaStepType.BWD_INPUT:
        return [("G", stage, micro)]
    if kind is MetaStepType.BWD_WEIGHT:
        return [("W", stage, micro)]
    return []


def message_key(op: MetaStep) -> DataKey | None:
    """The value a send/recv step carries (None for other steps or missing indices).

    FWD_SEND(s, i) and FWD_RECV(s + 1, i) both carry ``("F", s, i)``;
    META_SEND(s, i) and META_RECV(s + 1, i) both carry ``("M", s, i)``;
    BWD_SEND(s, i) and BWD_RECV(s - 1, i) both carry ``("G", s, i)``.
    """
    stage, micro = op.stage_index, op.micro_index
    entry = _MESSAGES.get(op.meta_type)
    if stage is None or micro is None or entry is None:
        return None
    kind, shift = entry
    return (kind, stage + shift, micro)


_MESSAGES = {
    _T.FWD_SEND: ("F", 0),
    _T.FWD_RECV: ("F", -1),
    _T.META_SEND: ("M", 0),
    _T.META_RECV: ("M", -1),
    _T.BWD_SEND: ("G", 0),
    _T.BWD_RECV: ("G", 1),
}


def consumer_stage(key: DataKey) -> int:
    """Stage that consumes a forward output (or its metadata) / input gradient carried between stages."""
    kind, stage, _ = key
    return stage - 1 if kind == "G" else stage + 1
