"""Schedule classes: one generator each, one shared runtime.

A schedule class checks its arguments locally, places the stages, generates the compute
lists of every pipeline rank, lowers and validates them, and checks that every pipeline rank
built the same schedule. ``run`` splits the batch, executes this rank's lowered list and sums
tied gradients; ``eval`` runs the forwards only; ``step`` is torch.distributed.pipelining's
entry point on top of them.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.lowering import plan_cache
from hyper_parallel.core.pipeline_parallel.runtime import shared_params
from hyper_parallel.core.pipeline_parallel.runtime.agreement import gather_and_check
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.runtime.grad_state import RunGradients
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import TRANSPORTS, lower
from hyper_parallel.core.pipeline_parallel.runtime.microbatch import merge_outputs, split_inputs, split_target
from hyper_parallel.core.pipeline_parallel.ir.placement import check_count, check_flag, is_int, looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.runtime.executor import P2P_TYPES, CustomFunction, PipelineRuntime, StepContext
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_looped_bfs,
)
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.runtime.tracing import StepTracer
from hyper_parallel.core.pipeline_parallel.lowering.rank_plan import plan_rank
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered

P2P_TRANSPORTS = ("auto", *TRANSPORTS)
Schedule = dict[int, list[MetaStep | None]]
Lowered = dict[int, list[MetaStep]]
LoweringPass = Callable[[Lowered, "PipelineSchedule", bool], Lowered]
"""(lowered lists of every pipeline rank, the schedule, forward_only) -> new lists: a feature's
steps (FSDP, swap, ...) inserted after the point-to-point ones; validation runs on the result."""
StepHandler = Callable[[PipelineRuntime, MetaStep], None]
_T = MetaStepType
_SERIALS = itertools.count()  # schedules built in this process
_RUNS_PER_TAG_BLOCK = 1 << 20


class RunHook:
    """A feature's part in every run (all methods optional no-ops): ``before_run`` when the run's
    gradients were set up, ``after_run`` once every step ran (inside the part a failure undoes),
    ``on_failure`` when the run raised; ``before_eval`` before a forward-only ``eval``/``step``."""

    def before_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        return None

    def after_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        return None

    def on_failure(self, schedule: PipelineSchedule) -> None:
        return None

    def before_eval(self, schedule: PipelineSchedule) -> None:
        return None


class CheckBeforeRun(RunHook):
    """Runs ``check(schedule)`` again before every run: what a feature checked at construction may
    have changed since (say the MindSpore context switched to GRAPH_MODE)."""

    def __init__(self, check: Callable[[PipelineSchedule], None]) -> None:
        self.check = check

    def before_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        self.check(schedule)


FeatureSetup = Callable[["PipelineSchedule", Mapping[str, Any]], None]
"""``setup(schedule, options)``: called by every schedule's constructor with the feature options
it was given (``swap``, ``swap_threshold``, ``comm_compute_overlap``); it adds what the feature
needs through ``schedule.add_feature`` (or nothing when its option is off)."""


@dataclass(frozen=True)
class _Feature:
    name: str
    order: int
    setup: FeatureSetup | None
    reader: Callable[[PipelineSchedule], Any] | None
    options: tuple[str, ...]


# kept across importlib.reload of this module (IPython autoreload): the features registered once
_FEATURES: dict[str, _Feature] = globals().get("_FEATURES", {})


def register_feature(name: str, setup: FeatureSetup | None = None,
                     reader: Callable[[PipelineSchedule], Any] | None = None, *, options: Sequence[str] = (),
                     order: int = 100) -> None:
    """Plug a feature into every schedule built from now on, under ``name`` (registering a name
    again replaces it): ``setup`` runs in each constructor, features by ascending ``order`` (then
    name), after the stages are placed and before the plan is built and validated; ``reader``
    answers ``schedule.feature_result(name)``; ``options`` are the constructor options the feature
    runs (an option set while no registered feature owns it is refused). The features of
    ``pipeline_parallel/features`` register themselves when the package is imported; the schedule
    class imports none of them."""
    _FEATURES[name] = _Feature(name, order, setup, reader, tuple(options))


class PipelineSchedule:
    """Base of every schedule; subclasses set ``placement`` and implement ``_generate``.

    ``n_microbatches`` is accepted as another name of ``micro_batch_num`` (torch pipelining's).

    ``placement`` is ``"single"`` (stage r on pipeline rank r), ``"looped"`` (stage c*p+r on
    rank r) or ``"v"`` (stages r and 2p-1-r on rank r).

    ``comm_compute_overlap`` (a ``CommComputeOverlap`` wrapping the model's MoE layers) runs the
    schedule's ``OVERLAP_B_F`` / ``OVERLAP_F_B`` steps on it, so that one side's all-to-all is in
    flight while the other side computes (``features/overlap_step.py``); without it their two
    sub-steps run one after the other.
    """

    overlap_b_f = False  # whether the steady state's (backward, forward) pairs are fused (see subclasses)

    placement = "single"
    min_chunks, max_chunks = 1, 1

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        args_batch_dim: Any = None,
        kwargs_batch_dim: Any = None,
        output_concat_dim: int | None = None,
        scale_grads: bool = True,
        overlap_p2p: bool = True,
        p2p_transport: str = "auto",
        swap: bool = False,
        swap_threshold: int = 4,
        keep_grads_on_error: bool = True,
        n_microbatches: int | None = None,
        comm_compute_overlap: Any = None,
    ) -> None:
        if micro_batch_num is None:
            if n_microbatches is None:
                raise TypeError(f"{type(self).__name__} needs micro_batch_num (or n_microbatches)")
            micro_batch_num = n_microbatches
        elif n_microbatches is not None and n_microbatches != micro_batch_num:
            raise ValueError(f"micro_batch_num={micro_batch_num} and n_microbatches={n_microbatches} disagree")
        self.stages = self._check_stages(stages)
        if not is_int(micro_batch_num):
            raise TypeError(f"micro_batch_num must be an int, got {micro_batch_num!r}")
        if micro_batch_num < 1:
            raise ValueError(f"micro_batch_num must be >= 1, got {micro_batch_num}")
        if p2p_transport not in P2P_TRANSPORTS:
            raise ValueError(f"unknown p2p_transport {p2p_transport!r}; valid: {', '.join(P2P_TRANSPORTS)}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        if output_concat_dim is not None and (not is_int(output_concat_dim) or output_concat_dim < 0):
            raise ValueError(f"output_concat_dim must be a non-negative int or None, got {output_concat_dim!r}")
        if output_concat_dim is not None and loss_fn is None:
            raise ValueError(
                "output_concat_dim needs a loss_fn: without one the last stage's output is the loss itself "
                "(eval() and step() without a loss_fn merge outputs along dim 0)"
            )
        dyn = {st.dyn_shape for st in self.stages}
        if len(dyn) > 1:
            raise ValueError("the stages of one rank must agree on dyn_shape, got both True and False")
        self.micro_batch_num = micro_batch_num
        self.loss_fn = loss_fn
        self.args_batch_dim = args_batch_dim
        self.kwargs_batch_dim = kwargs_batch_dim
        self.output_concat_dim = output_concat_dim
        self.scale_grads = check_flag("scale_grads", scale_grads)
        self.overlap_p2p = check_flag("overlap_p2p", overlap_p2p)
        self.keep_grads_on_error = check_flag("keep_grads_on_error", keep_grads_on_error)
        check_flag("swap", swap)
        self.dyn_shape = dyn.pop()
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
        self.compute_schedule: Schedule = self._compute_schedule()
        self._lowered_cache: dict[tuple[str, bool], dict[int, list[MetaStep]]] = {}  # what this rank runs
        self._job_cache: dict[tuple[str, bool], dict[int, list[MetaStep]]] = {}  # every rank's (exec_order)
        self._custom: dict[MetaStepType, CustomFunction] = {}
        self._passes: list[LoweringPass] = []
        self._step_handlers: dict[MetaStepType, StepHandler] = {}
        self._run_hooks: list[RunHook] = []
        self._host_grads: dict[int, tuple[Any, Any]] = {}  # gradient copies a failed run restores, reused
        self._runs = 0
        self.comm_compute_overlap = None
        # the threshold means something (and is checked) only with swap=True, as it always did
        self._set_up_features({"swap": swap, "swap_threshold": swap_threshold if swap else None,
                               "comm_compute_overlap": comm_compute_overlap})
        self.outputs: Any = None
        self.peak_activations = 0
        self.tracer = StepTracer(enabled=os.environ.get("HYPER_PARALLEL_TRACE", "") not in ("", "0"))
        self._lowered(self._training_metadata())  # fail before any communication if it cannot run
        self._holders = self._agree_across_ranks()
        self.platform.open_meta_channel(self.group.ranks)
        if self._holders:
            shared_params.sync_values(self.platform, self._by_index, self._holders)

    def _set_up_features(self, options: Mapping[str, Any]) -> None:
        """Let every registered feature add itself (``register_feature``), in their fixed order; an
        option that is set while no registered feature owns it is refused rather than ignored."""
        features = sorted(_FEATURES.values(), key=lambda f: (f.order, f.name))
        owned = {option for f in features for option in f.options}
        for option, value in options.items():
            if value is not None and value is not False and option not in owned:
                raise RuntimeError(f"{option}= needs a feature that runs it, and none is registered (the library's "
                                   "register when hyper_parallel.core.pipeline_parallel.features is imported)")
        for feature in features:
            if feature.setup is not None:
                feature.setup(self, options)

    # ------------------------------------------------------------------ construction
    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        """The compute-only step lists of every pipeline rank (arguments checked first)."""
        check_count("num_ranks", num_ranks, 1)
        check_count("num_chunks", num_chunks, 1)
        if not cls.min_chunks <= num_chunks <= cls.max_chunks:
            raise ValueError(
                f"{cls.__name__} runs between {cls.min_chunks} and {cls.max_chunks} stages per rank, got "
                f"num_chunks={num_chunks}"
            )
        minimum = cls.min_microbatches(num_ranks, num_chunks)
        if not is_int(num_microbatches) or num_microbatches < minimum:
            raise ValueError(
                f"{cls.__name__} with {num_ranks} ranks needs at least {minimum} micro-batches, got {num_microbatches!r}"
            )
        def make() -> Schedule:
            return cls._generate(num_ranks, num_chunks, num_microbatches)

        # the library's generators are functions of (p, v, m): kept; a subclass's may read what it
        # is given between builds (a table, a CSV file), so it is asked again every time
        if not getattr(cls._generate, "__module__", "").startswith("hyper_parallel."):
            return make()
        return plan_cache.generated((cls, num_ranks, num_chunks, num_microbatches), make)

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        raise NotImplementedError

    def _compute_schedule(self) -> Schedule:
        """The compute lists this instance runs (a subclass may transform ``generate``'s)."""
        return self.generate(self.num_ranks, len(self.stages), self.micro_batch_num)

    @classmethod
    def min_microbatches(cls, num_ranks: int, num_chunks: int) -> int:
        """The fewest micro-batches this schedule can run."""
        return 1

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

    def _agree_across_ranks(self) -> shared_params.Holders:
        """Check every pipeline rank built the same schedule; exchange the tied-parameter table."""
        mine = {
            "schedule": type(self).__name__,
            "micro_batch_num": self.micro_batch_num,
            "chunks": len(self.stages),
            "stage_num": self.stages[0].stage_num,
            "transport": self.p2p_transport,
            "scale_grads": self.scale_grads,
            "overlap_p2p": self.overlap_p2p,
            "overlap_b_f": self.overlap_b_f,
            "dyn_shape": self.dyn_shape,
            "has_loss_fn": self.loss_fn is not None,
            "ties": self._local_ties(),
            "declared": [(st.stage_index, sorted(st.shared_parameters)) for st in self.stages],
            "serial": next(_SERIALS),
        }
        everyone = gather_and_check(self.platform, self.group, mine)
        self._serial = everyone[0]["serial"]  # one number on every rank, for the message tags
        return shared_params.collect_holders(
            [t["ties"] for t in everyone], self.group.ranks, [t["declared"] for t in everyone]
        )

    def _training_metadata(self) -> str:
        """Shapes travel for every micro-batch with ``dyn_shape``, else for the first micro-batch of
        every stage boundary in every run (so the batch size, or which outputs need a gradient, may
        change from run to run; the other micro-batches of a run must match the first)."""
        return "all" if self.dyn_shape else "first"

    def _lowered(self, metadata: str, forward_only: bool = False) -> dict[int, list[MetaStep]]:
        key = (metadata, forward_only)
        lowered = self._lowered_cache.get(key)
        if lowered is None:
            with paused_gc():  # millions of small objects, all alive until the end (gc_pause.py)
                lowered = self._plan(metadata, forward_only)
            self._lowered_cache[key] = lowered
        return lowered

    def _plan(self, metadata: str, forward_only: bool) -> dict[int, list[MetaStep]]:
        """The lowered, checked list this rank runs: without lowering passes, for ``plain`` on gloo's
        eager engine and for ``batch`` with ``overlap_p2p``, this rank's alone, planned in time
        linear in the job (``lowering/rank_plan.py``); else (or where that pass cannot prove the
        plan) every rank's, as ``_plan_job`` makes them."""
        engine = "eager" if self.platform.device_type == "cpu" else "stream"
        plain = self.p2p_transport == "plain" and engine == "eager"
        if (plain or self.p2p_transport == "batch" and self.overlap_p2p) and not self._passes:
            compute = _forwards_only(self.compute_schedule) if forward_only else self.compute_schedule
            own = plan_rank(compute, self.stage_to_pp_rank, self.pp_rank, self.micro_batch_num, self.p2p_transport,
                            metadata=metadata, prefetch=self.overlap_p2p, forward_only=forward_only)
            if own is not None:
                return {self.pp_rank: own}
        return self._job_lowered(metadata, forward_only)

    def _job_lowered(self, metadata: str, forward_only: bool = False) -> dict[int, list[MetaStep]]:
        key = (metadata, forward_only)
        lowered = self._job_cache.get(key)
        if lowered is None:
            with paused_gc():
                lowered = self._plan_job(metadata, forward_only)
            self._job_cache[key] = lowered
        return lowered

    def _plan_job(self, metadata: str, forward_only: bool) -> dict[int, list[MetaStep]]:
        """Lower every rank, run the features' passes, validate the whole job (or reuse this process's
        plan of the same lists)."""
        compute = _forwards_only(self.compute_schedule) if forward_only else self.compute_schedule
        # the same plan in this process (another rank's thread, the same shape built again):
        # reused when its compute lists are equal to these (plan_cache.py)
        plan_key = (type(self), self.num_ranks, len(self.stages), self.micro_batch_num,
                    tuple(sorted(self.stage_to_pp_rank.items())), self.p2p_transport, metadata,
                    self.overlap_p2p, forward_only)
        planned = plan_cache.lowered(plan_key, compute)
        if planned is None:
            lowered = lower(compute, self.stage_to_pp_rank, self.p2p_transport, metadata=metadata,
                            prefetch=self.overlap_p2p)
            passed: set = set()
            plan_cache.remember(plan_key, compute, lowered, passed)
        else:
            lowered, passed = planned
        for lowering_pass in self._passes:
            lowered = lowering_pass(lowered, self, forward_only)
        engine = "eager" if self.platform.device_type == "cpu" else "stream"  # gloo vs NCCL / HCCL
        check = (self.micro_batch_num, engine)
        try:
            if self._passes or check not in passed:
                validate_lowered(lowered, self.stage_to_pp_rank, self.micro_batch_num, self.p2p_transport,
                                 forward_only, engine=engine)
                if not self._passes:
                    passed.add(check)
        except ScheduleError as exc:
            if self.p2p_transport != "plain" or engine != "stream":
                raise
            raise ScheduleError(
                f"p2p_transport='plain' would hang on {self.platform.device_type}: there a rank's sends and "
                "receives run in order on one stream and a send waits for its receive; use "
                f"p2p_transport='batch' (what 'auto' picks there). {exc.reason}", exc.schedule, exc.marks
            ) from None
        return lowered

    def add_feature(self, lowering_pass: LoweringPass | None = None,
                    handlers: Mapping[MetaStepType, StepHandler] | None = None, hook: RunHook | None = None,
                    hook_first: bool = False) -> None:
        """Extend the schedule (for features such as FSDP or activation swap): a pass that inserts
        steps into the lowered lists, the runtime handlers of those step types, a per-run hook
        (``hook_first``: before the hooks added so far, for a check that must refuse a run before
        any other feature prepares it)."""
        if lowering_pass is not None:
            self._passes.append(lowering_pass)
            self._lowered_cache.clear()
            self._job_cache.clear()
        self._step_handlers.update(handlers or {})
        if hook is not None:
            if hook_first:
                self._run_hooks.insert(0, hook)
            else:
                self._run_hooks.append(hook)

    # ------------------------------------------------------------------ public API
    @property
    def exec_order(self) -> dict[int, list[MetaStep | None]]:
        """The lowered step list of every pipeline rank that the next ``run`` executes."""
        return {r: list(steps) for r, steps in self._job_lowered(self._training_metadata()).items()}

    def register_custom_function(self, step_type: MetaStepType, fn: CustomFunction) -> None:
        """Run ``fn(step, ctx)`` instead of the built-in behaviour for steps of ``step_type``."""
        if not isinstance(step_type, MetaStepType):
            raise TypeError(f"step_type must be a MetaStepType, got {step_type!r}")
        if not callable(fn):
            raise TypeError(f"custom function for {step_type.name} must be callable, got {fn!r}")
        if self.p2p_transport == "batch" and step_type in P2P_TYPES:
            raise ValueError(
                f"with p2p_transport='batch' every {step_type.name} step runs inside a BATCH_SEND_RECV step, so a "
                f"function for {step_type.name} would never be called; register one for "
                "MetaStepType.BATCH_SEND_RECV (step.sub_steps lists its operations; ctx.run_default(step) runs them)"
            )
        if self.p2p_transport == "plain" and step_type is _T.BATCH_SEND_RECV:
            raise ValueError(
                "with p2p_transport='plain' there are no BATCH_SEND_RECV steps; register functions for "
                "FWD_SEND, FWD_RECV, BWD_SEND and BWD_RECV instead"
            )
        self._custom[step_type] = fn

    def parameters(self) -> list[Any]:
        """Every trainable parameter of this rank's stages, each object once (stages may share one),
        ready for an optimizer (on MindSpore, parameter names that clash between the stages of this
        rank get their stage as a prefix, which MindSpore's optimizers need)."""
        self.platform.unique_parameter_names([(st.stage_index, st.params) for st in self.stages])
        return self._params()

    def _params(self) -> list[Any]:
        unique: dict[int, Any] = {}
        for st in self.stages:
            for param in st.params:
                unique.setdefault(id(param), param)
        return list(unique.values())

    def _loss_params(self) -> list[Any]:
        """Trainable parameters of a ``loss_fn`` module on a rank that computes the loss, not already
        a stage's: the backward accumulates into them too, so a failed run puts them back as well."""
        fn = self.loss_fn
        if fn is None or not any(st.is_last for st in self.stages):
            return []
        try:
            named = self.platform.named_parameters(fn)
        except AttributeError:  # a plain function: no parameters of its own
            return []
        stage = {id(q) for q in self._params()}
        return list({id(q): q for _, q in named if id(q) not in stage}.values())

    def named_parameters(self) -> dict[str, Any]:
        """This rank's trainable parameters as a dict, by a name unique on the rank: ``stage<index>.<name>``
        with ``<name>`` the stage's own (``PipelineStage.named_params``); a parameter that several stages
        share appears once, under the first."""
        out: dict[str, Any] = {}
        seen: set[int] = set()
        for st in self.stages:
            for name, param in st.named_params:
                if id(param) not in seen:
                    seen.add(id(param))
                    prefix = f"stage{st.stage_index}."
                    out[name if name.startswith(prefix) else prefix + name] = param
        return out

    def named_gradients(self) -> dict[str, Any]:
        """The gradients of :meth:`named_parameters` that exist: a dict with the same names."""
        out = {}
        for name, param in self.named_parameters().items():
            grad = self.platform.get_grad(param)
            if grad is not None:
                out[name] = grad
        return out

    def gather_trace(self) -> list[dict[str, Any]]:
        """The step records of the last run of every pipeline rank, merged and sorted (a collective:
        every pipeline rank calls it). Tracing is on with ``schedule.tracer.enabled = True`` or
        ``HYPER_PARALLEL_TRACE=1``; see ``docs/tools.md`` for the record format and the viewers."""
        return self.tracer.gather(self.platform, self.group)

    def memory_stats(self) -> Any:
        """Activation memory of the last training run on this rank (``MemoryStats``); tracking is on
        with ``swap=True`` or after ``features.memory_stats.track_memory(schedule)`` (see ``docs/memory.md``)."""
        return self.feature_result("memory_stats")

    def feature_result(self, name: str) -> Any:
        """What the registered feature ``name`` reports about this schedule (``register_feature``)."""
        feature = _FEATURES.get(name)
        if feature is None or feature.reader is None:
            reporting = sorted(f.name for f in _FEATURES.values() if f.reader is not None)
            raise RuntimeError(f"no registered feature {name!r} reports results; those that do: {reporting}")
        return feature.reader(self)

    def zero_grad(self) -> None:
        """Drop the gradients of every parameter of this rank's stages."""
        self.platform.zero_grads(self._params())

    def run(self, *args: Any, target: Any = None, **kwargs: Any) -> list[Any]:
        """One training step: returns the per-micro-batch losses on the last stage's rank, else []."""
        return self._train(args, kwargs, target, keep_outputs=self.output_concat_dim is not None,
                           concat_dim=self.output_concat_dim)

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True,
             **kwargs: Any) -> Any:
        """torch.distributed.pipelining's ``step``: one training step (forward only without a
        ``loss_fn``, as there); fills ``losses`` with the per-micro-batch losses on the last
        stage's rank and returns the last stage's outputs merged along ``output_concat_dim``
        (default 0) there, ``None`` elsewhere."""
        dim = 0 if self.output_concat_dim is None else self.output_concat_dim
        if self.loss_fn is None:
            return self._forward(args, kwargs, None, concat_dim=dim, want_outputs=True, losses=None)
        per_micro = self._train(args, kwargs, target, keep_outputs=return_outputs, concat_dim=dim)
        if losses is not None:
            losses.extend(per_micro)
        return self.outputs if return_outputs and self.stages[-1].is_last else None

    def eval(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        """Forwards only, no graph kept and no gradient touched: the per-micro-batch losses on the
        last stage's rank when a ``loss_fn`` and a target are given, else the last stage's outputs
        merged along ``output_concat_dim`` (default 0); ``None`` on ranks without the last stage."""
        dim = 0 if self.output_concat_dim is None else self.output_concat_dim
        with_loss = self.loss_fn is not None and target is not None
        return self._forward(args, kwargs, target if with_loss else None, concat_dim=dim, want_outputs=not with_loss,
                             losses=[] if with_loss else None)

    # ------------------------------------------------------------------ the pieces of a run
    def _check_target(self, target: Any, needs_loss: bool) -> None:
        if not self.stages[-1].is_last:
            return
        if needs_loss and self.loss_fn is not None and target is None:
            raise ValueError("loss_fn was given but run() got no target on the rank holding the last stage")
        if self.loss_fn is None and target is not None:
            raise ValueError("run() got a target but the schedule has no loss_fn to use it")

    def _split(self, args: Sequence[Any], kwargs: Mapping[str, Any], target: Any) -> tuple[list, list, list]:
        p, m = self.platform, self.micro_batch_num
        if self.stages[0].is_first:
            micro = split_inputs(p, args, kwargs, m, self.args_batch_dim, self.kwargs_batch_dim)
            device = self.stages[0].device
            if device is not None:
                micro = [(_place(p, a, device), _place(p, k, device)) for a, k in micro]
        else:
            micro = [((), {})] * m
        targets = split_target(p, target, m) if self.stages[-1].is_last and target is not None else []
        return [a for a, _ in micro], [k for _, k in micro], targets

    def _runtime(self, micro_args: list, micro_kwargs: list, targets: list, *, keep_outputs: bool,
                 forward_only: bool) -> PipelineRuntime:
        return PipelineRuntime(
            self.platform, self._by_index, self.stage_to_rank, micro_args, micro_kwargs, targets, self.loss_fn,
            batch_p2p=self.p2p_transport == "batch", keep_outputs=keep_outputs,
            loss_scale=1.0 / self.micro_batch_num if self.scale_grads else 1.0, forward_only=forward_only,
            tracer=self.tracer, extra_handlers=self._step_handlers, group=self.group, tag=self._next_tag(),
        )

    def _next_tag(self) -> int:
        """The message tag of the next run: a run's messages never match another run's receives on
        engines with tags (gloo, LocalCluster), so a run after a failed one cannot take the failed
        run's leftover messages for its own."""
        self._runs += 1
        return 1 + (self._serial % 1000) * _RUNS_PER_TAG_BLOCK + self._runs % _RUNS_PER_TAG_BLOCK

    def _execute(self, runtime: PipelineRuntime, lowered: dict[int, list[MetaStep]]) -> None:
        self.tracer.start(self.platform, self.group)
        ctx = StepContext(self, runtime, runtime.micro_args, runtime.micro_kwargs, runtime.targets, runtime.losses)
        runtime.execute([s for s in lowered[self.pp_rank] if s is not None], self._custom, ctx)

    def _train(self, args: Sequence[Any], kwargs: Mapping[str, Any], target: Any, *, keep_outputs: bool,
               concat_dim: int | None) -> list[Any]:
        p = self.platform
        if not p.grad_enabled():
            raise RuntimeError(
                "schedule.run() was called with gradients disabled (e.g. inside torch.no_grad()); it trains. "
                "For forward-only evaluation call schedule.eval(...)"
            )
        self._check_target(target, needs_loss=True)
        micro_args, micro_kwargs, targets = self._split(args, kwargs, target)
        lowered = self._lowered(self._training_metadata())
        grads = RunGradients(p, self._params() + self._loss_params(), self.keep_grads_on_error,
                             shared_params.non_owner_params(p, self._by_index, self._holders), self._host_grads)
        runtime = self._runtime(micro_args, micro_kwargs, targets, keep_outputs=keep_outputs, forward_only=False)
        try:
            for hook in self._run_hooks:
                hook.before_run(self, runtime)
            self._execute(runtime, lowered)
            if self._holders:
                shared_params.sum_gradients(p, self._by_index, self._holders)
            for hook in self._run_hooks:
                hook.after_run(self, runtime)
        except BaseException:
            grads.restore()
            for hook in self._run_hooks:
                hook.on_failure(self)
            raise
        self.peak_activations = runtime.peak_activations
        return self._results(runtime, keep_outputs, concat_dim)

    def _forward(self, args: Sequence[Any], kwargs: Mapping[str, Any], target: Any, *, concat_dim: int,
                 want_outputs: bool, losses: list | None) -> Any:
        for hook in self._run_hooks:
            before_eval = getattr(hook, "before_eval", None)  # hooks written before before_eval existed
            if before_eval is not None:
                before_eval(self)
        micro_args, micro_kwargs, targets = self._split(args, kwargs, target)
        runtime = self._runtime(micro_args, micro_kwargs, targets, keep_outputs=want_outputs, forward_only=True)
        self._execute(runtime, self._lowered("all" if self.dyn_shape else "first", forward_only=True))
        results = self._results(runtime, want_outputs, concat_dim)
        if not self.stages[-1].is_last:
            return None
        return results if losses is not None else self.outputs

    def _results(self, runtime: PipelineRuntime, keep_outputs: bool, concat_dim: int | None) -> list[Any]:
        if not self.stages[-1].is_last:
            self.outputs = None
            return []
        m = self.micro_batch_num
        if keep_outputs and concat_dim is not None:
            self.outputs = merge_outputs(self.platform, [runtime.stage_outputs[i] for i in range(m)], concat_dim)
        return [runtime.losses[i] for i in range(m) if i in runtime.losses]


def _forwards_only(compute: Schedule) -> Schedule:
    """The forward steps of a compute schedule, in the same order (removing steps only removes waits)."""
    out: Schedule = {}
    for rank, steps in compute.items():
        kept: list[MetaStep | None] = []
        for step in steps:
            if step is None:
                continue
            kept += [part for part in step.parts if part.meta_type is _T.FWD]
        out[rank] = kept
    return out


def _place(platform: Any, value: Any, device: Any) -> Any:
    """``value`` with every tensor inside it moved to ``device``."""
    if platform.is_tensor(value):
        return platform.to_stage_device(value, device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_place(platform, v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_place(platform, v, device) for v in value)
    if isinstance(value, Mapping):
        return type(value)((k, _place(platform, v, device)) for k, v in value.items())
    return value


class ScheduleGPipe(PipelineSchedule):
    """All forwards, then all backwards."""

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_gpipe(num_ranks, num_microbatches)


class Schedule1F1B(PipelineSchedule):
    """Warm-up forwards, then one forward one backward, then cool-down backwards."""

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_1f1b(num_ranks, num_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """1F1B over several looped chunks per rank (stage c*p + r on rank r)."""

    placement = "looped"
    min_chunks, max_chunks = 2, 64

    def __init__(self, stages: Sequence[PipelineStage], micro_batch_num: int | None = None, overlap_b_f: bool = False,
                 **common: Any):
        """``overlap_b_f=True``: in the steady state, a backward and the forward of another chunk
        that follows it become one ``OVERLAP_B_F`` step (run on ``comm_compute_overlap`` when
        given, else one after the other); see ``schedules/overlap_pairs.py``."""
        if not isinstance(overlap_b_f, bool):
            raise TypeError(f"overlap_b_f must be a bool, got {overlap_b_f!r}")
        if common.get("comm_compute_overlap") is not None and not overlap_b_f:
            raise ValueError(
                "comm_compute_overlap runs the overlapped (backward, forward) pairs, which "
                "ScheduleInterleaved1F1B makes only with overlap_b_f=True"
            )
        self.overlap_b_f = overlap_b_f
        super().__init__(stages, micro_batch_num, **common)

    @classmethod
    def min_overlap_microbatches(cls, num_ranks: int) -> int:
        """The fewest micro-batches with which ``overlap_b_f=True`` makes an ``OVERLAP_B_F`` pair, for
        any number of chunks: with m <= p every forward of a rank runs in its warm-up."""
        return num_ranks + 1

    def _compute_schedule(self) -> Schedule:
        compute = super()._compute_schedule()
        return fuse_overlap_pairs(compute, self.stage_to_pp_rank) if self.overlap_b_f else compute

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_interleaved_1f1b(num_ranks, num_chunks, num_microbatches)


class ScheduleLoopedBFS(PipelineSchedule):
    """Breadth first over looped chunks: every micro-batch through a chunk before the next."""

    placement = "looped"
    min_chunks, max_chunks = 1, 64

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_looped_bfs(num_ranks, num_chunks, num_microbatches)
