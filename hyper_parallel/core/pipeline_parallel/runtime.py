"""Executes one rank's lowered step list for one training step.

The runtime is the only place where pipeline steps touch tensors, always through the
platform. Conventions of the IR (see ``lowering.py``): ``FWD_SEND(s, i)`` sends stage s's
output of micro-batch i to stage s+1, ``FWD_RECV(s, i)`` receives stage s's input,
``BWD_SEND(s, i)`` sends stage s's input gradient to stage s-1 and ``BWD_RECV(s, i)``
receives the gradient of stage s's output. Neighbouring stages on the same rank hand
tensors over directly.

Receives are posted at their slot. Without ``overlap_p2p`` they are waited there; with it
the compute that consumes them waits. Sends never block a slot: they are completed at the
end of the step, and an output's storage is released as soon as its send has completed
(only its autograd link is kept until its backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.meta import META_LEN, TensorMeta, decode_meta, describe, encode_meta
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.platform.base import Handle, P2POp, Platform

Key = tuple[int, int]  # (stage index, micro-batch index)
CustomFunction = Callable[[MetaStep, "StepContext"], None]


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
    """State of one rank during one ``schedule.run``."""

    def __init__(
        self,
        platform: Platform,
        stages: dict[int, PipelineStage],
        stage_to_global_rank: dict[int, int],
        micro_args: list[tuple[Any, ...]],
        micro_kwargs: list[dict[str, Any]],
        targets: list[Any],
        loss_fn: Callable[[Any, Any], Any] | None,
        overlap_p2p: bool,
        batch_p2p: bool,
        keep_outputs: bool,
    ) -> None:
        self.p = platform
        self.rank = platform.rank
        self.stages = stages
        self.stage_rank = stage_to_global_rank
        self.micro_args, self.micro_kwargs, self.targets = micro_args, micro_kwargs, targets
        self.loss_fn = loss_fn
        self.overlap_p2p = overlap_p2p
        self.batch_p2p = batch_p2p
        self.keep_outputs = keep_outputs
        self.records: dict[Key, Any] = {}
        self.outputs: dict[Key, tuple[Any, ...]] = {}  # forward outputs waiting to be sent / handed over
        self.out_meta: dict[Key, list[TensorMeta]] = {}
        self.in_meta: dict[Key, list[TensorMeta]] = {}
        self.in_grads: dict[Key, tuple[Any, ...]] = {}  # input gradients waiting to be sent / handed over
        self.recvs: dict[tuple[str, int, int], _PendingRecv] = {}
        self.sends: list[_PendingSend] = []
        self.losses: dict[int, Any] = {}
        self.stage_outputs: dict[int, Any] = {}
        self.live_activations = 0
        self.peak_activations = 0

    # ------------------------------------------------------------------ driver
    def execute(self, steps: Sequence[MetaStep], custom: dict[MetaStepType, CustomFunction], ctx: StepContext) -> None:
        for step in steps:
            fn = custom.get(step.meta_type)
            if fn is not None:
                fn(step, ctx)
            else:
                self.run_step(step)
            if self.sends:
                self.release_completed_sends()
        for pending in self.sends:
            pending.handle.wait()
        self.release_completed_sends()
        if self.recvs:
            raise RuntimeError(f"rank {self.rank}: receives never consumed: {[str(r.step) for r in self.recvs.values()]}")

    def run_step(self, step: MetaStep) -> None:
        t = step.meta_type
        if t is MetaStepType.FWD:
            self.forward(step.stage_index, step.micro_index)
        elif t is MetaStepType.BWD:
            self.backward(step.stage_index, step.micro_index, full=True)
        elif t is MetaStepType.BWD_INPUT:
            self.backward(step.stage_index, step.micro_index, full=False)
        elif t is MetaStepType.BWD_WEIGHT:
            self.backward_weight(step.stage_index, step.micro_index)
        elif t in (MetaStepType.FWD_SEND, MetaStepType.BWD_SEND, MetaStepType.FWD_RECV, MetaStepType.BWD_RECV):
            self.communicate([step])
        elif t is MetaStepType.BATCH_SEND_RECV:
            self.communicate(list(step.sub_steps or ()))
        elif t in (MetaStepType.OVERLAP_B_F, MetaStepType.OVERLAP_F_B):
            for sub in step.sub_steps or ():
                self.run_step(sub)
        else:
            raise NotImplementedError(
                f"rank {self.rank}: no runtime implementation for step {step}; "
                "use schedule.register_custom_function to provide one"
            )

    # ------------------------------------------------------------------ compute
    def _stage_fn(self, stage: PipelineStage, micro: int) -> Callable[..., Any]:
        module = stage.submodule
        if not stage.is_last:
            return module
        loss_fn = self.loss_fn
        target = self.targets[micro] if loss_fn is not None else None

        def with_loss(*a: Any, **k: Any) -> Any:
            out = module(*a, **k)
            if loss_fn is None:  # the stage's output is the loss
                return (out,)
            flat = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            return (loss_fn(out, target), *flat)

        with_loss.__wrapped__ = module  # type: ignore[attr-defined]  # lets backends see the module
        return with_loss

    def forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        if stage.is_first:
            args, kwargs = self.micro_args[i], self.micro_kwargs[i]
            grad_args = [False] * len(args)
        else:
            args, metas = self._forward_inputs(s, i)
            kwargs = {}
            grad_args = [m.requires_grad for m in metas]
            self.in_meta[(s, i)] = metas
        record = self.p.stage_forward(self._stage_fn(stage, i), args, kwargs, stage.params, grad_args)
        self.records[(s, i)] = record
        self.live_activations += 1
        self.peak_activations = max(self.peak_activations, self.live_activations)
        outputs = record.outputs
        if stage.is_last:
            loss = outputs[0]
            if not self.p.is_tensor(loss) or self.p.numel(loss) != 1:
                shape = self.p.shape(loss) if self.p.is_tensor(loss) else type(loss).__name__
                raise ValueError(f"the loss of micro-batch {i} must be a scalar tensor, got {shape}")
            self.losses[i] = self.p.detach(loss)
            if self.keep_outputs:
                rest = [self.p.detach(o) for o in outputs[1:]] if self.loss_fn is not None else [self.losses[i]]
                self.stage_outputs[i] = rest[0] if len(rest) == 1 else tuple(rest)
            return
        for o in outputs:
            if not self.p.is_tensor(o):
                raise TypeError(f"stage {s} must return tensors to pass to stage {s + 1}, got {type(o).__name__}")
        self.out_meta[(s, i)] = [self._meta(o) for o in outputs]
        self.outputs[(s, i)] = outputs

    def _output_grads(self, s: int, i: int) -> list[Any]:
        stage = self.stages[s]
        record = self.records[(s, i)]
        if stage.is_last:
            return [self.p.ones_like(record.outputs[0])] + [None] * (len(record.outputs) - 1)
        if (s + 1) in self.stages:  # handed over on this rank
            return list(self.in_grads.pop((s + 1, i)))
        received = iter(self._take_recv("B", s, i).buffers)
        return [next(received) if m.differentiable else None for m in self.out_meta[(s, i)]]

    def backward(self, s: int, i: int, full: bool) -> None:
        grads = self._output_grads(s, i)
        self.out_meta.pop((s, i), None)
        if full:
            input_grads = self.p.stage_backward(self.records.pop((s, i)), grads)
            self.live_activations -= 1
        else:  # the record stays until its weight backward
            input_grads = self.p.stage_backward_input(self.records[(s, i)], grads)
        if not self.stages[s].is_first:
            self.in_grads[(s, i)] = input_grads

    def backward_weight(self, s: int, i: int) -> None:
        self.p.stage_backward_weight(self.records.pop((s, i)))
        self.live_activations -= 1

    def _meta(self, tensor: Any) -> TensorMeta:
        differentiable = self.p.is_floating(tensor) and self.p.requires_grad(tensor)
        return TensorMeta(self.p.shape(tensor), self.p.dtype_name(tensor), differentiable)

    def _forward_inputs(self, s: int, i: int) -> tuple[tuple[Any, ...], list[TensorMeta]]:
        """Stage s's inputs of micro-batch i and their metadata (as agreed with the sender)."""
        if (s - 1) in self.stages:
            outputs = tuple(self.outputs.pop((s - 1, i)))
            return outputs, [self._meta(o) for o in outputs]
        recv = self._take_recv("F", s, i)
        return tuple(recv.buffers), list(recv.metas)

    # ------------------------------------------------------------------ communication
    def _peer(self, step: MetaStep) -> int:
        s, t = step.stage_index, step.meta_type
        return self.stage_rank[s + 1] if t in (MetaStepType.FWD_SEND, MetaStepType.BWD_RECV) else self.stage_rank[s - 1]

    def communicate(self, steps: Sequence[MetaStep]) -> None:
        """Issue the sends and post the receives of ``steps`` (one batched call with ``batch_p2p``)."""
        ops: list[P2POp] = []
        sends: list[tuple[int, Any, list[Any]]] = []  # (op index, tensor, tensors to release)
        meta_recvs: list[tuple[MetaStep, Any]] = []
        data_recvs: list[MetaStep] = []
        for step in steps:
            peer = self._peer(step)
            if step.meta_type is MetaStepType.FWD_SEND:
                for tensor, release in self._forward_send_tensors(step, peer):
                    sends.append((len(ops), tensor, release))
                    ops.append(P2POp("isend", tensor, peer))
            elif step.meta_type is MetaStepType.BWD_SEND:
                for tensor in self._backward_send_tensors(step):
                    sends.append((len(ops), tensor, []))
                    ops.append(P2POp("isend", tensor, peer))
            elif step.meta_type is MetaStepType.FWD_RECV and self._needs_meta(self.stages[step.stage_index]):
                buf = self.p.zeros((META_LEN + 1,), "int64")
                meta_recvs.append((step, buf))
                ops.append(P2POp("irecv", buf, peer))
            elif step.meta_type in (MetaStepType.FWD_RECV, MetaStepType.BWD_RECV):
                data_recvs.append(step)
            else:
                raise ValueError(f"rank {self.rank}: {step} is not a send or receive")
        handles = self._issue(ops)
        for op_index, tensor, release in sends:
            self.sends.append(_PendingSend(handles[op_index], tensor, release))
        meta_handles = [h for h, op in zip(handles, ops, strict=True) if op.op == "irecv"]
        for (step, buf), handle in zip(meta_recvs, meta_handles, strict=True):
            self._wait(handle, step, self._peer(step))
            self._accept_meta(step, buf)
            data_recvs.append(step)
        self._post_data_recvs(data_recvs)

    def _issue(self, ops: list[P2POp]) -> list[Handle]:
        if not ops:
            return []
        if self.batch_p2p:
            return self.p.batch_isend_irecv(ops)
        return [
            self.p.isend(op.tensor, op.peer) if op.op == "isend" else self.p.irecv(op.tensor, op.peer) for op in ops
        ]

    def _post_data_recvs(self, steps: list[MetaStep]) -> None:
        ops: list[P2POp] = []
        pending = []
        for step in steps:
            peer = self._peer(step)
            metas = self._recv_metas(step)
            buffers = [self.p.empty(m.shape, m.dtype) for m in metas]
            pending.append((step, peer, buffers, metas, len(ops)))
            ops += [P2POp("irecv", b, peer) for b in buffers]
        handles = self._issue(ops)
        for step, peer, buffers, metas, first in pending:
            kind = "F" if step.meta_type is MetaStepType.FWD_RECV else "B"
            key = (kind, step.stage_index, step.micro_index)
            if key in self.recvs:
                raise RuntimeError(f"rank {self.rank}: {step} posted twice")
            recv = _PendingRecv(handles[first : first + len(buffers)], buffers, metas, peer, step)
            self.recvs[key] = recv
            if not self.overlap_p2p:
                for h in recv.handles:
                    self._wait(h, step, peer)

    def _recv_metas(self, step: MetaStep) -> list[TensorMeta]:
        stage = self.stages[step.stage_index]
        if step.meta_type is MetaStepType.FWD_RECV:
            assert stage.input_meta is not None
            return stage.input_meta
        metas = self.out_meta.get((step.stage_index, step.micro_index))
        if metas is None:
            raise RuntimeError(f"rank {self.rank}: {step} is posted before the forward of that micro-batch ran")
        return [m for m in metas if m.differentiable]

    def _take_recv(self, kind: str, s: int, i: int) -> _PendingRecv:
        """The completed receive of stage s's input ("F") or output gradient ("B") of micro-batch i."""
        recv = self.recvs.pop((kind, s, i), None)
        if recv is None:
            what = "input" if kind == "F" else "output gradient"
            raise RuntimeError(f"rank {self.rank}: the {what} of stage {s} micro-batch {i} was never received")
        for h in recv.handles:
            self._wait(h, recv.step, recv.peer)
        return recv

    def _wait(self, handle: Handle, step: MetaStep, peer: int) -> None:
        try:
            handle.wait()
        except TimeoutError as exc:
            raise TimeoutError(f"rank {self.rank}: step {step} waiting on rank {peer} failed: {exc}") from exc
        except RuntimeError as exc:  # e.g. the peer's process died and closed the connection
            raise RuntimeError(f"rank {self.rank}: step {step} waiting on rank {peer} failed: {exc}") from exc

    def _needs_meta(self, stage: PipelineStage) -> bool:
        return stage.dyn_shape or stage.input_meta is None

    def _forward_send_tensors(self, step: MetaStep, peer: int) -> list[tuple[Any, list[Any]]]:
        s, i = step.stage_index, step.micro_index
        stage = self.stages[s]
        outputs = self.outputs.pop((s, i))
        metas = self.out_meta[(s, i)]
        out: list[tuple[Any, list[Any]]] = []
        if stage.dyn_shape or stage.output_meta is None:
            stage.output_meta = None if stage.dyn_shape else metas
            out.append((self.p.tensor([int(stage.dyn_shape), *encode_meta(metas)], "int64"), []))
        elif metas != stage.output_meta:
            raise ValueError(
                f"stage {s} on rank {self.rank} produced {describe(metas)} for micro-batch {i}, but the shapes "
                f"agreed with stage {s + 1} on rank {peer} are {describe(stage.output_meta)}; "
                "build the stages with dyn_shape=True for shapes that vary"
            )
        record = self.records[(s, i)]
        for o in outputs:
            out.append((o, [o] if self.p.releasable(record, o) else []))
        return out

    def _backward_send_tensors(self, step: MetaStep) -> list[Any]:
        key = (step.stage_index, step.micro_index)
        grads, metas = self.in_grads.pop(key), self.in_meta.pop(key)
        return [
            g if g is not None else self.p.zeros(m.shape, m.dtype)
            for g, m in zip(grads, metas, strict=True)
            if m.differentiable
        ]

    def _accept_meta(self, step: MetaStep, buf: Any) -> None:
        s = step.stage_index
        stage = self.stages[s]
        values = [int(v) for v in self.p.to_numpy(buf).tolist()]
        sender_dyn, metas = bool(values[0]), decode_meta(values[1:])
        if sender_dyn != stage.dyn_shape:
            raise ValueError(
                f"stage {s - 1} on rank {self._peer(step)} has dyn_shape={sender_dyn} but stage {s} on rank "
                f"{self.rank} has dyn_shape={stage.dyn_shape}; neighbouring stages must agree"
            )
        stage.input_meta = metas

    def release_completed_sends(self) -> None:
        """Release the storage of sent outputs whose sends have completed."""
        still = []
        for pending in self.sends:
            if pending.handle.is_completed():
                for t in pending.release:
                    self.p.release_storage(t)
            else:
                still.append(pending)
        self.sends = still
