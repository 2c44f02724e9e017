"""Schedules as CSV files: row k holds rank k's steps, one step per cell, empty cell = idle.

Two cell styles, read in any mix (each cell is recognised on its own):

- ``"ours"``: the text form of `MetaStep` (``F.s0.m1``, ``FSDP_UNSHARD.s2``,
  ``BATCH[SEND_F.s0.m1+RECV_B.s0.m0]``); such a cell starts with a letter. Every step of
  the IR can be written this way, and reading it back gives the same steps.
- ``"torch"``: the action text of ``torch.distributed.pipelining`` (the compute-only and
  the compute+comms formats of its ``_dump_csv``): ``<stage><code><micro>`` such as ``0F1``,
  ``2SEND_B3``, a stage-only action such as ``1UNSHARD``, or the composite
  ``(<action>;<action>)OVERLAP_F_B``. Such a cell starts with a digit or ``(``.

Torch actions and the steps they map to:

=============================  ================================================
torch                          ours
=============================  ================================================
``F`` ``B`` ``I`` ``W``        FWD, BWD, BWD_INPUT, BWD_WEIGHT (micro needed)
``SEND_F`` ``RECV_F``          FWD_SEND, FWD_RECV (micro needed)
``SEND_B`` ``RECV_B``          BWD_SEND, BWD_RECV (micro needed)
``UNSHARD`` ``RESHARD``        FSDP_UNSHARD, FSDP_RESHARD (stage only)
``REDUCE_GRAD``                FSDP_REDUCE_GRAD (stage only)
``(a;b)OVERLAP_F_B``           OVERLAP_F_B with sub-steps a, b (no stage, no micro)
=============================  ================================================

Both libraries give a point-to-point step the stage index of the rank that runs it:
``SEND_F``/``SEND_B`` carry the sender's stage, ``RECV_F`` the receiver's stage (data comes
from stage - 1) and ``RECV_B`` the receiver's stage (data comes from stage + 1), so the
indices are copied unchanged.

Writing in torch style:

- ``BATCH[...]`` is written as its sub-steps, in order, one cell each. Torch has no
  batched-P2P action: its runtime posts every SEND/RECV action without waiting at the
  moment it reaches it (a receive is waited by the compute that consumes it, a send at the
  end of the step), so a run of P2P actions is posted together, as one of our BATCH steps
  is. Reading such a file back gives the separate send/recv steps, not the BATCH.
- A step torch has no action for (OVERLAP_B_F, the swap steps, a composite nested in a
  composite, a step missing the stage or micro-batch index torch needs or holding one it
  has no place for) raises ValueError naming the step, its rank and its position.
"""

from __future__ import annotations

import csv
import io
import os
import re

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule

STYLES = ("ours", "torch")

_T = MetaStepType
_TO_TORCH: dict[MetaStepType, str] = {
    _T.FWD: "F",
    _T.BWD: "B",
    _T.BWD_INPUT: "I",
    _T.BWD_WEIGHT: "W",
    _T.FWD_SEND: "SEND_F",
    _T.FWD_RECV: "RECV_F",
    _T.BWD_SEND: "SEND_B",
    _T.BWD_RECV: "RECV_B",
    _T.FSDP_UNSHARD: "UNSHARD",
    _T.FSDP_RESHARD: "RESHARD",
    _T.FSDP_REDUCE_GRAD: "REDUCE_GRAD",
}
_FROM_TORCH = {code: kind for kind, code in _TO_TORCH.items()}
_STAGE_ONLY = frozenset({_T.FSDP_UNSHARD, _T.FSDP_RESHARD, _T.FSDP_REDUCE_GRAD})
_TORCH_COMPOSITE = "OVERLAP_F_B"
_COMPOSITES = frozenset({_T.BATCH_SEND_RECV, _T.OVERLAP_B_F, _T.OVERLAP_F_B})

_TORCH_ACTION_RE = re.compile(r"(\d+)(" + "|".join(sorted(_FROM_TORCH, key=len, reverse=True)) + r")(\d*)")
_TORCH_COMPOSITE_RE = re.compile(r"\(([^()]*)\)([A-Za-z_]*)")


# --- one cell --------------------------------------------------------------------------------


def _parse_torch_action(text: str) -> MetaStep:
    match = _TORCH_ACTION_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"cannot parse {text!r}: neither our step text nor a torch.distributed.pipelining action "
            "(<stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD><micro>)"
        )
    stage, code, micro = match.groups()
    kind = _FROM_TORCH[code]
    if kind in _STAGE_ONLY and micro:
        raise ValueError(f"cannot parse {text!r}: torch's {code} takes no micro-batch index")
    if kind not in _STAGE_ONLY and not micro:
        raise ValueError(f"cannot parse {text!r}: torch's {code} needs a micro-batch index")
    return MetaStep(int(micro) if micro else None, kind, int(stage))


def _parse_torch_cell(text: str) -> MetaStep:
    composite = _TORCH_COMPOSITE_RE.fullmatch(text)
    if composite is None:
        return _parse_torch_action(text)
    inner, code = composite.groups()
    if code != _TORCH_COMPOSITE:
        raise ValueError(f"cannot parse {text!r}: the only torch composite action is {_TORCH_COMPOSITE}, got {code!r}")
    subs = tuple(_parse_torch_action(part.strip()) for part in inner.split(";") if part.strip())
    return MetaStep(None, _T.OVERLAP_F_B, None, subs)


def parse_cell(text: str) -> MetaStep | None:
    """One CSV cell: our text form, a torch action (``2I1``, ``1UNSHARD``,
    ``(0F3;3B1)OVERLAP_F_B``), or an empty cell (None). Raise ValueError on bad text."""
    cell = text.strip()
    if not cell:
        return None
    if cell[0].isdigit() or cell[0] == "(":
        return _parse_torch_cell(cell)
    return MetaStep.from_str(cell)


def _cannot(step: MetaStep, why: str) -> ValueError:
    return ValueError(f"cannot write {step} in torch style: {why}")


def _torch_action(step: MetaStep, whole: MetaStep) -> str:
    if step is not whole and (step.sub_steps is not None or step.meta_type in _COMPOSITES):
        raise _cannot(whole, f"{whole.meta_type.code} may hold only plain actions in torch style, not {step}")
    code = _TO_TORCH.get(step.meta_type)
    if code is None:
        raise _cannot(whole, f"torch.distributed.pipelining has no {step.meta_type.code} action")
    if step.sub_steps is not None:
        raise _cannot(whole, f"torch's {code} has no sub-actions")
    if step.stage_index is None or step.stage_index < 0:
        raise _cannot(whole, f"torch's {code} needs a non-negative stage index")
    if step.meta_type in _STAGE_ONLY:
        if step.micro_index is not None:
            raise _cannot(whole, f"torch's {code} takes no micro-batch index")
        return f"{step.stage_index}{code}"
    if step.micro_index is None or step.micro_index < 0:
        raise _cannot(whole, f"torch's {code} needs a non-negative micro-batch index")
    return f"{step.stage_index}{code}{step.micro_index}"


def _torch_cells(step: MetaStep) -> list[str]:
    kind = step.meta_type
    if kind is _T.BATCH_SEND_RECV:
        if step.stage_index is not None or step.micro_index is not None:
            raise _cannot(step, "a BATCH is written as its sub-steps and has no place for its own indices")
        return [_torch_action(sub, step) for sub in step.sub_steps or ()]
    if kind is _T.OVERLAP_F_B:
        if step.stage_index is not None or step.micro_index is not None:
            raise _cannot(step, "torch's OVERLAP_F_B carries neither a stage nor a micro-batch index")
        if not step.sub_steps:
            raise _cannot(step, "torch's OVERLAP_F_B needs at least one sub-action")
        return ["(" + ";".join(_torch_action(sub, step) for sub in step.sub_steps) + f"){_TORCH_COMPOSITE}"]
    return [_torch_action(step, step)]


# --- whole schedules -------------------------------------------------------------------------


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def _row(steps: list[MetaStep | None], rank: int, style: str) -> list[str]:
    if style == "ours":
        return ["" if step is None else str(step) for step in steps]
    cells: list[str] = []
    for position, step in enumerate(steps):
        if step is None:
            cells.append("")
            continue
        try:
            cells.extend(_torch_cells(step))
        except ValueError as exc:
            raise ValueError(f"rank {rank}, position {position}: {exc}") from None
    return cells


def format_schedule_csv(schedule: Schedule, style: str = "ours") -> str:
    """CSV text with one row per rank (ranks must be 0..n-1), empty cell = idle.

    ``style="ours"`` writes `MetaStep` text; ``style="torch"`` writes the actions of
    ``torch.distributed.pipelining`` (see the module docstring for the mapping, how BATCH is
    written and which steps raise ValueError)."""
    _check_style(style)
    ranks = sorted(schedule)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"schedule ranks must be 0..n-1 to be written as CSV, got {ranks}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in ranks:
        writer.writerow(_row(schedule[rank], rank, style))
    return out.getvalue()


def parse_schedule_csv(text: str) -> Schedule:
    """Inverse of `format_schedule_csv`; row k is rank k. Cells of either style, mixed freely."""
    schedule: Schedule = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        steps: list[MetaStep | None] = []
        for column, cell in enumerate(row):
            try:
                steps.append(parse_cell(cell))
            except ValueError as exc:
                raise ValueError(f"row {rank} of the schedule CSV, column {column}: {exc}") from None
        schedule[rank] = steps
    return schedule


def save_schedule_csv(path: str | os.PathLike[str], schedule: Schedule, style: str = "ours") -> None:
    """Write `format_schedule_csv(schedule, style)` to ``path``."""
    text = format_schedule_csv(schedule, style)
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)


def load_schedule_csv(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule CSV written by `save_schedule_csv` (either style) or by torch's ``_dump_csv``."""
    with open(path, encoding="utf-8", newline="") as handle:
        return parse_schedule_csv(handle.read())
