"""Schedule classes: one generator each, one shared runtime.

A schedule class checks its arguments locally, places the stages, generates the compute
lists of every pipeline rank, lowers and validates them, and on ``run`` splits the batch
and hands this rank's lowered list to :class:`PipelineRuntime`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel import shared_params
from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering import lower
from hyper_parallel.core.pipeline_parallel.microbatch import merge_outputs, split_inputs, split_target
from hyper_parallel.core.pipeline_parallel.placement import looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.runtime import CustomFunction, PipelineRuntime, StepContext
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_looped_bfs,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.validate import validate_lowered

P2P_TRANSPORTS = ("auto", "plain", "batch")
Schedule = dict[int, list[MetaStep | None]]


class PipelineSchedule:
    """Base of every schedule; subclasses set ``placement`` and implement ``generate``.

    ``placement`` is ``"single"`` (stage r on pipeline rank r), ``"looped"`` (stage c*p+r on
    rank r) or ``"v"`` (stages r and 2p-1-r on rank r).
    """

    placement = "single"
    min_chunks, max_chunks = 1, 1

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        args_batch_dim: Any = None,
        kwargs_batch_dim: Any = None,
        output_concat_dim: int | None = None,
        scale_grads: bool = True,
        overlap_p2p: bool = False,
        p2p_transport: str = "auto",
        swap: bool = False,
    ) -> None:
        self.stages = self._check_stages(stages)
        if isinstance(micro_batch_num, bool) or not isinstance(micro_batch_num, int):
            raise TypeError(f"micro_batch_num must be an int, got {micro_batch_num!r}")
        if micro_batch_num < 1:
            raise ValueError(f"micro_batch_num must be >= 1, got {micro_batch_num}")
        if p2p_transport not in P2P_TRANSPORTS:
            raise ValueError(f"unknown p2p_transport {p2p_transport!r}; valid: {', '.join(P2P_TRANSPORTS)}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        if output_concat_dim is not None and loss_fn is None:
            raise ValueError(
                "output_concat_dim needs a loss_fn: without one the last stage's output is the loss itself"
            )
        if swap:
            raise NotImplementedError("activation swap (swap=True) is not available in this version")
        self.micro_batch_num = micro_batch_num
        self.loss_fn = loss_fn
        self.args_batch_dim = args_batch_dim
        self.kwargs_batch_dim = kwargs_batch_dim
        self.output_concat_dim = output_concat_dim
        self.scale_grads = bool(scale_grads)
        self.overlap_p2p = bool(overlap_p2p)
        first = self.stages[0]
        self.platform = first.platform
        self.group = first.group
        self.num_ranks = self.group.size
        self.pp_rank = self.group.group_rank(self.platform.rank)
        if p2p_transport == "auto":
            p2p_transport = "plain" if self.platform.device_type == "cpu" else "batch"
        self.p2p_transport = p2p_transport
        self.stage_to_pp_rank = self._place()
        self._by_index = {st.stage_index: st for st in self.stages}
        self.stage_to_rank = {s: self.group.ranks[r] for s, r in self.stage_to_pp_rank.items()}
        self.compute_schedule: Schedule = self.generate(self.num_ranks, len(self.stages), micro_batch_num)
        lowered = lower(self.compute_schedule, self.stage_to_pp_rank, self.p2p_transport)
        validate_lowered(lowered, self.stage_to_pp_rank, micro_batch_num)
        self._lowered = lowered
        self._custom: dict[MetaStepType, CustomFunction] = {}
        self.outputs: Any = None
        self.peak_activations = 0
        self._holders = self._agree_across_ranks()
        if self._holders:
            shared_params.sync_values(self.platform, self._by_index, self._holders)

    # ------------------------------------------------------------------ construction
    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        """The compute-only step lists of every pipeline rank."""
        raise NotImplementedError

    @classmethod
    def stage_placement(cls, num_ranks: int, num_chunks: int) -> dict[int, int]:
        """Stage index -> pipeline rank."""
        return v_placement(num_ranks) if cls.placement == "v" else looped_placement(num_ranks, num_chunks)

    def _check_stages(self, stages: PipelineStage | Sequence[PipelineStage]) -> list[PipelineStage]:
        name = type(self).__name__
        if isinstance(stages, PipelineStage):
            stages = [stages]
        elif isinstance(stages, (list, tuple)):
            stages = list(stages)
            if not stages or not all(isinstance(s, PipelineStage) for s in stages):
                raise TypeError(f"{name} needs PipelineStage objects, got {stages!r}")
            if self.max_chunks == 1 and len(stages) > 1:
                raise ValueError(f"{name} runs one stage per rank, but {len(stages)} stages were given")
        else:
            raise TypeError(f"{name} needs a PipelineStage or a list of them, got {type(stages).__name__}")
        if not self.min_chunks <= len(stages) <= self.max_chunks:
            raise ValueError(
                f"{name} needs between {self.min_chunks} and {self.max_chunks} stages per rank, got {len(stages)}"
            )
        groups = {s.group.ranks for s in stages}
        if len(groups) != 1:
            raise ValueError(f"all stages of a rank must use the same pipeline group, got {sorted(groups)}")
        return stages

    def _place(self) -> dict[int, int]:
        p, v = self.num_ranks, len(self.stages)
        table = self.stage_placement(p, v)
        expected = sorted(s for s, r in table.items() if r == self.pp_rank)
        got = sorted(stage.stage_index for stage in self.stages)
        total = {stage.stage_num for stage in self.stages}
        if total != {len(table)}:
            raise ValueError(
                f"{type(self).__name__} with {p} ranks and {v} stage(s) per rank needs stage_num={len(table)}, "
                f"got {sorted(total)}"
            )
        if got != expected:
            raise ValueError(
                f"{type(self).__name__} places stages {expected} on pipeline rank {self.pp_rank}, "
                f"but this rank was given stages {got}"
            )
        self.stages.sort(key=lambda st: st.stage_index)
        return table

    def _local_ties(self) -> list[tuple[int, list[str]]]:
        """Tie names per local stage; a parameter object held by two local stages counts once."""
        seen: dict[str, set[int]] = {}
        ties = []
        for st in self.stages:
            names = []
            for name, param in sorted(st.shared_parameters.items()):
                if id(param) not in seen.setdefault(name, set()):
                    seen[name].add(id(param))
                    names.append(name)
            ties.append((st.stage_index, names))
        return ties

    def _params(self) -> list[Any]:
        """Every parameter of this rank's stages, each object once (stages may share one)."""
        unique: dict[int, Any] = {}
        for st in self.stages:
            for param in st.params:
                unique.setdefault(id(param), param)
        return list(unique.values())

    def _agree_across_ranks(self) -> shared_params.Holders:
        """Check every pipeline rank built the same schedule; exchange the tied-parameter table."""
        mine = {
            "schedule": type(self).__name__,
            "micro_batch_num": self.micro_batch_num,
            "chunks": len(self.stages),
            "stage_num": self.stages[0].stage_num,
            "transport": self.p2p_transport,
            "ties": self._local_ties(),
            "declared": [(st.stage_index, sorted(st.shared_parameters)) for st in self.stages],
        }
        everyone = self.platform.all_gather_object(mine, self.group)
        reference = everyone[0]  # compare with the first pipeline rank so every rank reports the same pair
        for key in ("schedule", "micro_batch_num", "chunks", "stage_num", "transport"):
            for pp_rank, theirs in enumerate(everyone):
                if theirs[key] != reference[key]:
                    raise ValueError(
                        f"pipeline ranks disagree on {key}: rank {self.group.ranks[0]} has {reference[key]!r} but "
                        f"rank {self.group.ranks[pp_rank]} has {theirs[key]!r}"
                    )
        return shared_params.collect_holders(
            [t["ties"] for t in everyone], self.group.ranks, [t["declared"] for t in everyone]
        )

    # ------------------------------------------------------------------ public API
    @property
    def exec_order(self) -> dict[int, list[MetaStep | None]]:
        """The lowered step list of every pipeline rank (what the runtime executes)."""
        return {r: list(steps) for r, steps in self._lowered.items()}

    def register_custom_function(self, step_type: MetaStepType, fn: CustomFunction) -> None:
        """Run ``fn(step, ctx)`` instead of the built-in behaviour for steps of ``step_type``."""
        if not isinstance(step_type, MetaStepType):
            raise TypeError(f"step_type must be a MetaStepType, got {step_type!r}")
        if not callable(fn):
            raise TypeError(f"custom function for {step_type.name} must be callable, got {fn!r}")
        self._custom[step_type] = fn

    def run(self, *args: Any, target: Any = None, **kwargs: Any) -> list[Any]:
        """One training step: returns the per-micro-batch losses on the last stage's rank, else []."""
        p, m = self.platform, self.micro_batch_num
        has_first = self.stages[0].is_first
        has_last = self.stages[-1].is_last
        if has_last and self.loss_fn is not None and target is None:
            raise ValueError("loss_fn was given but run() got no target on the rank holding the last stage")
        if has_last and self.loss_fn is None and target is not None:
            raise ValueError("run() got a target but the schedule has no loss_fn to use it")
        if has_first:
            micro = split_inputs(p, args, kwargs, m, self.args_batch_dim, self.kwargs_batch_dim)
        else:
            micro = [((), {})] * m
        targets = split_target(p, target, m) if has_last and target is not None else []
        params = self._params()
        earlier = [p.get_grad(param) for param in params]
        p.zero_grads(params)

        runtime = PipelineRuntime(
            p,
            self._by_index,
            self.stage_to_rank,
            [a for a, _ in micro],
            [k for _, k in micro],
            targets,
            self.loss_fn,
            overlap_p2p=self.overlap_p2p,
            batch_p2p=self.p2p_transport == "batch",
            keep_outputs=self.output_concat_dim is not None,
        )
        ctx = StepContext(self, runtime, runtime.micro_args, runtime.micro_kwargs, targets, runtime.losses)
        steps = [s for s in self._lowered[self.pp_rank] if s is not None]
        runtime.execute(steps, self._custom, ctx)
        self.peak_activations = runtime.peak_activations

        if self._holders:
            shared_params.sum_gradients(p, self._by_index, self._holders)
        if self.scale_grads:
            p.scale_grads(params, 1.0 / m)
        for param, old in zip(params, earlier, strict=True):
            if old is not None:
                new = p.get_grad(param)
                p.set_grad(param, old if new is None else old + new)
        if not has_last:
            self.outputs = None
            return []
        if self.output_concat_dim is not None:
            self.outputs = merge_outputs(p, [runtime.stage_outputs[i] for i in range(m)], self.output_concat_dim)
        return [runtime.losses[i] for i in range(m)]


class ScheduleGPipe(PipelineSchedule):
    """All forwards, then all backwards."""

    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_gpipe(num_ranks, num_microbatches)


class Schedule1F1B(PipelineSchedule):
    """Warm-up forwards, then one forward one backward, then cool-down backwards."""

    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_1f1b(num_ranks, num_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """1F1B over several looped chunks per rank (stage c*p + r on rank r)."""

    placement = "looped"
    min_chunks, max_chunks = 2, 64

    def __init__(self, stages: Sequence[PipelineStage], micro_batch_num: int, overlap_b_f: bool = False, **common: Any):
        if overlap_b_f:
            raise NotImplementedError("overlap_b_f=True is not available in this version")
        super().__init__(stages, micro_batch_num, **common)

    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_interleaved_1f1b(num_ranks, num_chunks, num_microbatches)


class ScheduleLoopedBFS(PipelineSchedule):
    """Breadth first over looped chunks: every micro-batch through a chunk before the next."""

    placement = "looped"
    min_chunks, max_chunks = 1, 64

    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_looped_bfs(num_ranks, num_chunks, num_microbatches)

