"""MPipe transpose in the simulator: a timed run of the lowered lists with their MPipe steps.

The job model of ``job_model.py`` skips step types it does not know, so it cannot see the waits
of MPipe's steps. This module runs the body steps and the MPipe steps together under the eager
rules of that model (gloo, LocalCluster, the ``plain`` transport), with time as in
``timed_model.py``:

- a compute step (F/B/I/W/OVERLAP, ``PF``, ``PB``) starts when its rank is free and its inputs
  exist (made on this rank, or a receive of them posted here whose send was issued, plus the
  message time); the stage-0 forward of micro-batch ``j`` also needs the preprocess output of
  ``j`` (``("P", 0, j)``), its backward makes that output's gradient (``("D", 0, j)``), which
  ``PB`` needs;
- a send completes when issued; a data receive is posted at its slot and waited by its consumer;
  a metadata receive waits at its slot (the data receive behind it needs the shapes);
- a rank that can never go on is reported (``ScheduleError`` naming what it waits for).

`simulate_mpipe` builds a whole MPipe schedule (the body's interleaved or 1F1B lists, lowered,
with the MPipe steps inserted) and simulates it; ``transpose=False`` simulates the plain
pipeline in the same terms (stage 0's rank preprocesses every micro-batch right before its
stage-0 forward), so the two compare directly. Costs: a `CostModel` for the body (default
`CostModel.per_rank_share`: one rank's share of the body costs F = 1, B = 2) and a preprocess of
``num_transpose_layers`` layers, each ``1 / layers_per_stage`` of one rank's share (so with
``layers_per_stage=1`` a preprocess of T layers costs T body stages); dataload-only (T = 0)
costs ``load_ms`` per micro-batch on its owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, consumes, message_key, produces
from hyper_parallel.core.pipeline_parallel.lowering.job_model import producer_text
from hyper_parallel.core.pipeline_parallel.lowering.flow import flow_of
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.features.mpipe.placement import (
    metadata_of,
    overflow_slots,
    preprocess_costs,
)
from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import (
    FEATURE,
    FEATURE_GRAD,
    MPipePlan,
    check_mpipe_steps,
    insert_mpipe_steps,
    mpipe_key,
    overflow_micros,
)
from hyper_parallel.core.pipeline_parallel.ir.placement import check_count, looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult, peak_activation_bytes, peak_activations
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError

_T = MetaStepType
Lowered = dict[int, list[MetaStep]]


class MPipeTimedModel:
    """One timed run of lowered lists with MPipe steps (see the module docstring)."""

    def __init__(self, lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan, costs: CostModel,
                 preprocess: StageCost | None = None, load_ms: float = 0.0) -> None:
        self.steps = {rank: [s for s in items if s is not None] for rank, items in lowered.items()}
        self.ranks = sorted(self.steps)
        self.stage_to_rank = stage_to_rank
        self.num_stages = len(stage_to_rank)
        self.plan = plan
        self.costs = costs.for_stages(self.num_stages)
        self.pre = preprocess or StageCost(F=0.0, B=0.0)
        self.load_ms = load_ms
        self.zero = stage_to_rank[0]
        self.cursor = dict.fromkeys(self.ranks, 0)
        self.clock = dict.fromkeys(self.ranks, 0.0)
        self.made: dict[tuple[int, DataKey], float] = {}
        self.sent: dict[DataKey, float] = {}
        self.posted: dict[tuple[int, DataKey], float] = {}
        self.waits: dict[int, str] = {}
        self.timeline: dict[int, list[tuple[float, float, MetaStep]]] = {rank: [] for rank in self.ranks}
        self.records: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ what a step needs and makes
    def _data(self, step: MetaStep) -> tuple[list[DataKey], list[DataKey]]:
        kind, j = step.meta_type, step.micro_index
        if kind is _T.PRE_FWD:
            return [], [(FEATURE, 0, j)]
        if kind is _T.PRE_BWD:
            return [(FEATURE_GRAD, 0, j)], []
        needs: list[DataKey] = []
        makes: list[DataKey] = []
        for part in step.parts:
            needs += consumes(part, self.num_stages)
            makes += produces(part)
            if part.stage_index == 0 and part.meta_type is _T.FWD:
                needs.append((FEATURE, 0, part.micro_index))
            if part.stage_index == 0 and part.meta_type in (_T.BWD, _T.BWD_INPUT):
                makes.append((FEATURE_GRAD, 0, part.micro_index))
        return needs, makes

    def _cost(self, rank: int, step: MetaStep) -> float:
        kind = step.meta_type
        if kind is _T.PRE_FWD:
            return self.pre.F + self.load_ms
        if kind is _T.PRE_BWD:
            recompute = self.plan.backward == "recompute" and self.plan.owner(step.micro_index) != rank
            return self.pre.B + (self.pre.F if recompute else 0.0)
        return self.costs.step_time(step)

    def _message_time(self, key: DataKey) -> float:
        if key[0] in (FEATURE, FEATURE_GRAD):
            return self.costs.p2p_latency_ms
        return self.costs.message_time(key)

    # ------------------------------------------------------------------ driver
    def run(self) -> dict[int, tuple[int, str]]:
        """Advance every rank as far as it goes; returns the stuck ranks (index, what it waits for)."""
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                while self.cursor[rank] < len(self.steps[rank]) and self._advance(rank):
                    progress = True
        return {rank: (self.cursor[rank], self.waits.get(rank, "?")) for rank in self.ranks
                if self.cursor[rank] < len(self.steps[rank])}

    def _available(self, rank: int, key: DataKey) -> float | None:
        if (rank, key) in self.made:
            return self.made[(rank, key)]
        posted = self.posted.get((rank, key))
        if posted is None or key not in self.sent:
            return None
        return max(posted, self.sent[key] + self._message_time(key))

    def _advance(self, rank: int) -> bool:
        step = self.steps[rank][self.cursor[rank]]
        kind = step.meta_type
        now = self.clock[rank]
        if kind.is_compute or kind in (_T.PRE_FWD, _T.PRE_BWD):
            needs, makes = self._data(step)
            ready = now
            for key in needs:
                at = self._available(rank, key)
                if at is None:
                    state = "its send" if (rank, key) in self.posted else "a receive posted here or a step of this rank"
                    self.waits[rank] = f"{_describe(key)} (needs {state})"
                    return False
                ready = max(ready, at)
            end = ready + self._cost(rank, step)
            if ready > now:
                self.records.append(_record(rank, step, "p2p-wait", now, ready))
            self.timeline[rank].append((ready, end, step))
            self.records.append(_record(rank, step, "compute", ready, end))
            for key in makes:
                self.made[(rank, key)] = end
            self.clock[rank] = end
        elif kind in (_T.PRE_SEND, _T.PRE_GRAD_SEND, _T.PRE_RECV, _T.PRE_GRAD_RECV) or kind.is_comm:
            ops = [step] if mpipe_key(step) is not None else list(step.comm_parts)
            for op in ops:
                key = mpipe_key(op) or message_key(op)
                if op.meta_type is _T.META_RECV:
                    if key not in self.sent:
                        self.waits[rank] = f"the shapes of {_describe(('F', key[1], key[2]))}"
                        return False
                    self.clock[rank] = max(self.clock[rank], self.sent[key] + self._message_time(key))
                elif op.meta_type.is_send or op.meta_type in (_T.PRE_SEND, _T.PRE_GRAD_SEND):
                    data = key if key[0] != "M" else ("F", key[1], key[2])
                    if (rank, data) not in self.made:
                        self.waits[rank] = f"{_describe(data)} to send"
                        return False
                    self.sent[key] = now
                else:
                    self.posted[(rank, key)] = now
            self.records.append(_record(rank, step, "p2p-issue", now, now))
        self.cursor[rank] += 1
        return True

    def outcome(self, lowered: Lowered) -> SimulationResult:
        finish = dict(self.clock)
        makespan = max(finish.values(), default=0.0)
        busy = {rank: sum(end - start for start, end, _ in self.timeline[rank]) for rank in self.ranks}
        capacity = len(self.ranks) * makespan
        bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
        per_rank = {rank: (1.0 - busy[rank] / makespan if makespan > 0 else 0.0) for rank in self.ranks}
        peaks = {rank: peak_activations(steps) for rank, steps in lowered.items()}
        peak_bytes = {rank: peak_activation_bytes(steps, self.costs) for rank, steps in lowered.items()}
        records = sorted(self.records, key=lambda r: (r["rank"], r["start"], r["end"]))
        return SimulationResult(makespan, bubble, peaks, self.timeline, per_rank, peak_bytes, busy, records)


def _describe(key: DataKey) -> str:
    if key[0] == FEATURE:
        return f"the preprocess output of micro-batch {key[2]}"
    if key[0] == FEATURE_GRAD:
        return f"the gradient of the stage-0 inputs of micro-batch {key[2]}"
    return producer_text(key)


def _record(rank: int, step: MetaStep, kind: str, start: float, end: float) -> dict[str, Any]:
    return {"rank": rank, "step": str(step), "kind": kind, "start": start, "end": end}


def run_mpipe(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan, costs: CostModel | None = None,
              preprocess: StageCost | None = None, load_ms: float = 0.0) -> SimulationResult:
    """Simulate lowered lists with MPipe steps; ScheduleError naming the stuck steps if they cannot finish."""
    num_ranks = len(set(stage_to_rank.values()))
    if costs is None:
        costs = CostModel.per_rank_share(num_ranks, max(1, len(stage_to_rank) // num_ranks))
    model = MPipeTimedModel(lowered, stage_to_rank, plan, costs, preprocess, load_ms)
    stuck = model.run()
    if stuck:
        lines = []
        marks = []
        for rank, (index, wait) in sorted(stuck.items()):
            marks.append((rank, index))
            lines.append(f"  rank {rank} is stuck at {model.steps[rank][index]}, waiting for {wait}")
        grid = {rank: list(steps) for rank, steps in model.steps.items()}
        raise ScheduleError("MPipe schedule cannot finish: every unfinished rank is blocked\n" + "\n".join(lines),
                            grid, marks)
    return model.outcome(model.steps)


def place_mpipe_steps(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan, forward_only: bool = False,
                      costs: CostModel | None = None, preprocess: StageCost | None = None) -> Lowered:
    """`insert_mpipe_steps` with the overflow preprocesses of ``"full"`` placed from one timed run
    of the compute job (``placement.py``: each before the owner's step that leaves it most idle
    time while its output still reaches stage 0 in time). Costs default to the simulator's (a
    preprocess costing one rank's share of the body)."""
    plan_run = plan.with_backward(forward_only)
    if not overflow_micros(plan_run, stage_to_rank[0]):
        return insert_mpipe_steps(lowered, stage_to_rank, plan, forward_only)
    costs, preprocess = preprocess_costs(plan, stage_to_rank, costs, preprocess)
    body = {rank: [s for s in items if s is not None] for rank, items in lowered.items()}
    compute = {rank: [s for s in items if s.meta_type.is_compute or s.meta_type.is_overlap]
               for rank, items in body.items()}
    flow = flow_of(compute, stage_to_rank, plan.num_microbatches, metadata_of(body), forward_only)
    slots = None if flow is None else overflow_slots(flow, plan_run, costs, preprocess, body)
    # None: the body cannot run as it is; the structural places stand and check_mpipe reports it
    return insert_mpipe_steps(lowered, stage_to_rank, plan, forward_only, slots)


def check_mpipe(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan, forward_only: bool = False) -> None:
    """The static checks of `check_mpipe_steps`, then a whole-job run (deadlock freedom)."""
    check_mpipe_steps(lowered, stage_to_rank, plan, forward_only)
    run_mpipe(lowered, stage_to_rank, plan.with_backward(forward_only))


# ---------------------------------------------------------------------- whole schedules


def body_schedule(num_ranks: int, num_chunks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """The body's compute lists: 1F1B for one chunk per rank, interleaved 1F1B for more."""
    if num_chunks == 1:
        return generate_1f1b(num_ranks, num_microbatches)
    return generate_interleaved_1f1b(num_ranks, num_chunks, num_microbatches)


@dataclass
class MPipeSimulation:
    """A simulated MPipe (or, ``transpose=False``, plain) schedule.

    The warm-up lasts until stage 0's rank starts its first backward (``warmup_end``: the first
    micro-batch went through every stage and back); ``warmup_idle[r]`` is the time rank r is idle
    during it, ``warmup_bubble`` their sum (the whole run when there is no backward)."""

    plan: MPipePlan
    stage_to_rank: dict[int, int]
    lowered: Lowered
    result: SimulationResult
    warmup_end: float = 0.0
    warmup_idle: dict[int, float] = field(default_factory=dict)

    @property
    def warmup_bubble(self) -> float:
        return sum(self.warmup_idle.values())

    def summary(self) -> dict[str, Any]:
        return {"makespan": self.result.makespan, "bubble_fraction": self.result.bubble_fraction,
                "warmup_end": self.warmup_end, "warmup_bubble": self.warmup_bubble,
                "warmup_idle": dict(self.warmup_idle)}


def warmup_window(result: SimulationResult, zero: int = 0) -> tuple[float, dict[int, float]]:
    """(end of the warm-up, per-rank idle time before it): see `MPipeSimulation`."""
    end = next((start for start, _, step in result.timeline.get(zero, [])
                if any(p.meta_type in (_T.BWD, _T.BWD_INPUT) for p in step.parts)), result.makespan)
    idle = {rank: end - sum(max(0.0, min(e, end) - s) for s, e, _ in steps)
            for rank, steps in result.timeline.items()}
    return end, idle


def plan_mpipe(num_ranks: int, num_chunks: int, num_microbatches: int, *, num_transpose_layers: int = 1,
               overflow_mode: str = "full", transpose: bool = True, trainable: bool = True,
               owner_backward: bool = False, inputs: str = "global", forward_only: bool = False,
               overlap_p2p: bool = False) -> tuple[MPipePlan, dict[int, int], Lowered]:
    """(plan, stage -> pipeline rank, lowered lists with MPipe steps) of an MPipe schedule, as
    ``ScheduleMPipeTranspose`` builds it for training (metadata of the first micro-batch) or,
    with ``forward_only``, for ``eval``; checked by `check_mpipe`."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    compute = num_transpose_layers > 0
    backward = None
    if compute and trainable:
        backward = "owner" if owner_backward else "recompute"
    plan = MPipePlan(p, m, overflow_mode, transpose, compute, backward,
                     ship_inputs=backward == "recompute" and inputs == "owned")
    placement = looped_placement(p, v)
    compute_lists = body_schedule(p, v, m)
    if forward_only:
        compute_lists = {r: [s for s in steps if s is not None and s.meta_type is _T.FWD]
                         for r, steps in compute_lists.items()}
    lowered = lower(compute_lists, placement, "plain", metadata="first", prefetch=overlap_p2p)
    lowered = place_mpipe_steps(lowered, placement, plan, forward_only)
    check_mpipe(lowered, placement, plan, forward_only)
    return plan, placement, lowered


def simulate_mpipe(num_ranks: int, num_chunks: int, num_microbatches: int, num_transpose_layers: int, *,
                   layers_per_stage: float = 1.0, costs: CostModel | None = None, load_ms: float = 0.0,
                   **options: Any) -> MPipeSimulation:
    """Plan (`plan_mpipe`, ``options`` passed on) and simulate an MPipe schedule; see the module
    docstring for the costs. ``transpose=False`` gives the plain pipeline to compare with."""
    plan, placement, lowered = plan_mpipe(num_ranks, num_chunks, num_microbatches,
                                          num_transpose_layers=num_transpose_layers, **options)
    if costs is None:
        costs = CostModel.per_rank_share(num_ranks, num_chunks)
    costs = costs.for_stages(len(placement))
    share = [costs.stage(s) for s, r in placement.items() if r == placement[0]]
    per_layer = 1.0 / layers_per_stage
    preprocess = StageCost(F=sum(s.F for s in share) * num_transpose_layers * per_layer,
                           B=sum(s.B for s in share) * num_transpose_layers * per_layer)
    result = run_mpipe(lowered, placement, plan, costs, preprocess, load_ms)
    end, idle = warmup_window(result, placement[0])
    return MPipeSimulation(plan, placement, lowered, result, end, idle)


def compare_warmup(num_ranks: int, num_chunks: int, num_microbatches: int, num_transpose_layers: int,
                   **options: Any) -> dict[str, MPipeSimulation]:
    """``{"plain": ..., "mpipe": ...}``: the same job simulated without and with transposition."""
    return {"plain": simulate_mpipe(num_ranks, num_chunks, num_microbatches, num_transpose_layers,
                                    transpose=False, **options),
            "mpipe": simulate_mpipe(num_ranks, num_chunks, num_microbatches, num_transpose_layers,
                                    transpose=True, **options)}
