"""Runtime properties that the mutation audit found unchecked (benchmarks/results/mutation_audit.md).

Each test states a property of ``runtime/executor.py`` / ``lowering/p2p.py`` that no other test looked at:
every send is completed before a run returns, a peer that dies is named, a step without a peer
is refused with its name, a last stage without ``loss_fn`` returns its loss alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mlp_harness import MatrixJob, batch, build_stages, check, mse

from hyper_parallel.core.pipeline_parallel.runtime.wait_watch import release_slot, wait_slot
from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import peer_rank
from hyper_parallel.core.pipeline_parallel.runtime.executor import PeerError, PipelineRuntime
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleInterleaved1F1B
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster


class _Spied:
    """A send handle that remembers whether the runtime saw it complete."""

    def __init__(self, inner):
        self.inner = inner
        self.done = False

    def wait(self, timeout=None):
        self.inner.wait(timeout)
        self.done = True

    def is_completed(self):
        out = self.inner.is_completed()
        self.done = self.done or out
        return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls, v", [(Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2)])
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("dyn", [False, True])
def test_every_send_is_completed_before_the_run_returns(cls, v, transport, dyn):
    # A send whose handle is dropped is never waited: on gloo/NCCL its buffer can be reused or
    # freed while the transfer is still in flight. Every forward, backward and metadata send
    # of a run must be waited (or seen completed) by the runtime before run() returns.
    job = MatrixJob(cls, v, 4, dict(p2p_transport=transport), dyn_shape=dyn)

    def body():
        p = get_platform()
        spied: list[_Spied] = []
        isend, isend_meta, batched = p.isend, p.isend_meta, p.batch_isend_irecv

        def spy(fn):
            def wrapped(*a, **k):
                handle = _Spied(fn(*a, **k))
                spied.append(handle)
                return handle
            return wrapped

        def spy_batch(ops):
            handles = batched(ops)
            out = [_Spied(h) if op.op == "isend" else h for op, h in zip(ops, handles, strict=True)]
            spied.extend(h for h in out if isinstance(h, _Spied))
            return out

        p.isend, p.isend_meta, p.batch_isend_irecv = spy(isend), spy(isend_meta), spy_batch
        try:
            placement = cls.stage_placement(p.world_size, v)
            stages = build_stages(job, len(placement), placement)
            sched = cls(stages if len(stages) > 1 else stages[0], job.micro, loss_fn=mse, p2p_transport=transport)
            x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
            losses = sched.run(x, target=y if stages[-1].is_last else None)
            seen = [h.done for h in spied]
        finally:
            p.isend, p.isend_meta, p.batch_isend_irecv = isend, isend_meta, batched
        grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
        return {"losses": [float(v) for v in losses], "grads": grads, "seen": seen}

    results = LocalCluster(2).run(body)
    check(job, results, 2 * v)
    for rank, r in enumerate(results):
        assert r["seen"] and all(r["seen"]), f"rank {rank}: {r['seen'].count(False)} of {len(r['seen'])} sends never completed"


def test_a_peer_that_dies_is_named():
    # The engine's bare "Connection closed by peer" becomes an error naming the rank and the step.
    class Broken:
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore lines")

    runtime = SimpleNamespace(rank=0, wait_log_interval=30.0, _wait_slot=wait_slot(lambda *what: "unused", 30.0))
    runtime._peer_error = lambda step, peer, exc: PipelineRuntime._peer_error(runtime, step, peer, exc)
    step = MetaStep(2, MetaStepType.BWD_RECV, 0)
    try:
        with pytest.raises(PeerError, match=r"rank 0: rank 1 failed or stopped while step .* waited for it "
                                            r"\(Connection closed by peer \[127.0.0.1\]:1234\)"):
            PipelineRuntime._wait(runtime, Broken(), step, 1)
        with pytest.raises(PeerError, match="rank 0: a peer failed or stopped"):
            PipelineRuntime._wait(runtime, Broken(), None, None)
    finally:
        release_slot(runtime._wait_slot)


def test_a_wait_that_times_out_is_not_taken_for_done():
    # A receive whose wait times out must fail naming the step and the peer; swallowing the
    # timeout would hand the stage an unfilled buffer.
    class Late:
        def wait(self, timeout=None):
            raise TimeoutError("no message within 300 s")

    runtime = SimpleNamespace(rank=2, wait_log_interval=30.0, _wait_slot=None)
    step = MetaStep(1, MetaStepType.FWD_RECV, 2)
    with pytest.raises(TimeoutError, match=r"rank 2: step .* waiting on rank 1 failed: no message within 300 s"):
        PipelineRuntime._wait(runtime, Late(), step, 1)


def test_peer_rank_refuses_steps_without_a_peer():
    placement = {0: 0, 1: 1}
    assert peer_rank(MetaStep(0, MetaStepType.FWD_SEND, 0), placement) == 1
    assert peer_rank(MetaStep(0, MetaStepType.BWD_SEND, 1), placement) == 0
    with pytest.raises(ValueError, match="is not a send/recv step with a stage"):
        peer_rank(MetaStep(0, MetaStepType.FWD, 0), placement)
    with pytest.raises(ValueError, match="has no peer: stage 2 does not exist"):
        peer_rank(MetaStep(0, MetaStepType.FWD_SEND, 1), placement)


@pytest.mark.timeout(60)
def test_a_last_stage_without_loss_fn_must_return_its_loss_alone():
    # Without a loss_fn the last stage's output is the loss: a (loss, extra) tuple is refused,
    # not taken apart; eval() of the same stage returns its outputs as they are.
    from hyper_parallel.core.pipeline_parallel.runtime.executor import StageError
    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleGPipe
    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

    class LossAndExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            out = self.lin(x)
            return (out ** 2).mean(), out

    def body():
        torch.manual_seed(0)
        sched = ScheduleGPipe(PipelineStage(LossAndExtra(), 0, 1), 2)
        x = torch.randn(4, 3)
        merged = sched.eval(x)
        with pytest.raises((ValueError, StageError), match="loss of micro-batch 0 must be a scalar tensor"):
            sched.run(x)
        return merged

    merged = LocalCluster(1).run(body)[0]
    assert isinstance(merged, tuple) and len(merged) == 2 and tuple(merged[1].shape) == (4, 1)
