"""Where a pipeline gathers, frees and reduces the parameters of its stages (a lowering pass, no tensors).

For every rank's lowered list:

* ``FSDP_UNSHARD.s<s>`` when stage ``s`` enters the *window* of a compute step: the first
  ``lookahead`` distinct fully sharded stages among that step and the ones after it (the stages of
  the step itself are always in). A stage entering the window one compute step ahead of its own is
  gathered while the step before runs;
* ``FSDP_RESHARD.s<s>`` when it leaves the window, and at the end of the list for the stages still
  gathered;
* ``FSDP_REDUCE_GRAD.s<s>`` once per run after the last backward (B, I or W) of every data-parallel
  stage (fully sharded or not).

All of them go into the gap right after a compute step and the sends that directly follow it (so the
neighbours get their data first), before the receives and metadata waits of the next compute step;
the window moves for the first compute step go at the very start.

Forward-only lists (``eval``) get the window and no reduction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType

_T = MetaStepType
_BACKWARD = (_T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT)


def _stages(step: MetaStep) -> list[int]:
    return [part.stage_index for part in step.parts if part.stage_index is not None]


def _is_send_only(step: MetaStep) -> bool:
    parts = step.comm_parts
    return bool(parts) and all(part.meta_type.is_send for part in parts)


def _window(stage_runs: Sequence[list[int]], k: int, sharded: set[int], lookahead: int) -> list[int]:
    """The fully sharded stages to hold gathered for compute step ``k``, in order of first use."""
    window: list[int] = [s for s in dict.fromkeys(stage_runs[k]) if s in sharded]
    for later in stage_runs[k + 1:]:
        if len(window) >= lookahead:
            break
        for s in later:
            if s in sharded and s not in window and len(window) < lookahead:
                window.append(s)
    return window


def insert_steps(steps: Sequence[MetaStep], sharded: Iterable[int], reduced: Iterable[int], lookahead: int,
                 forward_only: bool) -> list[MetaStep]:
    """One rank's lowered list with the FSDP / data-parallel steps inserted (see the module docstring)."""
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {lookahead}")
    sharded, reduced = set(sharded), set() if forward_only else set(reduced)
    compute = [i for i, step in enumerate(steps) if step.meta_type.is_compute]
    stage_runs = [_stages(steps[i]) for i in compute]
    last_backward: dict[int, int] = {}  # stage -> index into ``compute`` of its last backward part
    for k, i in enumerate(compute):
        for part in steps[i].parts:
            if part.meta_type in _BACKWARD and part.stage_index in reduced:
                last_backward[part.stage_index] = k
    # Steps go in the gap after a compute step and the sends that directly follow it (or at the start):
    # the reductions of that compute step first, then the window moves for the next one.
    at: dict[int, list[MetaStep]] = {}  # list position -> steps inserted before the step there
    active: list[int] = []
    position = 0
    for k, i in enumerate(compute):
        window = _window(stage_runs, k, sharded, lookahead)
        moves = [MetaStep(None, _T.FSDP_RESHARD, s) for s in sorted(s for s in active if s not in window)]
        moves += [MetaStep(None, _T.FSDP_UNSHARD, s) for s in window if s not in active]
        at.setdefault(position, []).extend(moves)
        active = window
        position = i + 1
        while position < len(steps) and _is_send_only(steps[position]):
            position += 1
        finished = sorted(s for s, last in last_backward.items() if last == k)
        at.setdefault(position, []).extend(MetaStep(None, _T.FSDP_REDUCE_GRAD, s) for s in finished)
    at.setdefault(position, []).extend(MetaStep(None, _T.FSDP_RESHARD, s) for s in sorted(active))
    out: list[MetaStep] = []
    for i, step in enumerate(steps):
        out += at.get(i, [])
        out.append(step)
    out += at.get(len(steps), [])
    return out


def insert_all(lowered: dict[int, list[MetaStep]], sharded: Iterable[int], reduced: Iterable[int], lookahead: int,
               forward_only: bool) -> dict[int, list[MetaStep]]:
    """:func:`insert_steps` on every rank's list."""
    sharded, reduced = set(sharded), set(reduced)
    return {rank: insert_steps([s for s in steps if s is not None], sharded, reduced, lookahead, forward_only)
            for rank, steps in lowered.items()}
