"""CommComputeOverlap on real autograd graphs: two LocalCluster ranks, an MoE-like layer whose
dispatch and combine are all-to-alls between the ranks (and so are their gradients).

The oracle is the same two steps run one after the other: the backward of micro-batch 0, then
the forward of micro-batch 1. Run overlapped, they must give bitwise the same losses, input
gradients and parameter gradients, and the all-to-alls must interleave as worked out by hand.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel.features.overlap import CommComputeOverlap, OverlapError
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

TIMEOUT = 120.0
WIDTH, TOKENS = 8, 4


def all_to_all_rows(platform, tensor):
    """Row block i goes to rank i; the blocks received are stacked in rank order."""
    blocks = platform.chunk(tensor, platform.world_size, 0)
    return platform.cat(platform.all_to_all(blocks), 0)


class MoeLayers:
    """Two layers of ``h = tanh(attn(x)); y = h + combine(relu(expert(dispatch(h))))``.

    ``log`` records every all-to-all: ``F<k>`` in a forward, ``B<k>`` in a backward.
    """

    def __init__(self, platform, overlap, log, make_linear, tanh, relu):
        self.p = platform
        self.log = log
        self.attn = [make_linear() for _ in range(2)]
        self.expert = [make_linear() for _ in range(2)]
        self.tanh, self.relu = tanh, relu
        self.dispatch = overlap.wrap_dispatch(self.a2a)
        self.combine = [overlap.wrap_combine(self.a2a), overlap.wrap_combine(self.a2a, is_last_layer=True)]

    def a2a(self, tensor):
        def forward(x):
            self.log.append(f"F{sum(e[0] == 'F' for e in self.log) + 1}")
            return all_to_all_rows(self.p, x)

        def backward(g):
            self.log.append(f"B{sum(e[0] == 'B' for e in self.log) + 1}")
            return all_to_all_rows(self.p, g)

        return self.p.custom_function(forward, backward, tensor)

    def __call__(self, x):
        for k in range(2):
            h = self.tanh(self.attn[k](x))
            x = h + self.combine[k](self.relu(self.expert[k](self.dispatch(h))))
        return (x * x).mean()


def two_steps(platform, model, params, inputs, overlap=None):
    """F(m0) as a plain step, then B(m0) and F(m1) (overlapped or one after the other), then
    B(m1) as a plain step. Returns losses, input gradients and parameter gradients as numpy."""
    p = platform
    grad_args = (True,)
    record0 = p.stage_forward(model, (inputs[0],), {}, params, grad_args)

    def backward0():
        return p.stage_backward(record0, [p.ones_like(record0.outputs[0])])

    def forward1():
        return p.stage_forward(model, (inputs[1],), {}, params, grad_args)

    if overlap is None:
        dx0 = backward0()
        record1 = forward1()
    else:
        record1, dx0 = overlap.run(forward1, backward0, forward_micro=1, backward_micro=0)
    dx1 = p.stage_backward(record1, [p.ones_like(record1.outputs[0])])
    losses = [p.to_numpy(record0.outputs[0]), p.to_numpy(record1.outputs[0])]
    return losses, [p.to_numpy(dx0[0]), p.to_numpy(dx1[0])], [p.to_numpy(p.get_grad(q)) for q in params]


def rank_body(setup):
    """One rank: the two steps plain, then overlapped, each on a freshly seeded model (so both
    start from the same values and inputs)."""
    p = get_platform()
    results = {}
    for mode in ("sequential", "overlapped"):
        make_linear, tanh, relu, inputs = setup(p)
        log: list[str] = []
        overlap = CommComputeOverlap(timeout=TIMEOUT)
        model = MoeLayers(p, overlap, log, make_linear, tanh, relu)
        params = [q for layer in model.attn + model.expert for _, q in p.named_parameters(layer)]
        results[mode] = (*two_steps(p, model, params, inputs, overlap if mode == "overlapped" else None), log)
    return results


def check(results_per_rank):
    for results in results_per_rank:
        seq, ovl = results["sequential"], results["overlapped"]
        for name, a, b in zip(("losses", "input gradients", "parameter gradients"), seq[:3], ovl[:3], strict=True):
            for x, y in zip(a, b, strict=True):
                assert np.array_equal(x, y), name
        # sequential: F(m0) (4 all-to-alls), then B(m0), F(m1), B(m1)
        assert seq[3] == [f"F{k}" for k in range(1, 5)] + [f"B{k}" for k in range(1, 5)] + \
            [f"F{k}" for k in range(5, 9)] + [f"B{k}" for k in range(5, 9)]
        # overlapped (worked out by hand): the backward side issues the combine gradient of
        # layer 2 and hands over before the experts' backward; the forward side computes
        # attention 1, issues its dispatch and hands over before its experts; and so on, one
        # all-to-all of each side in turn, until the forward side's last combine.
        assert ovl[3] == [f"F{k}" for k in range(1, 5)] + ["B1", "F5", "B2", "F6", "B3", "F7", "B4", "F8"] + \
            [f"B{k}" for k in range(5, 9)]


def torch_setup(p):
    import torch

    torch.manual_seed(1234 + p.rank)  # different experts on the two ranks

    def make_linear():
        return torch.nn.Linear(WIDTH, WIDTH)

    inputs = [torch.randn(TOKENS, WIDTH) for _ in range(2)]
    return make_linear, torch.tanh, torch.relu, inputs


def test_overlapped_steps_match_sequential_bitwise_torch():
    check(LocalCluster(2, "torch", timeout=TIMEOUT).run(rank_body, torch_setup))


def mindspore_setup(p):
    import mindspore as ms
    from mindspore import nn, ops

    ms.set_seed(1234 + p.rank)

    def make_linear():
        return nn.Dense(WIDTH, WIDTH)

    rng = np.random.default_rng(p.rank)
    inputs = [ms.Tensor(rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)) for _ in range(2)]
    return make_linear, ops.tanh, ops.relu, inputs


def test_overlapped_steps_match_sequential_bitwise_mindspore():
    pytest.importorskip("mindspore")
    check(LocalCluster(2, "mindspore", timeout=TIMEOUT).run(rank_body, mindspore_setup))


def test_a_failing_side_is_named_and_no_thread_is_left_behind():
    def body():
        import torch

        overlap = CommComputeOverlap(timeout=TIMEOUT)
        layer = torch.nn.Linear(WIDTH, WIDTH)
        dispatch = overlap.wrap_dispatch(lambda x: x * 2)
        x = torch.randn(TOKENS, WIDTH, requires_grad=True)
        loss = dispatch(layer(x)).sum()  # a plain step: its sync points do nothing
        finished = []

        def forward():
            layer(x)  # the backward side handed the turn over before its last layer
            raise ValueError("router produced 3 experts, expected 2")

        def backward():
            loss.backward()
            finished.append("backward")

        with pytest.raises(OverlapError) as info:
            overlap.run(forward, backward, forward_micro=5, backward_micro=2)
        helpers = [t.name for t in threading.enumerate() if "helper" in t.name]
        return str(info.value), type(info.value.__cause__).__name__, info.value.side, helpers, finished

    for message, cause, side, helpers, finished in LocalCluster(1, "torch", timeout=TIMEOUT).run(body):
        assert message == (
            "the forward side (micro-batch 5) of an overlapped step failed: "
            "ValueError: router produced 3 experts, expected 2"
        )
        assert (cause, side, helpers, finished) == ("ValueError", "forward", [], [])


def test_wrappers_check_their_arguments():
    def body():
        overlap = CommComputeOverlap(timeout=TIMEOUT)
        with pytest.raises(TypeError, match="dispatch function must be callable"):
            overlap.wrap_dispatch(3)
        with pytest.raises(TypeError, match="needs a tensor as its first argument"):
            overlap.wrap_combine(lambda x: x)([1, 2])
        with pytest.raises(TypeError, match="must return a tensor or a tuple/list starting with one"):
            import torch

            overlap.wrap_combine(lambda x: "nothing")(torch.ones(2))
        with pytest.raises(TypeError, match="fwd_fn must be callable"):
            overlap.run(None, lambda: None)

    LocalCluster(1, "torch", timeout=TIMEOUT).run(body)


# --- the built-in OVERLAP_B_F handler of a schedule (comm_compute_overlap=...) ------------------

P, CHUNKS, MICRO = 2, 2, 4  # rank 0 runs OVERLAP_B_F[B.s2.m0+F.s0.m3] and OVERLAP_B_F[B.s0.m0+F.s2.m3]


def _mlp_run(options, custom=None, fail=None, cls_name="ScheduleInterleaved1F1B"):
    """One training step of the MLP pipeline (tests/pipeline/mlp_harness.py) with interleaved 1F1B
    and ``options``; ``custom`` is registered for OVERLAP_B_F; ``fail=(stage, micro)`` makes that
    stage's forward of that micro-batch raise."""
    import torch
    from mlp_harness import MatrixJob, batch, build_stages, mse

    import hyper_parallel
    from hyper_parallel.core.pipeline_parallel.ir import MetaStepType

    cls = getattr(hyper_parallel, cls_name)
    job = MatrixJob(cls, CHUNKS, MICRO)
    placement = cls.stage_placement(P, CHUNKS)
    stages = build_stages(job, len(placement), placement)
    if fail is not None:
        for st in stages:
            if st.stage_index == fail[0]:
                module, calls = st.submodule, []
                original = module.forward

                def forward(*args, _original=original, _calls=calls):
                    _calls.append(1)
                    if len(_calls) == fail[1] + 1:  # the forwards of a stage run in micro-batch order
                        raise ValueError("expert capacity exceeded")
                    return _original(*args)

                module.forward = forward
    options = dict(options)
    if "comm_compute_overlap" in options:  # each rank its own overlap object: the class is given
        options["comm_compute_overlap"] = options["comm_compute_overlap"](timeout=TIMEOUT)
    schedule = cls(stages, MICRO, loss_fn=mse, **options)
    seen = []
    if custom is not None:
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, lambda step, ctx: custom(step, ctx, seen))
    x, y = batch(job.size(), MICRO, False)
    losses = schedule.run(torch.from_numpy(x), target=torch.from_numpy(y) if stages[-1].is_last else None)
    grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
    return {"losses": [float(v) for v in losses], "grads": grads, "seen": seen}


def _bitwise_equal(a, b):
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert sorted(ra["grads"]) == sorted(rb["grads"])
        for name, grad in ra["grads"].items():
            assert np.array_equal(grad, rb["grads"][name]), name


@pytest.mark.parametrize("transport", [{}, {"overlap_p2p": True}, {"p2p_transport": "batch", "overlap_p2p": True}],
                         ids=["plain", "plain-prefetch", "batch-prefetch"])
def test_schedule_pairs_on_an_overlap_without_wrapped_layers_match_no_overlap(transport):
    """No wrapped layers: each pair's two sides run one after the other on the helper threads (each
    waiting for its own posted receive); the result is bitwise the plain interleaved schedule's, and
    both match the non-pipelined oracle."""
    from mlp_harness import MatrixJob, check

    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B

    cluster = LocalCluster(P, "torch", timeout=TIMEOUT)
    plain = cluster.run(_mlp_run, dict(transport))
    fused = cluster.run(_mlp_run, {"overlap_b_f": True, **transport})
    overlapped = cluster.run(_mlp_run, {"overlap_b_f": True, "comm_compute_overlap": CommComputeOverlap, **transport})
    _bitwise_equal(plain, fused)
    _bitwise_equal(plain, overlapped)
    check(MatrixJob(ScheduleInterleaved1F1B, CHUNKS, MICRO), overlapped, P * CHUNKS)


@pytest.mark.parametrize("transport", [{}, {"p2p_transport": "batch", "overlap_p2p": True}], ids=["plain", "batch"])
def test_dualpipe_v_pairs_run_through_the_built_in_handler(transport):
    """DualPipeV emits OVERLAP_B_F pairs itself (V placement: a pair's halves are stages r and
    2p-1-r): given a CommComputeOverlap they run on its two threads, bitwise as without it, and match
    the non-pipelined oracle; a custom function still sees every pair."""
    from mlp_harness import MatrixJob, check

    from hyper_parallel import ScheduleDualPipeV

    def count(step, ctx, seen):
        seen.append(str(step))
        for sub in step.sub_steps:
            ctx.run_default(sub)

    cluster = LocalCluster(P, "torch", timeout=TIMEOUT)
    name = "ScheduleDualPipeV"
    plain = cluster.run(_mlp_run, dict(transport), cls_name=name)
    overlapped = cluster.run(_mlp_run, {"comm_compute_overlap": CommComputeOverlap, **transport}, cls_name=name)
    custom = cluster.run(_mlp_run, dict(transport), count, cls_name=name)
    _bitwise_equal(plain, overlapped)
    _bitwise_equal(plain, custom)
    assert all(r["seen"] and all(s.startswith("OVERLAP_B_F") for s in r["seen"]) for r in custom)
    check(MatrixJob(ScheduleDualPipeV, CHUNKS, MICRO), overlapped, P * CHUNKS)


def test_a_custom_overlap_function_overrides_the_built_in_handler():
    """The seed's callback pattern: ``bwd_step, fwd_step = step.sub_steps``; ctx.run_default runs
    each half the runtime's way. The CommComputeOverlap is never entered."""

    def custom(step, ctx, seen):
        bwd_step, fwd_step = step.sub_steps
        seen.append(str(step))
        ctx.run_default(bwd_step)
        ctx.run_default(fwd_step)

    overlaps = []

    class CountingOverlap(CommComputeOverlap):
        def run(self, *args, **kwargs):
            overlaps.append(1)
            return super().run(*args, **kwargs)

    cluster = LocalCluster(P, "torch", timeout=TIMEOUT)
    plain = cluster.run(_mlp_run, {})
    results = cluster.run(_mlp_run, {"overlap_b_f": True, "comm_compute_overlap": CountingOverlap}, custom)
    _bitwise_equal(plain, results)
    assert results[0]["seen"] == ["OVERLAP_B_F[B.s2.m0+F.s0.m3]", "OVERLAP_B_F[B.s0.m0+F.s2.m3]"]
    assert results[1]["seen"] == ["OVERLAP_B_F[B.s3.m1+F.s1.m2]", "OVERLAP_B_F[B.s1.m1+F.s3.m2]"]
    assert overlaps == []


def test_a_failing_side_of_a_schedule_pair_names_the_side_and_micro_batch():
    """Stage 0's forward of micro-batch 3 runs inside OVERLAP_B_F[B.s2.m0+F.s0.m3] on rank 0."""
    cluster = LocalCluster(P, "torch", timeout=TIMEOUT)
    options = {"overlap_b_f": True, "comm_compute_overlap": CommComputeOverlap}
    from hyper_parallel.platform.local import RankFailedError

    with pytest.raises(RankFailedError, match=r"rank 0 failed: OverlapError: the forward side \(micro-batch 3\) of an overlapped step failed: "
                       r"StageError: rank 0: the forward of stage 0 on micro-batch 3 \(F\.s0\.m3\) failed: "
                       r"ValueError: expert capacity exceeded") as info:
        cluster.run(_mlp_run, options, None, (0, 3))
    error = info.value.__cause__
    assert isinstance(error, OverlapError) and (error.side, error.micro_index) == ("forward", 3)


def test_comm_compute_overlap_needs_overlap_pairs_and_the_right_type():
    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B

    def body():
        from mlp_harness import MatrixJob, build_stages

        placement = ScheduleInterleaved1F1B.stage_placement(1, 2)
        stages = build_stages(MatrixJob(ScheduleInterleaved1F1B, 2, 2), 2, placement)
        with pytest.raises(ValueError, match="only with overlap_b_f=True"):
            ScheduleInterleaved1F1B(stages, 2, comm_compute_overlap=CommComputeOverlap())
        with pytest.raises(TypeError, match="comm_compute_overlap must be a CommComputeOverlap, got 'yes'"):
            ScheduleInterleaved1F1B(stages, 2, overlap_b_f=True, comm_compute_overlap="yes")
        with pytest.raises(TypeError, match="overlap_b_f must be a bool"):
            ScheduleInterleaved1F1B(stages, 2, overlap_b_f="on")

    LocalCluster(1, "torch", timeout=TIMEOUT).run(body)


def test_comm_compute_overlap_is_refused_by_schedules_without_overlap_pairs():
    """A schedule with no OVERLAP_B_F step would silently ignore the overlap object: refused, naming the
    schedule; DualPipeV (pairs in its middle phase) takes it."""
    from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleGPipe
    from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    def body():
        from mlp_harness import MatrixJob, build_stages

        for cls in (Schedule1F1B, ScheduleGPipe):
            stages = build_stages(MatrixJob(cls, 1, 2), 1, cls.stage_placement(1, 1))
            with pytest.raises(ValueError, match=f"this {cls.__name__} .* has none"):
                cls(stages[0], 2, comm_compute_overlap=CommComputeOverlap())
        stages = build_stages(MatrixJob(ScheduleZBVZeroBubble, 2, 2), 2, ScheduleZBVZeroBubble.stage_placement(1, 2))
        with pytest.raises(ValueError, match="this ScheduleZBVZeroBubble .* has none"):
            ScheduleZBVZeroBubble(stages, 2, comm_compute_overlap=CommComputeOverlap())
        overlap = CommComputeOverlap()
        schedule = ScheduleDualPipeV(stages, 2, comm_compute_overlap=overlap)
        assert schedule.comm_compute_overlap is overlap

    LocalCluster(1, "torch", timeout=TIMEOUT).run(body)


def test_interleaved_overlap_b_f_without_a_pair_names_the_fewest_micro_batches():
    """ScheduleInterleaved1F1B(overlap_b_f=True) at m <= p has no pair (every forward runs in the
    warm-up), so a comm_compute_overlap is refused; the message used to tell the user to use
    ScheduleInterleaved1F1B(overlap_b_f=True) -- what they did. It names m = p + 1 now, and the
    schedule pairs from there on."""
    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B

    def body():
        from mlp_harness import MatrixJob, build_stages

        stages = build_stages(MatrixJob(ScheduleInterleaved1F1B, 2, 2), 4, ScheduleInterleaved1F1B.stage_placement(2, 2))
        with pytest.raises(ValueError, match=r"ScheduleInterleaved1F1B \(p=2, m=2\) has none: with overlap_b_f=True it "
                           r"makes its first pair at 3 micro-batches: run at least 3 or drop comm_compute_overlap$"):
            ScheduleInterleaved1F1B(stages, 2, overlap_b_f=True, comm_compute_overlap=CommComputeOverlap())
        overlap = CommComputeOverlap()
        assert ScheduleInterleaved1F1B(stages, 3, overlap_b_f=True, comm_compute_overlap=overlap).comm_compute_overlap \
            is overlap

    LocalCluster(2, "torch", timeout=TIMEOUT).run(body)


@pytest.mark.parametrize("p", range(1, 6))
def test_interleaved_overlap_b_f_pairs_from_p_plus_1_micro_batches(p):
    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B
    from hyper_parallel.core.pipeline_parallel.schedules.interleaved_1f1b import generate_interleaved_1f1b

    least = ScheduleInterleaved1F1B.min_overlap_microbatches(p)
    for v in (2, 3, 4):
        for m in range(1, 2 * p + 3):
            steps = [st for rank in generate_interleaved_1f1b(p, v, m, overlap_b_f=True).values() for st in rank]
            assert any(st is not None and st.meta_type.is_overlap for st in steps) == (m >= least), (v, m)


@pytest.mark.parametrize("name", ["scale_grads", "overlap_p2p", "keep_grads_on_error", "swap"])
@pytest.mark.parametrize("value", ["False", 0, 1.0, None])
def test_schedule_switches_must_be_bools(name, value):
    """A truthy string or a number is never taken as a switch (``"False"`` would have turned it on)."""
    from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B

    def body():
        from mlp_harness import MatrixJob, build_stages

        stages = build_stages(MatrixJob(Schedule1F1B, 1, 2), 1, Schedule1F1B.stage_placement(1, 1))
        with pytest.raises(TypeError, match=f"{name} must be a bool, got {value!r}"):
            Schedule1F1B(stages[0], 2, **{name: value})

    LocalCluster(1, "torch", timeout=TIMEOUT).run(body)


@pytest.mark.parametrize("name", ["dyn_shape", "free_sent_outputs"])
def test_stage_switches_must_be_bools(name):
    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

    def body():
        import torch

        with pytest.raises(TypeError, match=f"{name} must be a bool, got 'yes'"):
            PipelineStage(torch.nn.Linear(2, 2), 0, 1, **{name: "yes"})

    LocalCluster(1, "torch", timeout=TIMEOUT).run(body)
