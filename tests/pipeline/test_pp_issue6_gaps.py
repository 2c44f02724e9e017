"""Run-contract cases the other files leave out, on torch LocalCluster against the non-pipelined
run of the same modules (every micro-batch loss, every gradient relative to its own scale):

- a custom schedule whose rank 1 consumes micro-batch 1 before micro-batch 0 (the second
  reproducer of the batch-transport metadata bug), plain and batch, static shapes and dyn_shape;
- ``overlap_p2p`` puts receives of ``exec_order`` at least one compute step before their consumer;
- a parameter added to a stage's module after the stage was built gets its scaled gradient;
- ranks that built different chunk counts, stage numbers or ``overlap_b_f`` are refused naming both;
- an exception in a backward, an input backward (I) or a weight backward (W) names rank, stage,
  micro-batch and step, with the original exception as ``__cause__``;
- a positional argument and a keyword argument split on dims other than 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlp_harness import WIDTH, MatrixJob, MLPStage, batch, check, mse, oracle, run_matrix_job, weights

from hyper_parallel.core.pipeline_parallel.runtime.agreement import gather_and_check
from hyper_parallel.core.pipeline_parallel.ir import MetaStep
from hyper_parallel.core.pipeline_parallel.runtime.executor import StageError
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import ScheduleInterleavedZeroBubble
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

TOL = dict(rtol=1e-5, atol=1e-7)


def _steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(word) for word in text.split()]


# ------------------------------------------------------------------ rank 1 takes m1 before m0
class OutOfOrder(Schedule1F1B):
    """Two ranks, three micro-batches; rank 1 runs micro-batch 1 first, rank 0 takes the gradients
    back in micro-batch order, so both directions consume messages out of their send order."""

    @classmethod
    def _generate(cls, num_ranks, num_chunks, num_microbatches):
        assert (num_ranks, num_microbatches) == (2, 3)
        return {0: _steps("F.s0.m0 F.s0.m1 F.s0.m2 B.s0.m0 B.s0.m1 B.s0.m2"),
                1: _steps("F.s1.m1 F.s1.m0 F.s1.m2 B.s1.m1 B.s1.m0 B.s1.m2")}


class OutOfOrder1F1B(Schedule1F1B):
    """The same in a one-forward-one-backward rhythm: rank 1 runs F1 B1 before F0 B0."""

    @classmethod
    def _generate(cls, num_ranks, num_chunks, num_microbatches):
        assert (num_ranks, num_microbatches) == (2, 3)
        return {0: _steps("F.s0.m0 F.s0.m1 B.s0.m0 F.s0.m2 B.s0.m1 B.s0.m2"),
                1: _steps("F.s1.m1 B.s1.m1 F.s1.m0 B.s1.m0 F.s1.m2 B.s1.m2")}


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("dyn", [False, True], ids=["static", "dyn"])
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("cls", [OutOfOrder, OutOfOrder1F1B], ids=lambda c: c.__name__)
def test_rank_one_consuming_micro_batch_one_first_matches_the_oracle(cls, transport, dyn, overlap):
    job = MatrixJob(cls, 1, 3, dict(p2p_transport=transport, overlap_p2p=overlap), dyn_shape=dyn, vary=dyn)
    check(job, LocalCluster(2).run(run_matrix_job, job), 2)


# ------------------------------------------------------------------ prefetch in exec_order
def _prefetched(steps: list[MetaStep]) -> int:
    """Data receives with at least one compute step between their posting and their consumer."""
    posted, done, early = {}, 0, 0
    for step in steps:
        for op in step.comm_parts:
            if op.meta_type.name in ("FWD_RECV", "BWD_RECV"):
                posted[(op.meta_type.name, op.micro_index, op.stage_index)] = done
        for part in step.parts:
            kind = {"FWD": "FWD_RECV", "BWD": "BWD_RECV", "BWD_INPUT": "BWD_RECV"}.get(part.meta_type.name)
            at = posted.pop((kind, part.micro_index, part.stage_index), None)
            if at is not None and done - at >= 1:
                early += 1
        if step.parts:
            done += 1
    return early


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_exec_order_posts_receives_a_compute_step_early_with_overlap_p2p(transport):
    """1F1B, 2 ranks, m=4, static shapes: rank 1's forward inputs of m1..m3 can arrive while it
    computes (the first waits for its metadata); rank 0's gradient of m0 can arrive during F.s0.m1."""

    def body(overlap):
        rank = get_platform().rank
        sched = Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 4, loss_fn=mse,
                             overlap_p2p=overlap, p2p_transport=transport)
        return _prefetched(sched.exec_order[rank])

    off = LocalCluster(2).run(body, False)
    on = LocalCluster(2).run(body, True)
    assert off == [0, 0], off
    assert on[1] >= 1 and sum(on) > sum(off), on


# ------------------------------------------------------------------ parameters added after build
class WithGain(MLPStage):
    """An MLP stage that scales its ``h`` output by ``gain`` once a ``gain`` parameter exists."""

    def forward(self, h, skip=None):
        out = super().forward(h, skip)
        gain = getattr(self, "gain", None)
        if gain is None:
            return out
        return out[0] * gain, out[1]


def _gain_oracle(micro: int, size: int, gain: np.ndarray) -> tuple[list[float], dict[str, np.ndarray]]:
    w = weights(2)
    first, last = WithGain(0, 2, w, False), MLPStage(1, 2, w, False)
    first.gain = torch.nn.Parameter(torch.from_numpy(gain.copy()))
    x, y = (torch.from_numpy(a) for a in batch(size, micro, False))
    per, total, losses = size // micro, 0.0, []
    for i in range(micro):
        loss = mse(last(*first(x[i * per:(i + 1) * per])), y[i * per:(i + 1) * per])
        losses.append(float(loss.detach()))
        total = total + loss / micro
    total.backward()
    grads = {f"{s}.{n}": q.grad.numpy().copy() for s, m in enumerate((first, last)) for n, q in m.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("cls", [Schedule1F1B, ScheduleInterleavedZeroBubble], ids=lambda c: c.__name__)
def test_a_parameter_added_after_the_stage_was_built_gets_its_scaled_gradient(cls):
    micro, size = 4, 8
    gain = np.linspace(0.5, 1.5, WIDTH).astype(np.float32)

    def body():
        rank = get_platform().rank
        module = WithGain(rank, 2, weights(2), False) if rank == 0 else MLPStage(rank, 2, weights(2), False)
        stage = PipelineStage(module, rank, 2)
        sched = cls(stage, micro, loss_fn=mse)
        x, y = (torch.from_numpy(a) for a in batch(size, micro, False))
        before = sorted(stage.named_gradients())
        if rank == 0:
            module.gain = torch.nn.Parameter(torch.from_numpy(gain.copy()))  # added after the stage was built
        losses = sched.run(x, target=y if rank == 1 else None)
        grads = {f"{rank}.{n}": g.numpy().copy() for n, g in stage.named_gradients().items()}
        return before, [float(v) for v in losses], grads, sorted(sched.named_gradients())

    results = LocalCluster(2).run(body)
    ref_losses, ref = _gain_oracle(micro, size, gain)
    assert results[0][0] == [] and results[1][0] == []
    np.testing.assert_allclose(results[1][1], ref_losses, **TOL)
    grads = {**results[0][2], **results[1][2]}
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    assert "0.gain" in grads and "stage0.gain" in results[0][3]
    for name, g in grads.items():
        scale = max(float(np.abs(ref[name]).max()), 1.0)
        np.testing.assert_allclose(g, ref[name], rtol=TOL["rtol"], atol=TOL["atol"] * scale, err_msg=name)


def test_a_parameter_unfrozen_after_the_stage_was_built_on_mindspore():
    ms = pytest.importorskip("mindspore")
    from mindspore import nn

    rng = np.random.default_rng(5)
    w = [(rng.standard_normal((4, 4)) * 0.5).astype(np.float32) for _ in range(2)]
    b = [(rng.standard_normal(4) * 0.1).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal((4, 4)).astype(np.float32)
    y = rng.standard_normal((4, 4)).astype(np.float32)

    def cell(k):
        c = nn.SequentialCell(nn.Dense(4, 4))
        c[0].weight.set_data(ms.Tensor(w[k]))
        c[0].bias.set_data(ms.Tensor(b[k]))
        return c

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    def body():
        p = get_platform()
        first, last = cell(0), cell(1)
        last[0].bias.requires_grad = False  # frozen when the stages and the schedule are built
        stages = [PipelineStage(first, 0, 2), PipelineStage(last, 1, 2)]
        sched = ScheduleInterleaved1F1B(stages, 2, loss_fn=loss_fn)
        frozen = sorted(sched.named_gradients())
        sched.run(ms.Tensor(x), target=ms.Tensor(y))
        without = sorted(sched.named_gradients())
        sched.zero_grad()
        last[0].bias.requires_grad = True  # unfrozen after the build
        sched.run(ms.Tensor(x), target=ms.Tensor(y))
        return frozen, without, {n: p.to_numpy(g).copy() for n, g in sched.named_gradients().items()}

    frozen, without, grads = LocalCluster(1, platform="mindspore").run(body)[0]
    cells = [cell(0), cell(1)]
    params = [q for c in cells for q in c.trainable_params()]

    def total(xs):  # the mean over the two micro-batches of their mean losses = the full-batch mean
        return loss_fn(cells[1](cells[0](xs)), ms.Tensor(y))

    _, ref = ms.value_and_grad(total, None, weights=params)(ms.Tensor(x))
    ref = dict(zip(["stage0.0.weight", "stage0.0.bias", "stage1.0.weight", "stage1.0.bias"],
                   (g.asnumpy() for g in ref), strict=True))
    assert frozen == [] and "stage1.0.bias" not in without and len(without) == 3, without
    assert set(grads) == set(ref), sorted(grads)
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-5, atol=1e-6 * max(float(np.abs(ref[name]).max()), 1.0),
                                   err_msg=name)


# ------------------------------------------------------------------ settings that must match
def test_ranks_with_different_chunk_counts_are_named():
    def body():
        rank = get_platform().rank
        chunks = 2 if rank == 0 else 3
        stages = [PipelineStage(torch.nn.Linear(2, 2), c * 2 + rank, 2 * chunks) for c in range(chunks)]
        ScheduleLoopedBFS(stages, 4, loss_fn=mse)

    with pytest.raises(RankFailedError, match="pipeline ranks disagree on stages per rank: rank 0 has 2 but rank 1 "
                                              "has 3"):
        LocalCluster(2).run(body)


def test_ranks_with_different_stage_numbers_are_named():
    # the built-in placements tie stage_num to the chunk count, so a rank that differs only in
    # stage_num is made here by handing the check its description directly
    def body():
        p = get_platform()
        mine = {"schedule": "X", "micro_batch_num": 4, "chunks": 1, "stage_num": 5 if p.rank == 2 else 3,
                "transport": "plain", "scale_grads": True, "overlap_p2p": False, "overlap_b_f": False,
                "dyn_shape": False, "has_loss_fn": True}
        gather_and_check(p, p.world_group, mine)

    with pytest.raises(RankFailedError, match="disagree on stage_num: rank 0 has 3 but rank 2 has 5"):
        LocalCluster(3).run(body)


def test_ranks_with_different_overlap_b_f_are_named():
    def body():
        rank = get_platform().rank
        stages = [PipelineStage(torch.nn.Linear(2, 2), c * 2 + rank, 4) for c in range(2)]
        ScheduleInterleaved1F1B(stages, 4, loss_fn=mse, overlap_b_f=rank == 1)

    with pytest.raises(RankFailedError, match="disagree on overlap_b_f: rank 0 has False but rank 1 has True"):
        LocalCluster(2).run(body)


# ------------------------------------------------------------------ errors in backward, I and W
class Boom(torch.autograd.Function):
    """Identity whose backward raises for one micro-batch."""

    @staticmethod
    def forward(ctx, t, fail):
        ctx.fail = fail
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise ZeroDivisionError("boom in backward")
        return grad, None


class Fragile(torch.nn.Module):
    """Linear layer; on micro-batch ``fail_micro`` the backward raises on the path to the input
    (``where="input"``) or only on the path to the weight (``"weight"``)."""

    def __init__(self, where: str, fail_micro: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.where, self.fail_micro, self.calls = where, fail_micro, 0

    def forward(self, x):
        fail = self.calls == self.fail_micro
        self.calls += 1
        if self.where == "weight":
            return x @ Boom.apply(self.lin.weight, fail).t() + self.lin.bias
        return Boom.apply(self.lin(x), fail)


@pytest.mark.parametrize("cls, where, step, what", [
    (Schedule1F1B, "input", "B.s1.m1", "the backward"),
    (ScheduleInterleavedZeroBubble, "input", "I.s1.m1", "the input backward"),
    (ScheduleInterleavedZeroBubble, "weight", "W.s1.m1", "the weight backward"),
], ids=["B", "I", "W"])
def test_a_backward_error_names_rank_stage_micro_batch_and_step(cls, where, step, what):
    def body():
        rank = get_platform().rank
        module = torch.nn.Linear(2, 2) if rank == 0 else Fragile(where, 1)
        sched = cls(PipelineStage(module, rank, 2), 3, loss_fn=mse)
        sched.run(torch.ones(6, 2), target=torch.ones(6, 2) if rank == 1 else None)

    with pytest.raises(RankFailedError) as info:
        LocalCluster(2).run(body)
    error = info.value.error
    assert isinstance(error, StageError), error
    assert str(error).startswith(
        f"rank 1: {what} of stage 1 on micro-batch 1 ({step}) failed: ZeroDivisionError: boom in backward"
    ), str(error)
    assert (error.rank, str(error.step)) == (1, step)
    assert isinstance(error.__cause__, ZeroDivisionError) and str(error.__cause__) == "boom in backward"


# ------------------------------------------------------------------ split on dims other than 0
class Transposed(MLPStage):
    """Stage 0 taking ``xt`` (features x batch: batch on dim 1), a ``gain`` passed whole, and a
    keyword ``shift`` of shape (features, 2, batch): batch on dim 2."""

    def forward(self, xt, gain, *, shift):
        return super().forward(xt.t() * gain + shift.sum(dim=1).t())


def _dims_inputs(size: int):
    rng = np.random.default_rng(9)
    xt = torch.from_numpy(rng.standard_normal((WIDTH, size)).astype(np.float32))
    gain = torch.from_numpy(rng.uniform(0.5, 1.5, WIDTH).astype(np.float32))
    shift = torch.from_numpy(rng.standard_normal((WIDTH, 2, size)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((size, 1)).astype(np.float32))
    return xt, gain, shift, y


@pytest.mark.parametrize("cls, chunks", [(Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2)],
                         ids=["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_positional_and_keyword_arguments_split_on_other_dims(cls, chunks, transport):
    micro, size, ranks = 3, 9, 2
    num = ranks * chunks

    def module(s):
        return Transposed(s, num, weights(num), False) if s == 0 else MLPStage(s, num, weights(num), False)

    def body():
        rank = get_platform().rank
        placement = cls.stage_placement(ranks, chunks)
        stages = [PipelineStage(module(s), s, num) for s in sorted(s for s, r in placement.items() if r == rank)]
        sched = cls(stages if len(stages) > 1 else stages[0], micro, loss_fn=mse, p2p_transport=transport,
                    args_batch_dim=[1, -1], kwargs_batch_dim={"shift": 2})
        xt, gain, shift, y = _dims_inputs(size)
        losses = sched.run(xt, gain, shift=shift, target=y if stages[-1].is_last else None)
        grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
        return [float(v) for v in losses], grads

    results = LocalCluster(ranks).run(body)
    modules = [module(s) for s in range(num)]
    xt, gain, shift, y = _dims_inputs(size)
    per, total, ref_losses = size // micro, 0.0, []
    for i in range(micro):
        cut = slice(i * per, (i + 1) * per)
        out = modules[0](xt[:, cut], gain, shift=shift[:, :, cut])
        for m in modules[1:]:
            out = m(*out)
        loss = mse(out, y[cut])
        ref_losses.append(float(loss.detach()))
        total = total + loss / micro
    total.backward()
    ref = {f"{s}.{n}": q.grad.numpy() for s, m in enumerate(modules) for n, q in m.named_parameters()}
    losses = next(r[0] for r in results if r[0])
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    grads = {k: v for r in results for k, v in r[1].items()}
    assert set(grads) == set(ref)
    for name, g in grads.items():
        scale = max(float(np.abs(ref[name]).max()), 1.0)
        np.testing.assert_allclose(g, ref[name], rtol=TOL["rtol"], atol=TOL["atol"] * scale, err_msg=name)


def test_the_oracle_helpers_agree_with_the_harness():
    """The hand-written oracles above chain the same stages as mlp_harness.oracle."""
    job = MatrixJob(Schedule1F1B, 1, 4)
    losses, _ = oracle(job, 2)
    gained, _ = _gain_oracle(4, 8, np.ones(WIDTH, np.float32))
    np.testing.assert_allclose(gained, losses, rtol=1e-6)
