"""Whole schedules (torch LocalCluster) against the non-pipelined model where issue 21 found wrong
gradients: gradient hooks at the dx/dW boundary under the zero-bubble schedules, a loss function
with its own parameters under every schedule, and saved tensors changed in place on every path of
the runtime (saved-tensor pool or not, full backward or dx/dW split). The stages, the loss and the
oracle: ``split_hooks_harness``; the same on real gloo: test_pp_issue21_gloo.py.
"""

from __future__ import annotations

import pytest
from split_hooks_harness import HOOKS, SCHEDULES, ZERO_BUBBLE, Job, check, oracle, run_rank

from hyper_parallel.platform.local import LocalCluster, RankFailedError

pytestmark = pytest.mark.timeout(300)


def run_and_check(job: Job, ranks: int = 2) -> None:
    check(job, LocalCluster(ranks).run(run_rank, job), ranks)


# ---------------------------------------------------------------- hooks under the zero-bubble schedules
@pytest.mark.parametrize("hooks", [*HOOKS, "all"])
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_zero_bubble_schedule_with_gradient_hooks_matches_the_non_pipelined_model(schedule, hooks):
    job = Job(schedule, 4, HOOKS if hooks == "all" else (hooks,))
    ref = oracle(job, job.num_stages(2))
    assert all(n == job.micro for c in ref["calls"].values() for n in c.values()) and ref["calls"][0]
    run_and_check(job)


# ---------------------------------------------------------------- a loss function with parameters
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_loss_fn_parameters_get_the_non_pipelined_gradient_under_every_schedule(schedule):
    run_and_check(Job(schedule, 4))


# ---------------------------------------------------------------- in-place changes of saved tensors
INPLACE_CASES = [  # (schedule, m, stage, forward): which runtime path reads the changed tensor
    ("1f1b", 1, 0, 0),  # a non-last stage's first forward packs into the pool; full backward
    ("gpipe", 1, 0, 0),
    ("1f1b", 2, 0, 1),  # its later forwards (one tensor sent) run without the pool: torch's own check
    ("1f1b", 2, 1, 0),  # the last stage runs without the pool
    ("gpipe", 2, 1, 1),
    ("interleaved", 2, 2, 0),
    ("looped_bfs", 2, 1, 1),
    ("zb-h1", 2, 0, 0),  # the split, its error in dW (no differentiable input: all weight side)
    ("zb-h1", 2, 1, 1),  # the split, its error in dx
    ("zbv", 2, 1, 1),
    ("zbv", 2, 3, 0),
    ("dualpipev", 4, 2, 0),
]


@pytest.mark.parametrize("schedule, m, stage, forward", INPLACE_CASES,
                         ids=[f"{c[0]}-m{c[1]}-stage{c[2]}-mb{c[3]}" for c in INPLACE_CASES])
def test_a_saved_tensor_changed_in_place_raises_on_every_path(schedule, m, stage, forward):
    job = Job(schedule, m, inplace=((stage, forward),))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oracle(job, job.num_stages(2))  # plain torch raises too
    with pytest.raises(RankFailedError, match=f"backward of stage {stage} on micro-batch {forward} .*"
                                              "modified by an inplace operation"):
        LocalCluster(2).run(run_rank, job)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize("m", [1, 2])
def test_valid_in_place_ops_pass_on_every_path(schedule, m):
    run_and_check(Job(schedule, m, valid_inplace=True))


# ---------------------------------------------------------------- a failed run and the loss parameters
def _run_then_fail(schedule: str) -> list[bool]:
    """A good run, then one whose last stage raises in its last forward: every gradient the second
    run touched, the loss function's parameters' too, must be as the first run left it."""
    import torch

    from hyper_parallel import PipelineStage
    from hyper_parallel.platform import get_platform
    from split_hooks_harness import Block, ScaledMSE, data

    p = get_platform()
    cls, chunks, extra = SCHEDULES[schedule]
    placement = cls.stage_placement(p.world_size, chunks)
    num = len(placement)
    blocks = {s: Block(s) for s, r in placement.items() if r == p.rank}
    stages = [PipelineStage(blocks[s], s, num) for s in sorted(blocks)]
    loss_fn = ScaledMSE()
    sched = cls(stages if len(stages) > 1 else stages[0], 4, loss_fn=loss_fn, **extra)
    x, y = data(4)
    target = y if (num - 1) in blocks else None
    sched.run(x, target=target)
    params = [q for b in blocks.values() for q in b.parameters()]
    if target is not None:
        params += list(loss_fn.parameters())
        last = blocks[num - 1]
        forward = last.forward

        def failing(h):  # type: ignore[no-untyped-def]
            if last.forwards == 3:
                raise ValueError("injected failure in the last forward")
            return forward(h)

        last.forward = failing
        last.forwards = 0
    before = [q.grad.clone() for q in params]
    with pytest.raises(Exception):
        sched.run(x, target=target)
    return [torch.equal(q.grad, b) for q, b in zip(params, before)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_failed_run_restores_the_loss_parameters_gradients(schedule):
    results = LocalCluster(2, timeout=60).run(_run_then_fail, schedule)
    assert all(all(r) for r in results), results
