"""ScheduleMPipeTranspose: the preprocess of stage 0 computed by the micro-batches' owners.

In a multimodal model the first stage also runs a *preprocess* for every micro-batch (a vision
encoder, the first T layers, or only the data loading) while the other ranks wait for their
first input. MPipe transposes that work: every pipeline rank owns some micro-batches
(`mpipe_plan.owner_of`), runs their preprocess in its own warm-up idle time and sends the result
to stage 0's rank. ``stages[0]`` wraps only the body after the preprocess; the preprocess module
exists on every pipeline rank and is called as ``preprocess_module(*micro_batch_args)``; what it
returns (a tensor or a tuple of tensors) are stage 0's positional inputs. With
``num_transpose_layers=0`` there is no preprocess to train (dataload only): with
``preprocess_module=None`` or the framework's identity module the owners ship their raw inputs,
which are stage 0's inputs; another module without trainable parameters is run by the owners
without a backward.

A trainable preprocess: its parameters are broadcast from stage 0's rank when the schedule is
built (and by `sync_preprocess`); its backward recomputes the preprocess on stage 0's rank from
the inputs (default) or, with ``owner_backward=True``, runs on the owner from its kept graph, the
gradient of stage 0's inputs coming back to it. The recompute draws the random numbers the owner's
forward drew: the owner runs that forward from a seed drawn from its own random state and ships the
seed in the message header. After ``run`` the preprocess gradients of every
pipeline rank are the owners' contributions summed over the pipeline group, so they equal the
gradient of a non-pipelined step and identical optimizer steps keep the copies in sync. A frozen
preprocess (no trainable parameter) has no backward and no broadcast.

Inputs: every rank calls ``run(*args, target=...)``. With ``inputs="global"`` (default) every rank
passes the whole batch and uses the micro-batches it owns; with ``inputs="owned"`` a rank passes
only the micro-batches it owns, concatenated in micro-batch order (`MPipeBatchSampler` gives a
data loader those indices); the rank holding the last stage passes the target of the whole batch.

Supported: one chunk per rank (1F1B) or several (interleaved 1F1B), any micro-batch count,
``overlap_p2p``, ``scale_grads``, ``eval`` and ``step``. Not supported (ValueError):
``p2p_transport="batch"`` (MPipe's schedules are checked under the eager engines: gloo,
LocalCluster; ``"auto"`` picks ``"plain"``), ``dyn_shape=True`` (stage 0's rank sizes every
message from its own micro-batch 0), keyword inputs to ``run``, ``owner_backward=True`` without a
trainable preprocess, a preprocess with trainable parameters and ``num_transpose_layers=0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.features.compiled_check import check_activation_features
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.runtime.meta import TensorMeta, describe
from hyper_parallel.core.pipeline_parallel.runtime.microbatch import split_inputs, split_target
from hyper_parallel.core.pipeline_parallel.features.mpipe.model import check_mpipe, place_mpipe_steps, simulate_mpipe
from hyper_parallel.core.pipeline_parallel.features.mpipe.rank_plan import plan_mpipe_rank
from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import (
    MPipeBatchSampler,
    MPipePlan,
    check_overflow_mode,
    owned_sample_indices,
)
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.ir.placement import is_int
from hyper_parallel.core.pipeline_parallel.runtime.executor import PipelineRuntime, StageError, _PendingSend
from hyper_parallel.core.pipeline_parallel.schedule import RunHook, ScheduleInterleaved1F1B, _forwards_only
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

__all__ = ["INPUT_SCOPES", "MPipeBatchSampler", "ScheduleMPipeTranspose", "owned_sample_indices"]

INPUT_SCOPES = ("global", "owned")
_T = MetaStepType


class PreprocessError(RuntimeError):
    """The preprocess (forward or backward) of a micro-batch raised; the cause is chained."""


class ScheduleMPipeTranspose(ScheduleInterleaved1F1B):
    """1F1B (one stage per rank) or interleaved 1F1B with MPipe transposition of stage 0's
    preprocess (see the module docstring).

    ``preprocess_cost`` (default 1: one rank's share of the body) only guides where the
    overflow micro-batches of ``overflow_mode="full"`` are preprocessed on their owners.
    """

    min_chunks, max_chunks = 1, 64

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], micro_batch_num: int | None = None,
                 preprocess_module: Any = None, num_transpose_layers: int | None = None,
                 overflow_mode: str = "full", owner_backward: bool = False, *, inputs: str = "global",
                 preprocess_cost: float = 1.0, **common: Any) -> None:
        if num_transpose_layers is None:
            raise TypeError("ScheduleMPipeTranspose needs num_transpose_layers (0 for a dataload-only pipeline)")
        if not is_int(num_transpose_layers):
            raise TypeError(f"num_transpose_layers must be an int, got {num_transpose_layers!r}")
        if num_transpose_layers < 0:
            raise ValueError(f"num_transpose_layers must be >= 0, got {num_transpose_layers}")
        check_overflow_mode(overflow_mode)
        if not isinstance(owner_backward, bool):
            raise TypeError(f"owner_backward must be a bool, got {owner_backward!r}")
        if inputs not in INPUT_SCOPES:
            raise ValueError(f"inputs must be one of {INPUT_SCOPES}, got {inputs!r}")
        if num_transpose_layers == 0 and owner_backward:
            raise ValueError("owner_backward=True needs a trainable preprocess; num_transpose_layers=0 has none")
        if preprocess_module is not None and not callable(preprocess_module):
            raise TypeError(f"preprocess_module must be callable, got {type(preprocess_module).__name__}")
        if isinstance(preprocess_cost, bool) or not isinstance(preprocess_cost, (int, float)) or preprocess_cost < 0:
            raise ValueError(f"preprocess_cost must be a number >= 0, got {preprocess_cost!r}")
        transport = common.pop("p2p_transport", "auto")
        if transport == "batch":
            raise ValueError("ScheduleMPipeTranspose supports p2p_transport='plain' only (its transfers are checked "
                             "under the eager engines: gloo, LocalCluster); 'auto' picks 'plain'")
        listed = [stages] if isinstance(stages, PipelineStage) else list(stages) if isinstance(stages, (list, tuple)) else []
        if any(isinstance(st, PipelineStage) and st.dyn_shape for st in listed):
            raise ValueError("ScheduleMPipeTranspose needs static shapes (dyn_shape=False): stage 0's rank sizes every "
                             "MPipe message from its own micro-batch 0")
        super().__init__(stages, micro_batch_num, p2p_transport="plain" if transport == "auto" else transport,
                         **common)
        self.preprocess_module = preprocess_module
        check_activation_features(self)  # the preprocess too (the run hook checks it before each run)
        self.num_transpose_layers = num_transpose_layers
        self.overflow_mode = overflow_mode
        self.owner_backward = owner_backward
        self.inputs = inputs
        self.preprocess_cost = float(preprocess_cost)
        p = self.platform
        named = p.named_parameters(preprocess_module) if preprocess_module is not None else []
        if num_transpose_layers == 0 and named:
            raise ValueError(
                "num_transpose_layers=0 is the dataload-only mode: the owners run a parameter-free preprocess "
                "(e.g. nn.Identity()) or none and nothing of it is trained, so trainable parameters "
                f"{[n for n, _ in named][:4]} of the preprocess would get no gradient; pass the preprocess's layer "
                "count as num_transpose_layers to train it with MPipe, freeze it, or pass preprocess_module=None")
        self._pre_named: list[tuple[str, Any]] = named
        self._agree_on_preprocess()
        trainable = num_transpose_layers > 0 and bool(named)
        if owner_backward and not trainable:
            raise ValueError("owner_backward=True needs a trainable preprocess, but the preprocess has no trainable "
                             "parameter (a frozen preprocess has no backward)")
        if trainable:
            for op in ("all_reduce", "broadcast"):
                reason = p.collective_unsupported_reason(op, self.group)
                if reason:
                    raise ValueError(f"a trainable MPipe preprocess needs {op} over the pipeline group: {reason}")
        backward = ("owner" if owner_backward else "recompute") if trainable else None
        self.plan = MPipePlan(self.num_ranks, self.micro_batch_num, overflow_mode, True, num_transpose_layers > 0,
                              backward, ship_inputs=backward == "recompute" and inputs == "owned")
        self.add_feature(lowering_pass=self._insert_steps, handlers=_HANDLERS, hook=_PreprocessGradients())
        self._lowered(self._training_metadata())  # fail before any run if the MPipe steps cannot run
        if trainable:
            self.sync_preprocess()

    # ------------------------------------------------------------------ construction
    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
        if num_chunks == 1:
            return generate_1f1b(num_ranks, num_microbatches)
        return generate_interleaved_1f1b(num_ranks, num_chunks, num_microbatches)

    def _agree_on_preprocess(self) -> None:
        """Every pipeline rank has the same preprocess settings and parameter shapes (one exchange)."""
        p = self.platform
        mine = {
            "num_transpose_layers": self.num_transpose_layers, "overflow_mode": self.overflow_mode,
            "owner_backward": self.owner_backward, "inputs": self.inputs,
            "has_preprocess": self.preprocess_module is not None,
            "params": [(tuple(p.shape(prm)), p.dtype_name(prm)) for _, prm in self._pre_named],
        }
        everyone = p.all_gather_object(mine, self.group)
        ranks = self.group.ranks
        if self.num_transpose_layers > 0:
            missing = [ranks[k] for k, theirs in enumerate(everyone) if not theirs["has_preprocess"]]
            if missing:
                raise ValueError(f"num_transpose_layers={self.num_transpose_layers} needs the preprocess_module on "
                                 f"every pipeline rank, but rank(s) {missing} passed none")
        keys = ("num_transpose_layers", "overflow_mode", "owner_backward", "inputs", "params", "has_preprocess")
        for key in keys if self.num_transpose_layers == 0 else keys[:-1]:  # T=0: all run one, or none does
            for k, theirs in enumerate(everyone):
                if theirs[key] != everyone[0][key]:
                    what = {"params": "the preprocess's parameter shapes",
                            "has_preprocess": "whether a preprocess_module was passed"}.get(key, key)
                    raise ValueError(f"pipeline ranks disagree on {what}: rank {ranks[0]} has {everyone[0][key]!r} "
                                     f"but rank {ranks[k]} has {theirs[key]!r}")

    def _plan(self, metadata: str, forward_only: bool) -> dict[int, list[MetaStep]]:
        """This rank's list alone (``mpipe/rank_plan.py``) on gloo's eager engine when MPipe's is the
        only lowering pass; else (or where that pass cannot prove it) every rank's, as the base
        class plans them with the passes."""
        if self.platform.device_type == "cpu" and self._passes == [self._insert_steps]:
            compute = _forwards_only(self.compute_schedule) if forward_only else self.compute_schedule
            share, pre = self._placement_costs()
            own = plan_mpipe_rank(compute, self.stage_to_pp_rank, self.pp_rank, self.plan, metadata=metadata,
                                  prefetch=self.overlap_p2p, forward_only=forward_only, costs=share, preprocess=pre)
            if own is not None:
                return {self.pp_rank: own}
        return super()._plan(metadata, forward_only)

    def _placement_costs(self) -> tuple[CostModel, StageCost]:
        return (CostModel.per_rank_share(self.num_ranks, len(self.stages)),
                StageCost(F=self.preprocess_cost, B=2 * self.preprocess_cost))

    def _insert_steps(self, lowered: dict[int, list[MetaStep]], schedule: Any, forward_only: bool
                      ) -> dict[int, list[MetaStep]]:
        share, pre = self._placement_costs()
        out = place_mpipe_steps(lowered, self.stage_to_pp_rank, self.plan, forward_only, share, pre)
        check_mpipe(out, self.stage_to_pp_rank, self.plan, forward_only)
        return out

    # ------------------------------------------------------------------ public API
    @property
    def preprocess_trainable(self) -> bool:
        return self.plan.backward is not None

    def owner_of(self, micro: int) -> int:
        """Global rank that preprocesses micro-batch ``micro``."""
        return self.group.ranks[self.plan.owner(micro)]

    def owned_microbatches(self, rank: int | None = None) -> list[int]:
        """The micro-batches a pipeline rank (global ``rank``; default: this one) owns."""
        pp = self.pp_rank if rank is None else self.group.group_rank(rank)
        return self.plan.owned(pp)

    def owned_sample_indices(self, global_batch_size: int, rank: int | None = None, offset: int = 0) -> list[int]:
        """Rows of a global batch that a rank reads with ``inputs="owned"`` (see `owned_sample_indices`)."""
        pp = self.pp_rank if rank is None else self.group.group_rank(rank)
        return owned_sample_indices(pp, self.num_ranks, self.micro_batch_num, global_batch_size, self.overflow_mode,
                                    offset)

    def batch_sampler(self, dataset_size: int, global_batch_size: int) -> MPipeBatchSampler:
        """A `MPipeBatchSampler` for this rank's data loader (``inputs="owned"``)."""
        return MPipeBatchSampler(dataset_size, global_batch_size, self.micro_batch_num, self.num_ranks, self.pp_rank,
                                 self.overflow_mode)

    def sync_preprocess(self) -> None:
        """Broadcast the preprocess parameters from stage 0's rank to every pipeline rank (a
        collective; e.g. after loading a checkpoint on stage 0's rank only)."""
        p = self.platform
        for _, param in self._pre_named:
            value = p.broadcast(p.clone(p.param_data(param)), self.group.ranks[0], self.group)
            p.assign_param(param, value)

    def preprocess_parameters(self) -> list[Any]:
        """The trainable parameters of the preprocess (every pipeline rank holds a copy)."""
        return [param for _, param in self._pre_named]

    def _params(self) -> list[Any]:
        params = super()._params()
        seen = {id(x) for x in params}
        return params + [x for x in self.preprocess_parameters() if id(x) not in seen]

    def named_parameters(self) -> dict[str, Any]:
        """The stages' parameters (``stage<i>.<name>``) and the preprocess's (``preprocess.<name>``)."""
        out = super().named_parameters()
        for name, param in self._pre_named:
            out[f"preprocess.{name}"] = param
        return out

    def simulate(self, layers_per_stage: float = 1.0, costs: CostModel | None = None, load_ms: float = 0.0,
                 transpose: bool = True) -> Any:
        """`mpipe_model.simulate_mpipe` of this schedule (``transpose=False``: the plain pipeline)."""
        return simulate_mpipe(self.num_ranks, len(self.stages), self.micro_batch_num, self.num_transpose_layers,
                              layers_per_stage=layers_per_stage, costs=costs, load_ms=load_ms,
                              overflow_mode=self.overflow_mode, transpose=transpose,
                              trainable=self.preprocess_trainable, owner_backward=self.owner_backward,
                              inputs=self.inputs, overlap_p2p=self.overlap_p2p)

    # ------------------------------------------------------------------ the pieces of a run
    def _split(self, args: Sequence[Any], kwargs: Any, target: Any) -> tuple[list, list, list]:
        p, m = self.platform, self.micro_batch_num
        if kwargs:
            raise ValueError(f"ScheduleMPipeTranspose ships positional tensors only; pass {sorted(kwargs)} "
                             "positionally (the preprocess, or stage 0, receives them in that order)")
        owned = self.plan.owned(self.pp_rank)
        wanted = set(owned)
        if self.pp_rank == 0 and self.plan.backward == "recompute" and self.inputs == "global":
            wanted = set(range(m))  # the recompute on stage 0's rank reads its own copy of the inputs
        micro_args: list[tuple[Any, ...]] = [()] * m
        if wanted:
            if not args:
                raise ValueError(f"rank {p.rank} owns micro-batches {owned} but run() got no inputs")
            if self.inputs == "global":
                parts = dict(enumerate(split_inputs(p, args, {}, m, self.args_batch_dim)))
            else:
                parts = dict(zip(owned, split_inputs(p, args, {}, len(owned), self.args_batch_dim), strict=True))
            device = self.stages[0].device
            for j in sorted(wanted):
                values = parts[j][0]
                for k, value in enumerate(values):
                    if not p.is_tensor(value):
                        raise TypeError(f"MPipe ships tensors: positional input {k} is a {type(value).__name__}")
                micro_args[j] = tuple(p.to_stage_device(v, device) for v in values)
        targets = split_target(p, target, m) if self.stages[-1].is_last and target is not None else []
        return micro_args, [{}] * m, targets

    def _runtime(self, micro_args: list, micro_kwargs: list, targets: list, *, keep_outputs: bool,
                 forward_only: bool) -> PipelineRuntime:
        runtime = MPipeRuntime(
            self.platform, self._by_index, self.stage_to_rank, micro_args, micro_kwargs, targets, self.loss_fn,
            batch_p2p=False, keep_outputs=keep_outputs,
            loss_scale=1.0 / self.micro_batch_num if self.scale_grads else 1.0, forward_only=forward_only,
            tracer=self.tracer, extra_handlers=self._step_handlers,
        )
        runtime.setup_mpipe(self)
        return runtime


class MPipeRuntime(PipelineRuntime):
    """The runtime with stage 0's inputs made by the preprocess, and the MPipe steps."""

    def setup_mpipe(self, schedule: ScheduleMPipeTranspose) -> None:
        self.plan = schedule.plan.with_backward(self.forward_only)
        module = schedule.preprocess_module
        # T=0 with the framework's identity module is the dataload-only mode for any number of inputs
        # (nn.Identity takes one); another parameter-free module is run by the owners
        identity = schedule.num_transpose_layers == 0 and module is not None and self.p.is_identity_module(module)
        self.module = None if identity else module
        self.pre_params = schedule.preprocess_parameters()
        ranks = schedule.group.ranks
        self.zero = ranks[0]
        self.owner = lambda j: ranks[self.plan.owner(j)]
        self.raw = {j: args for j, args in enumerate(self.micro_args) if args}
        self.features: dict[int, tuple[Any, ...]] = {}
        self.incoming: dict[int, tuple[list[Any], list[Any], MetaStep, int]] = {}  # j -> (handles, buffers, step, peer)
        self.pre_records: dict[int, Any] = {}
        self.recompute_inputs: dict[int, tuple[Any, ...]] = {}
        self.input_grads: dict[int, tuple[Any, ...]] = {}
        self.metas: list[TensorMeta] | None = None  # stage 0's inputs of micro-batch 0 (stage 0's rank)
        self.raw_metas: list[TensorMeta] = []
        self.device = next(iter(self.stages.values())).device
        # stage 0's rank recomputes the other owners' preprocess: each owner runs its forward from a seed
        # drawn from its own random state and ships the seed, so the recompute draws the same (dropout) masks
        self.replay_rng = self.plan.backward == "recompute"
        self.rng_seeds: dict[int, int] = {}  # j -> seed of its preprocess forward (-1: nothing to replay)

    # ------------------------------------------------------------------ driver
    def execute(self, steps: Sequence[MetaStep], custom: dict, ctx: Any) -> None:
        super().execute(steps, custom, ctx)
        if self.incoming:
            raise RuntimeError(f"rank {self.rank}: MPipe receives never consumed: "
                               f"{[str(v[2]) for v in self.incoming.values()]}")

    def _meta_of(self, tensor: Any, grads: bool) -> TensorMeta:
        p = self.p
        return TensorMeta(tuple(p.shape(tensor)), p.dtype_name(tensor),
                          grads and p.is_floating(tensor) and p.requires_grad(tensor))

    # ------------------------------------------------------------------ the MPipe steps
    def pre_forward(self, step: MetaStep) -> None:
        j = step.micro_index
        raw = self.raw.get(j)
        if raw is None:
            raise RuntimeError(f"rank {self.rank} has no inputs of micro-batch {j}, which it owns")
        p = self.p
        mine = self.rank == self.zero
        keep = self.plan.backward is not None and (mine or self.plan.backward == "owner")
        if self.module is None:  # dataload only
            outputs = tuple(raw)
        else:  # the preprocess, or a parameter-free one with num_transpose_layers=0
            try:
                if keep:
                    record = p.stage_forward(self.module, raw, {}, self.pre_params, [False] * len(raw))
                    self.pre_records[j] = record
                    outputs = tuple(record.outputs)
                else:
                    seed = -1
                    if self.replay_rng:  # stage 0's rank recomputes this forward
                        drawn = p.draw_rng_seed()
                        seed = -1 if drawn is None else drawn
                        self.rng_seeds[j] = seed
                    result = self._seeded(seed, lambda: p.stage_forward_no_grad(self.module, raw, {}))
                    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            except Exception as exc:
                raise PreprocessError(f"rank {self.rank}: the preprocess of micro-batch {j} ({step}) failed: "
                                      f"{type(exc).__name__}: {exc}") from exc
            for k, out in enumerate(outputs):
                if not p.is_tensor(out):
                    raise TypeError(f"the preprocess must return tensors (stage 0's inputs), output {k} of "
                                    f"micro-batch {j} is a {type(out).__name__}")
        metas = [self._meta_of(o, keep) for o in outputs]
        if mine and self.metas is None:
            self.metas = metas
            self.raw_metas = [self._meta_of(r, False) for r in raw]
        elif mine and [(m.shape, m.dtype) for m in metas] != [(m.shape, m.dtype) for m in self.metas]:
            raise ValueError(f"MPipe needs the same shapes in every micro-batch: the preprocess gave "
                             f"{describe(metas)} for micro-batch {j} but {describe(self.metas)} for micro-batch 0")
        self.features[j] = outputs

    def _seeded(self, seed: int, call: Callable[[], Any]) -> Any:
        """``call()`` with the process-wide random state made from ``seed`` (-1: as it is), the
        previous state put back after."""
        if seed < 0:
            return call()
        p = self.p
        outer = p.get_rng_state()
        p.seed_rng(seed)
        try:
            return call()
        finally:
            p.set_rng_state(outer)

    def _payload_metas(self) -> list[TensorMeta]:
        if self.metas is None:
            raise RuntimeError(f"rank {self.rank}: an MPipe receive came before the preprocess of micro-batch 0")
        return list(self.metas) + (list(self.raw_metas) if self.plan.ship_inputs else [])

    def pre_send(self, step: MetaStep) -> None:
        j = step.micro_index
        tensors = list(self.features.pop(j))
        if self.plan.ship_inputs:
            tensors += list(self.raw[j])
        seed = [self.rng_seeds.pop(j)] if self.replay_rng else []  # rides at the end of the header
        header = self.p.tensor(_shape_header([self._meta_of(t, False) for t in tensors]) + seed, "int64")
        header = self.p.to_stage_device(header, self.device)
        for tensor in (header, *tensors):
            tensor = self.p.detach(tensor)
            self.sends.append(_PendingSend(self.p.isend(tensor, self.zero), tensor))

    def pre_recv(self, step: MetaStep) -> None:
        j = step.micro_index
        metas = self._payload_metas()
        peer = self.owner(j)
        expected = _shape_header(metas)
        buffers = [self.p.empty((len(expected) + self.replay_rng,), "int64", device=self.device)]
        buffers += [self.p.empty(m.shape, m.dtype, device=self.device) for m in metas]
        self.incoming[j] = ([self.p.irecv(b, peer) for b in buffers], buffers, step, peer)

    def _received(self, j: int) -> list[Any]:
        handles, buffers, step, peer = self.incoming.pop(j)
        self._wait(handles[0], step, peer)
        header = [int(v) for v in self.p.to_numpy(buffers[0]).reshape(-1)]
        if self.replay_rng:
            self.rng_seeds[j] = header.pop()
        expected = _shape_header(self._payload_metas())
        if header != expected:
            raise ValueError(f"MPipe: rank {peer} sent {_read_header(header)} for micro-batch {j}, but rank "
                             f"{self.rank} expects {_read_header(expected)} (the shapes of its micro-batch 0)")
        for handle in handles[1:]:
            self._wait(handle, step, peer)
        return buffers[1:]

    def _stage0_inputs(self, j: int) -> tuple[Any, ...]:
        if j in self.features:
            return self.features.pop(j)
        values = self._received(j)
        count = len(self.metas or ())
        if self.plan.ship_inputs:
            self.recompute_inputs[j] = tuple(values[count:])
        return tuple(values[:count])

    def pre_backward(self, step: MetaStep) -> None:
        j = step.micro_index
        p = self.p
        record = self.pre_records.pop(j, None)
        try:
            if record is None:  # recompute on stage 0's rank, drawing what the owner's forward drew
                raw = self.recompute_inputs.pop(j, None) or self.raw[j]
                record = self._seeded(self.rng_seeds.pop(j, -1),
                                      lambda: p.stage_forward(self.module, raw, {}, self.pre_params,
                                                              [False] * len(raw)))
        except Exception as exc:
            raise PreprocessError(f"rank {self.rank}: the preprocess recompute of micro-batch {j} ({step}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        grads = self._feature_grads(j, record)
        try:
            p.stage_backward(record, grads)
        except Exception as exc:
            raise PreprocessError(f"rank {self.rank}: the preprocess backward of micro-batch {j} ({step}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def _feature_grads(self, j: int, record: Any) -> list[Any]:
        flags = [self._meta_of(o, True).differentiable for o in record.outputs]
        if j in self.input_grads:  # made on this rank by stage 0's backward
            return [g if f else None for g, f in zip(self.input_grads.pop(j), flags, strict=True)]
        received = iter(self._received_grads(j))
        return [next(received) if f else None for f in flags]

    def _received_grads(self, j: int) -> list[Any]:
        handles, buffers, step, peer = self.incoming.pop(-1 - j)
        for handle in handles:
            self._wait(handle, step, peer)
        return buffers

    def pre_grad_send(self, step: MetaStep) -> None:
        j = step.micro_index
        grads = self.input_grads.pop(j)
        for g, meta in zip(grads, self.metas or (), strict=True):
            if not meta.differentiable:
                continue
            tensor = g if g is not None else self.p.zeros(meta.shape, meta.dtype, device=self.device)
            self.sends.append(_PendingSend(self.p.isend(tensor, self.owner(j)), tensor))

    def pre_grad_recv(self, step: MetaStep) -> None:
        j = step.micro_index
        record = self.pre_records[j]
        metas = [self._meta_of(o, True) for o in record.outputs]
        buffers = [self.p.empty(m.shape, m.dtype, device=self.device) for m in metas if m.differentiable]
        self.incoming[-1 - j] = ([self.p.irecv(b, self.zero) for b in buffers], buffers, step, self.zero)

    # ------------------------------------------------------------------ stage 0 on preprocessed inputs
    def _flags(self, inputs: tuple[Any, ...]) -> list[bool]:
        if self.forward_only or self.plan.backward is None:
            return [False] * len(inputs)
        return [m.differentiable for m in self.metas or ()]

    def forward(self, s: int, i: int, step: MetaStep | None = None) -> None:
        if s != 0:
            super().forward(s, i, step)
            return
        stage = self.stages[0]
        args = self._stage0_inputs(i)
        flags = self._flags(args)
        fn = self._stage_fn(stage, i)
        try:
            if self.forward_only:
                result = self.p.stage_forward_no_grad(fn, args, {})
                outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            else:
                record = self.p.stage_forward(fn, args, {}, stage.params, flags)
                outputs = record.outputs
        except Exception as exc:
            raise StageError(self.rank, step or MetaStep(i, _T.FWD, 0), exc) from exc
        # from here on as PipelineRuntime.forward does for any stage
        if not self.forward_only:
            self.records[(0, i)] = record
            self.live_activations += 1
            self.peak_activations = max(self.peak_activations, self.live_activations)
        if stage.is_last:
            self._last_stage_outputs(i, outputs)
            return
        for o in outputs:
            if not self.p.is_tensor(o):
                raise TypeError(f"stage 0 must return tensors to pass to stage 1, got {type(o).__name__}")
        self.out_meta[(0, i)] = [self._meta(o) for o in outputs]
        self.outputs[(0, i)] = outputs

    def backward(self, s: int, i: int, full: bool, step: MetaStep | None = None) -> None:
        if s != 0 or self.plan.backward is None:
            super().backward(s, i, full, step)
            return
        grads = self._output_grads(0, i)
        self.out_meta.pop((0, i), None)
        try:
            if full:
                input_grads = self.p.stage_backward(self.records.pop((0, i)), grads)
            else:
                input_grads = self.p.stage_backward_input(self.records[(0, i)], grads)
        except Exception as exc:
            raise StageError(self.rank, step or MetaStep(i, _T.BWD if full else _T.BWD_INPUT, 0), exc) from exc
        if full:
            self.live_activations -= 1
        self.input_grads[i] = tuple(input_grads)


def _shape_header(metas: Sequence[TensorMeta]) -> list[int]:
    """The shapes and dtypes of an MPipe message, as ints (checked by the receiver)."""
    from hyper_parallel.core.pipeline_parallel.runtime.meta import DTYPE_CODES

    out = [len(metas)]
    for m in metas:
        out += [DTYPE_CODES.index(m.dtype) if m.dtype in DTYPE_CODES else -1, len(m.shape), *m.shape]
    return out


def _read_header(values: Sequence[int]) -> str:
    from hyper_parallel.core.pipeline_parallel.runtime.meta import DTYPE_CODES

    count, pos, parts = values[0], 1, []
    for _ in range(count):
        code, ndim = values[pos], values[pos + 1]
        dtype = DTYPE_CODES[code] if 0 <= code < len(DTYPE_CODES) else "?"
        parts.append(f"{dtype}{list(values[pos + 2 : pos + 2 + ndim])}")
        pos += 2 + ndim
    return "(" + ", ".join(parts) + ")"


def _handler(name: str) -> Callable[[PipelineRuntime, MetaStep], None]:
    def run(runtime: PipelineRuntime, step: MetaStep) -> None:
        if not isinstance(runtime, MPipeRuntime):
            raise RuntimeError(f"{step} needs the MPipe runtime (ScheduleMPipeTranspose)")
        getattr(runtime, name)(step)

    return run


_HANDLERS = {
    _T.PRE_FWD: _handler("pre_forward"),
    _T.PRE_SEND: _handler("pre_send"),
    _T.PRE_RECV: _handler("pre_recv"),
    _T.PRE_BWD: _handler("pre_backward"),
    _T.PRE_GRAD_SEND: _handler("pre_grad_send"),
    _T.PRE_GRAD_RECV: _handler("pre_grad_recv"),
}


class _PreprocessGradients(RunHook):
    """Each run's preprocess gradients summed over the pipeline group, added to what was there."""

    def __init__(self) -> None:
        self.kept: list[tuple[Any, Any]] = []

    def before_run(self, schedule: Any, runtime: PipelineRuntime) -> None:
        if not schedule.preprocess_trainable:
            return
        p = schedule.platform
        self.kept = [(param, p.get_grad(param)) for param in schedule.preprocess_parameters()]
        for param, _ in self.kept:
            p.set_grad(param, None)

    def after_run(self, schedule: Any, runtime: PipelineRuntime) -> None:
        if not schedule.preprocess_trainable:
            return
        p = schedule.platform
        buckets: dict[tuple[Any, ...], list[tuple[Any, Any, Any]]] = {}  # one all-reduce per shape and dtype
        for param, before in self.kept:
            grad = p.get_grad(param)
            grad = p.clone(grad) if grad is not None else p.zeros_like(p.param_data(param))
            shape = tuple(p.shape(grad))
            key = (shape, p.dtype_name(grad)) if shape else ("scalar", id(param))
            buckets.setdefault(key, []).append((param, before, grad))
        for entries in buckets.values():
            grads = [grad for _, _, grad in entries]
            joined = p.all_reduce(grads[0] if len(grads) == 1 else p.cat(grads, 0), "sum", schedule.group)
            parts = [joined] if len(grads) == 1 else p.chunk(joined, len(grads), 0)
            for (param, before, _), total in zip(entries, parts, strict=True):
                p.set_grad(param, total if before is None else before + total)
        self.kept = []

    def on_failure(self, schedule: Any) -> None:
        p = schedule.platform
        for param, before in self.kept:
            p.set_grad(param, before)
        self.kept = []
