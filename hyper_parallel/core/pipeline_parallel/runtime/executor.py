"""Executes one rank's lowered step list for one training step (or one forward-only pass).

The runtime is the only place where pipeline steps touch tensors, always through the
platform. Conventions of the IR are those of ``lowering/p2p.py``: ``FWD_SEND(s, i)`` sends stage
s's output of micro-batch i to stage s+1, ``FWD_RECV(s, i)`` receives stage s's input,
``SEND_META`` / ``RECV_META`` carry the shapes of a forward output ahead of it on the
metadata channel, ``BWD_SEND(s, i)`` sends stage s's input gradient to stage s-1 and
``BWD_RECV(s, i)`` receives the gradient of stage s's output. Neighbouring stages on the same
rank hand tensors over directly.

A receive is posted at its slot and waited by the compute that consumes it; a metadata
receive is waited at once (the data receive behind it needs the shapes). Sends never block a
slot: they complete by the end of the step, and an output's storage is released as soon as
its send has completed (only its autograd link is kept until its backward), unless the stage
was built with ``free_sent_outputs=False``. A wait still blocked after
``HYPER_PARALLEL_WAIT_LOG_INTERVAL`` seconds is logged with the step and the peer.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.runtime import dtensor_boundary
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import peer_rank
from hyper_parallel.core.pipeline_parallel.runtime.meta import TensorMeta, decode_meta, describe, encode_meta
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.runtime.wait_watch import (
    WaitSlot,
    release_slot,
    wait_log_interval,
    wait_slot,
    watched,
)
from hyper_parallel.platform.base import Handle, P2POp, Platform, WaitAborted

Key = tuple[int, int]  # (stage index, micro-batch index)
CustomFunction = Callable[[MetaStep, "StepContext"], None]
_T = MetaStepType
_NOT_WATCHED = contextlib.nullcontext()
# steps that need no saved-tensor pool: forwards, full backwards and their communication
_PLAIN = frozenset({
    _T.FWD, _T.BWD, _T.FWD_SEND, _T.FWD_RECV, _T.BWD_SEND, _T.BWD_RECV, _T.META_SEND, _T.META_RECV,
    _T.BATCH_SEND_RECV, _T.OVERLAP_B_F, _T.OVERLAP_F_B,
})


def _is_plain(step: MetaStep) -> bool:
    return step.meta_type in _PLAIN and all(_is_plain(sub) for sub in step.sub_steps or ())
P2P_TYPES = frozenset({_T.FWD_SEND, _T.FWD_RECV, _T.BWD_SEND, _T.BWD_RECV})


class StageError(RuntimeError):
    """A stage's forward, loss or backward raised; the original exception is the ``__cause__``."""

    def __init__(self, rank: int, step: MetaStep, error: BaseException) -> None:
        what = {_T.FWD: "forward", _T.BWD: "backward", _T.BWD_INPUT: "input backward",
                _T.BWD_WEIGHT: "weight backward"}.get(step.meta_type, step.meta_type.name)
        super().__init__(
            f"rank {rank}: the {what} of stage {step.stage_index} on micro-batch {step.micro_index} ({step}) "
            f"failed: {type(error).__name__}: {error}"
        )
        self.rank = rank
        self.step = step
        self.error = error


class PeerError(RuntimeError):
    """A wait on another rank failed: that rank stopped, failed or closed the connection."""


@dataclass
class _PendingRecv:
    handles: list[Handle]
    buffers: list[Any]
    metas: list[TensorMeta]
    peer: int
    step: MetaStep


@dataclass
class _PendingSend:
    handle: Handle
    keep_alive: Any  # the sent tensor: not every engine's handle holds it until the send completes
    release: list[Any] = field(default_factory=list)


@dataclass
class StepContext:
    """What a custom step function gets: the schedule, the micro-batched data and the runtime."""

    schedule: Any
    runtime: PipelineRuntime
    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    targets: list[Any]
    losses: dict[int, Any]

    def run_default(self, step: MetaStep) -> None:
        """Run ``step`` the way the runtime would without the custom function."""
        self.runtime.run_step(step)


class PipelineRuntime:
    """State of one rank during one ``schedule.run`` / ``schedule.eval``."""

    def __init__(
        self,
        platform: Platform,
        stages: dict[int, PipelineStage],
        stage_to_rank: dict[int, int],
        micro_args: list[tuple[Any, ...]],
        micro_kwargs: list[dict[str, Any]],
        targets: list[Any],
        loss_fn: Callable[[Any, Any], Any] | None,
        *,
        batch_p2p: bool,
        keep_outputs: bool,
        loss_scale: float = 1.0,
        forward_only: bool = False,
        tracer: Any = None,
        group: Any = None,
        tag: int = 0,
        extra_handlers: dict[MetaStepType, Callable[[PipelineRuntime, MetaStep], None]] | None = None,
    ) -> None:
        self.p = platform
        self.rank = platform.rank
        self.stages = stages
        self.stage_rank = stage_to_rank
        self.micro_args, self.micro_kwargs, self.targets = micro_args, micro_kwargs, targets
        self.loss_fn = loss_fn
        self.batch_p2p = batch_p2p
        self.keep_outputs = keep_outputs
        self.loss_scale = loss_scale
        self.forward_only = forward_only
        self.tracer = tracer
        self.group = group  # the pipeline group: point-to-point goes through its communicator
        self.tag = tag  # this run's messages only match this run's receives (where the engine has tags)
        self.params = {s: stage.params for s, stage in stages.items()}  # read once per run
        # static shapes: what the first micro-batch of this run agreed across each stage boundary
        self.shapes_in: dict[int, list[TensorMeta]] = {}
        self.shapes_out: dict[int, list[TensorMeta]] = {}
        self.records: dict[Key, Any] = {}
        self.outputs: dict[Key, tuple[Any, ...]] = {}  # forward outputs waiting to be sent / handed over
        self.out_meta: dict[Key, list[TensorMeta]] = {}
        self.in_meta: dict[Key, list[TensorMeta]] = {}
        self.arrived_meta: dict[Key, list[TensorMeta]] = {}
        self.in_grads: dict[Key, tuple[Any, ...]] = {}  # input gradients waiting to be sent / handed over
        self.recvs: dict[tuple[str, int, int], _PendingRecv] = {}
        self.sends: deque[_PendingSend] = deque()  # backward sends, oldest first
        # forward data and metadata sends by (stage, micro-batch): settled when that micro-batch's output
        # gradient arrives
        self.forward_sends: dict[Key, list[_PendingSend]] = {}
        self.losses: dict[int, Any] = {}
        self.stage_outputs: dict[int, Any] = {}
        self.live_activations = 0
        self.peak_activations = 0
        self._peers: dict[int, tuple[MetaStep, int]] = {}  # id(step) -> (step, peer rank)
        self._handlers: dict[MetaStepType, Callable[[MetaStep], None]] = {
            _T.FWD: self._forward_step,
            _T.BWD: self._backward_step,
            _T.BWD_INPUT: self._backward_step,
            _T.BWD_WEIGHT: self._weight_step,
            _T.FWD_SEND: self._p2p_step,
            _T.FWD_RECV: self._p2p_step,
            _T.BWD_SEND: self._p2p_step,
            _T.BWD_RECV: self._p2p_step,
            _T.META_SEND: self._meta_send,
            _T.META_RECV: self._meta_recv,
            _T.BATCH_SEND_RECV: self._batch_step,
            _T.OVERLAP_B_F: self._overlap_step,
            _T.OVERLAP_F_B: self._overlap_step,
        }
        for kind, handler in (extra_handlers or {}).items():
            self._handlers[kind] = lambda step, handler=handler: handler(self, step)
        self.extras: dict[str, Any] = {}  # state of features that add steps (FSDP, swap, ...)
        self.wait_log_interval = wait_log_interval()  # read once per run, not once per wait
        self._wait_slot: WaitSlot | None = None  # watched during `execute` only; None: not watched
        self.saved_pool = True  # set per run by ``execute``

    # ------------------------------------------------------------------ driver
    def execute(self, steps: Sequence[MetaStep], custom: dict[MetaStepType, CustomFunction], ctx: StepContext) -> None:
        """Run this rank's lowered steps; its waits are watched (logged when long) only meanwhile:
        the watch thread is released, and joined when no other run uses it, however the run ends."""
        self._wait_slot = wait_slot(self._waiting_for, self.wait_log_interval)
        try:
            self._execute_steps(steps, custom, ctx)
        finally:
            slot, self._wait_slot = self._wait_slot, None
            release_slot(slot)

    def _execute_steps(self, steps: Sequence[MetaStep], custom: dict[MetaStepType, CustomFunction],
                       ctx: StepContext) -> None:
        tracer = self.tracer if self.tracer is not None and self.tracer.enabled else None
        # the saved-tensor pool is for the dx/dW split, swap steps and custom steps (which may read
        # the records): a run of plain forwards and full backwards goes without it
        self.saved_pool = bool(custom) or not all(_is_plain(step) for step in steps)
        for step in steps:
            fn = custom.get(step.meta_type)
            start = tracer.now() if tracer is not None else 0.0
            if fn is not None:
                fn(step, ctx)
            else:
                self.run_step(step)
            if tracer is not None:
                tracer.record(step, "p2p-issue" if step.meta_type.is_comm else "compute", start, tracer.now())
            if self.sends or self.forward_sends:
                self.release_completed_sends()
        for pending in self.sends:
            self._wait(pending.handle, None, None)
        self.sends.clear()
        for key in list(self.forward_sends):  # forward-only runs, and the outputs of the last micro-batches
            self.settle_forward_sends(*key, force=True)
        if self.recvs:
            raise RuntimeError(f"rank {self.rank}: receives never consumed: {[str(r.step) for r in self.recvs.values()]}")

    def run_step(self, step: MetaStep) -> None:
        handler = self._handlers.get(step.meta_type)
        if handler is None:
            raise NotImplementedError(
                f"rank {self.rank}: no runtime implementation for step {step}; "
                "use schedule.register_custom_function to provide one"
            )
        handler(step)

    # ------------------------------------------------------------------ compute
    def _forward_step(self, step: MetaStep) -> None:
        self.forward(step.stage_index, step.micro_index, step)

    def _backward_step(self, step: MetaStep) -> None:
        self.backward(step.stage_index, step.micro_index, full=step.meta_type is _T.BWD, step=step)

    def _weight_step(self, step: MetaStep) -> None:
        self.backward_weight(step.stage_index, step.micro_index, step)

    def _overlap_step(self, step: MetaStep) -> None:
        for sub in step.sub_steps or ():
            self.run_step(sub)

    def _stage_fn(self, stage: PipelineStage, micro: int) -> Callable[..., Any]:
        module = stage.submodule
        if not stage.is_last:
            return module
        loss_fn = self.loss_fn
        if loss_fn is None or (self.forward_only and not self.targets):
            if self.forward_only:  # the outputs are what eval returns
                return module

            def own_loss(*a: Any, **k: Any) -> Any:
                return (module(*a, **k),)  # the stage's output is the loss

            own_loss.__wrapped__ = module  # type: ignore[attr-defined]
            return own_loss
        target = self.targets[micro]

        def with_loss(*a: Any, **k: Any) -> Any:
            out = module(*a, **k)
            flat = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return (loss_fn(out, target), *flat)

        with_loss.__wrapped__ = module  # type: ignore[attr-defined]  # lets backends see the module
        # and the loss: MindSpore differentiates with respect to a list of parameters, so its backend
        # adds a loss_fn Cell's own (torch's backward reaches every trainable leaf by itself)
        with_loss.hyper_parallel_loss_fn = loss_fn  # type: ignore[attr-defined]
        return with_loss

    def forward(self, s: int, i: int, step: MetaStep | None = None) -> None:
        stage = self.stages[s]
        if stage.is_first:
            args, kwargs = self.micro_args[i], self.micro_kwargs[i]
            grad_args = [False] * len(args)
        else:
            args, metas = self._forward_inputs(s, i)
            kwargs = {}
            grad_args = [m.requires_grad for m in metas]
            self.in_meta[(s, i)] = metas
        fn = self._stage_fn(stage, i)
        fn, out_layouts = dtensor_boundary.local_call(fn, stage, self.in_meta.get((s, i)), not stage.is_last)
        try:
            if self.forward_only:
                result = self.p.stage_forward_no_grad(fn, args, kwargs)
                outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            else:
                record = self.p.stage_forward(fn, args, kwargs, self.params[s], grad_args,
                                              saved_pool=self._needs_pool(stage))
                outputs = record.outputs
        except Exception as exc:
            raise StageError(self.rank, step or MetaStep(i, _T.FWD, s), exc) from exc
        if not self.forward_only:
            self.records[(s, i)] = record
            self.live_activations += 1
            self.peak_activations = max(self.peak_activations, self.live_activations)
        if stage.is_last:
            self._last_stage_outputs(i, outputs)
            return
        stage.sends_one_tensor = sum(1 for o in outputs if self.p.is_tensor(o)) == 1
        for o in outputs:
            if not self.p.is_tensor(o):
                raise TypeError(
                    f"rank {self.rank}: stage {s} must return tensors to pass to stage {s + 1}, got "
                    f"{type(o).__name__} (micro-batch {i})"
                )
        self.out_meta[(s, i)] = dtensor_boundary.with_layouts([self._meta(o) for o in outputs], out_layouts)
        self.outputs[(s, i)] = outputs

    def _needs_pool(self, stage: PipelineStage) -> bool:
        """Whether this forward packs what its graph saves: for the dx/dW split, swap steps and custom
        steps (``saved_pool``), and for the stages that send several outputs (or have not run yet),
        where only the pool tells cheaply which sent output the graph saved."""
        return self.saved_pool or not (stage.is_last or getattr(stage, "sends_one_tensor", False))

    def _last_stage_outputs(self, i: int, outputs: tuple[Any, ...]) -> None:
        has_loss = not self.forward_only or (self.loss_fn is not None and bool(self.targets))
        if has_loss:
            loss = outputs[0]
            if not self.p.is_tensor(loss) or self.p.numel(loss) != 1:
                shape = self.p.shape(loss) if self.p.is_tensor(loss) else type(loss).__name__
                raise ValueError(f"rank {self.rank}: the loss of micro-batch {i} must be a scalar tensor, got {shape}")
            self.losses[i] = self.p.detach(loss)
        if self.keep_outputs:
            rest = outputs[1:] if has_loss and self.loss_fn is not None else outputs
            rest = [self.p.detach(o) if self.p.is_tensor(o) else o for o in rest]
            self.stage_outputs[i] = rest[0] if len(rest) == 1 else tuple(rest)

    def _output_grads(self, s: int, i: int) -> list[Any]:
        stage = self.stages[s]
        record = self.records[(s, i)]
        if stage.is_last:
            seed = self.p.ones_like(record.outputs[0])
            if self.loss_scale != 1.0:
                seed = seed * self.loss_scale
            return [seed] + [None] * (len(record.outputs) - 1)
        if (s + 1) in self.stages:  # handed over on this rank
            return list(self.in_grads.pop((s + 1, i)))
        received = iter(self._take_recv("B", s, i).buffers)
        return [next(received) if m.differentiable else None for m in self.out_meta[(s, i)]]

    def backward(self, s: int, i: int, full: bool, step: MetaStep | None = None) -> None:
        grads = self._output_grads(s, i)
        self.out_meta.pop((s, i), None)
        try:
            if full:
                input_grads = self.p.stage_backward(self.records.pop((s, i)), grads)
            else:  # the record stays until its weight backward
                input_grads = self.p.stage_backward_input(self.records[(s, i)], grads)
        except Exception as exc:
            raise StageError(self.rank, step or MetaStep(i, _T.BWD if full else _T.BWD_INPUT, s), exc) from exc
        if full:
            self.live_activations -= 1
        if not self.stages[s].is_first:
            self.in_grads[(s, i)] = input_grads

    def backward_weight(self, s: int, i: int, step: MetaStep | None = None) -> None:
        try:
            self.p.stage_backward_weight(self.records.pop((s, i)))
        except Exception as exc:
            raise StageError(self.rank, step or MetaStep(i, _T.BWD_WEIGHT, s), exc) from exc
        self.live_activations -= 1

    def _meta(self, tensor: Any) -> TensorMeta:
        differentiable = not self.forward_only and self.p.is_floating(tensor) and self.p.requires_grad(tensor)
        return TensorMeta(self.p.shape(tensor), self.p.dtype_name(tensor), differentiable)

    def _forward_inputs(self, s: int, i: int) -> tuple[tuple[Any, ...], list[TensorMeta]]:
        """Stage s's inputs of micro-batch i and their metadata (as agreed with the sender)."""
        if (s - 1) in self.stages:
            outputs = tuple(self.outputs.pop((s - 1, i)))
            return outputs, self.out_meta.get((s - 1, i)) or [self._meta(o) for o in outputs]
        recv = self._take_recv("F", s, i)
        return tuple(recv.buffers), list(recv.metas)

    # ------------------------------------------------------------------ communication
    def _peer(self, step: MetaStep) -> int:
        known = self._peers.get(id(step))  # by identity (a step's own hash is a Python call)
        if known is None:
            known = self._peers[id(step)] = (step, peer_rank(step, self.stage_rank))  # holds the step: its id stays its own
        return known[1]

    def _p2p_step(self, step: MetaStep) -> None:
        self.communicate([step])

    def _batch_step(self, step: MetaStep) -> None:
        self.communicate(list(step.sub_steps or ()))

    def communicate(self, steps: Sequence[MetaStep]) -> None:
        """Issue the sends and post the receives of ``steps`` (one batched call with ``batch_p2p``)."""
        ops: list[P2POp] = []
        sends: list[tuple[int, Any, list[Any], Key | None]] = []  # (op index, tensor, to release, forward key)
        recvs: list[tuple[MetaStep, int, list[Any], list[TensorMeta], int]] = []
        for step in steps:
            peer = self._peer(step)
            kind = step.meta_type
            if kind is _T.FWD_SEND:
                for tensor, release in self._forward_send_tensors(step, peer):
                    sends.append((len(ops), tensor, release, (step.stage_index, step.micro_index)))
                    ops.append(P2POp("isend", tensor, peer, self.group, self.tag))
            elif kind is _T.BWD_SEND:
                for tensor in self._backward_send_tensors(step):
                    sends.append((len(ops), tensor, [], None))
                    ops.append(P2POp("isend", tensor, peer, self.group, self.tag))
            elif kind in (_T.FWD_RECV, _T.BWD_RECV):
                metas = self._recv_metas(step)
                buffers = [self.p.empty(m.shape, m.dtype, device=self.stages[step.stage_index].device) for m in metas]
                recvs.append((step, peer, buffers, metas, len(ops)))
                ops += [P2POp("irecv", b, peer, self.group, self.tag) for b in buffers]
            else:
                raise ValueError(f"rank {self.rank}: {step} is not a data send or receive")
        handles = self._issue(ops)
        for op_index, tensor, release, forward_key in sends:
            pending = _PendingSend(handles[op_index], tensor, release)
            if forward_key is None:
                self.sends.append(pending)
            else:
                self.forward_sends.setdefault(forward_key, []).append(pending)
        for step, peer, buffers, metas, first in recvs:
            key = ("F" if step.meta_type is _T.FWD_RECV else "B", step.stage_index, step.micro_index)
            if key in self.recvs:
                raise RuntimeError(f"rank {self.rank}: {step} posted twice")
            self.recvs[key] = _PendingRecv(handles[first : first + len(buffers)], buffers, metas, peer, step)

    def _issue(self, ops: list[P2POp]) -> list[Handle]:
        if not ops:
            return []
        if self.batch_p2p:
            return self.p.batch_isend_irecv(ops)
        return [
            self.p.isend(op.tensor, op.peer, op.group, op.tag) if op.op == "isend"
            else self.p.irecv(op.tensor, op.peer, op.group, op.tag)
            for op in ops
        ]

    def _meta_send(self, step: MetaStep) -> None:
        s, i = step.stage_index, step.micro_index
        metas = self.out_meta[(s, i)]
        if not self.stages[s].dyn_shape:
            self.shapes_out[s] = metas
        handle = self.p.isend_meta(encode_meta(metas), self._peer(step), tag=self.tag)
        # settled with the output's own sends (when its gradient arrives the peer has read both): on
        # gloo a send reports completion only once waited, so one at the head of ``sends`` would hold
        # back every later send there and be polled after every step
        self.forward_sends.setdefault((s, i), []).append(_PendingSend(handle, None))

    def _meta_recv(self, step: MetaStep) -> None:
        peer = self._peer(step)
        with watched(lambda: self._waiting_for(step, peer), self.wait_log_interval):
            try:
                values = self.p.recv_meta(peer, tag=self.tag)
            except TimeoutError as exc:
                raise TimeoutError(f"rank {self.rank}: step {step} waiting on rank {peer} failed: {exc}") from exc
            except WaitAborted:
                raise
            except RuntimeError as exc:
                raise self._peer_error(step, peer, exc) from None
        metas = decode_meta(values)
        self.arrived_meta[(step.stage_index, step.micro_index)] = metas
        if not self.stages[step.stage_index].dyn_shape:
            self.shapes_in[step.stage_index] = metas

    def _recv_metas(self, step: MetaStep) -> list[TensorMeta]:
        s, i = step.stage_index, step.micro_index
        if step.meta_type is _T.FWD_RECV:
            metas = self.arrived_meta.pop((s, i), None)
            if metas is None:
                metas = self.shapes_in.get(s)
            if metas is None:
                raise RuntimeError(
                    f"rank {self.rank}: stage {s} has no shapes for its input of micro-batch {i}: no RECV_META "
                    "came before it in this run"
                )
            return metas
        metas = self.out_meta.get((s, i))
        if metas is None:
            raise RuntimeError(f"rank {self.rank}: {step} is posted before the forward of that micro-batch ran")
        return [m for m in metas if m.differentiable]

    def _take_recv(self, kind: str, s: int, i: int) -> _PendingRecv:
        """The completed receive of stage s's input ("F") or output gradient ("B") of micro-batch i."""
        recv = self.recvs.pop((kind, s, i), None)
        if recv is None:
            what = "input" if kind == "F" else "output gradient"
            raise RuntimeError(f"rank {self.rank}: the {what} of stage {s} micro-batch {i} was never received")
        tracer = self.tracer if self.tracer is not None and self.tracer.enabled else None
        start = tracer.now() if tracer is not None else 0.0
        for h in recv.handles:
            self._wait(h, recv.step, recv.peer)
        if tracer is not None:
            tracer.record(recv.step, "p2p-wait", start, tracer.now())
        if kind == "B" and self.forward_sends:  # a gradient that came over the wire answers the sends
            self.settle_forward_sends(s, i, answered=bool(recv.handles))
        return recv

    def _wait(self, handle: Handle, step: MetaStep | None, peer: int | None) -> None:
        slot = self._wait_slot
        mine = slot is not None and slot.current is None  # else: watching off, or another thread waits
        if mine:
            slot.current = (time.monotonic(), step, peer)
        try:
            with _NOT_WATCHED if mine or slot is None else watched(lambda: self._waiting_for(step, peer),
                                                                  self.wait_log_interval):
                handle.wait()
        except TimeoutError as exc:
            raise TimeoutError(f"rank {self.rank}: step {step} waiting on rank {peer} failed: {exc}") from exc
        except WaitAborted:
            raise
        except RuntimeError as exc:  # e.g. the peer's process died and closed the connection
            raise self._peer_error(step, peer, exc) from None
        finally:
            if mine:
                slot.current = None

    def _waiting_for(self, step: MetaStep | None, peer: int | None) -> str:
        """What a blocked wait logs (formatted only then)."""
        return f"rank {self.rank}: {step} waiting for rank {peer}" if step else f"rank {self.rank}: its sends"

    def _peer_error(self, step: MetaStep | None, peer: int | None, exc: BaseException) -> PeerError:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        who = f"rank {peer}" if peer is not None else "a peer"
        return PeerError(f"rank {self.rank}: {who} failed or stopped while step {step} waited for it ({first_line})")

    def _forward_send_tensors(self, step: MetaStep, peer: int) -> list[tuple[Any, list[Any]]]:
        s, i = step.stage_index, step.micro_index
        stage = self.stages[s]
        outputs = self.outputs.pop((s, i))
        metas = self.out_meta[(s, i)]
        agreed = self.shapes_out.get(s)
        if not stage.dyn_shape and agreed is not None and metas != agreed:
            raise ValueError(
                f"stage {s} on rank {self.rank} produced {describe(metas)} for micro-batch {i}, but the shapes "
                f"agreed with stage {s + 1} on rank {peer} for the first micro-batch of this run are "
                f"{describe(agreed)}; build the stages with dyn_shape=True for shapes that vary"
            )
        if self.forward_only or not stage.free_sent_outputs:
            return [(o, []) for o in outputs]
        record = self.records[(s, i)]
        return [(o, [o] if self.p.releasable(record, o) else []) for o in outputs]

    def _backward_send_tensors(self, step: MetaStep) -> list[Any]:
        key = (step.stage_index, step.micro_index)
        grads, metas = self.in_grads.pop(key), self.in_meta.pop(key)
        return [
            g if g is not None else self.p.zeros(m.shape, m.dtype, device=self.stages[step.stage_index].device)
            for g, m in zip(grads, metas, strict=True)
            if m.differentiable
        ]

    def release_completed_sends(self) -> None:
        """Free the sent outputs and let go of the sends that have completed, oldest first. Sends
        complete roughly in order, so this stops at the first one still in flight: constant work
        per step instead of a scan of every pending send."""
        forward_sends = self.forward_sends
        while forward_sends:
            key = next(iter(forward_sends))
            for pending in forward_sends[key]:  # a plain loop: this runs after every step
                if not pending.handle.is_completed():
                    break
            else:
                self.settle_forward_sends(*key)
                continue
            break
        sends = self.sends
        while sends and sends[0].handle.is_completed():
            sends.popleft()

    def settle_forward_sends(self, s: int, i: int, force: bool = False, answered: bool = False) -> None:
        """Wait for the sends of stage s's output of micro-batch i and free what they sent. Called when
        that micro-batch's output gradient has arrived: the peer used the output to compute it, so the
        wait returns at once (some engines report a send completed only once it is waited for, which
        would otherwise keep every sent output until the end of the run). With ``answered`` (gradient
        tensors came over the wire) a send is settled without a wait where the engine allows."""
        pendings = self.forward_sends.pop((s, i), ())
        if not force and any(getattr(p.handle, "coalesced", False) and not p.handle.is_completed() for p in pendings):
            # one request for a whole batch also covers its receives, which may be posted early for data
            # the peer sends only later: leave these sends to complete on their own (or to the run's end)
            self.forward_sends[(s, i)] = list(pendings)
            return
        for pending in pendings:  # every send first: one tensor may be sent twice (an output repeated)
            # ``answered``: the peer sent data computed from these sends, so it received them all; not
            # when no gradient tensor crossed (a frozen stage's outputs): its receives may not even be posted
            settle = getattr(pending.handle, "settle_received", None) if answered and not force else None
            if settle is not None:
                settle()
            else:
                self._wait(pending.handle, None, None)
        for pending in pendings:
            for t in pending.release:
                self.p.release_storage(t)
