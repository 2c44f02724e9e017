"""MPipe without tensors: ownership, the sampler, the inserted steps, their checks and the simulator."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.features.mpipe.model import check_mpipe, plan_mpipe, run_mpipe, simulate_mpipe
from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import (
    MPipeBatchSampler,
    MPipePlan,
    owned_microbatches,
    owned_sample_indices,
    owner_of,
)
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart

T = MetaStepType


def expected_owner(j: int, p: int, m: int, mode: str) -> int:
    nt = min(p, m)
    return j % nt if mode == "full" or j < nt else 0


# ---------------------------------------------------------------------- ownership and sampler


def test_owners_full_and_min_by_hand():
    assert [owner_of(j, 4, 10, "full") for j in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [owner_of(j, 4, 10, "min") for j in range(10)] == [0, 1, 2, 3, 0, 0, 0, 0, 0, 0]
    assert [owner_of(j, 4, 2, "full") for j in range(2)] == [0, 1]
    assert owned_microbatches(3, 4, 2) == [] and owned_microbatches(1, 4, 10, "full") == [1, 5, 9]


def test_owned_sample_indices_and_batch_sampler_by_hand():
    assert owned_sample_indices(1, 4, 8, 16, "full") == [2, 3, 10, 11]
    assert owned_sample_indices(0, 4, 8, 16, "min") == [0, 1, 8, 9, 10, 11, 12, 13, 14, 15]
    assert owned_sample_indices(2, 4, 8, 16, offset=100) == [104, 105, 112, 113]
    sampler = MPipeBatchSampler(dataset_size=40, global_batch_size=16, num_microbatches=8, num_ranks=4, pp_rank=1)
    assert len(sampler) == 2
    assert list(sampler) == [[2, 3, 10, 11], [18, 19, 26, 27]]
    assert list(MPipeBatchSampler(16, 16, 2, 4, 3)) == [[]]  # a rank that owns no micro-batch reads nothing


def test_ownership_errors_name_the_value():
    with pytest.raises(ValueError, match="overflow_mode must be one of 'full', 'min', got 'half'"):
        owner_of(0, 4, 8, "half")
    with pytest.raises(ValueError, match="global_batch_size 10 does not divide into 4 micro-batches"):
        owned_sample_indices(0, 2, 4, 10)
    with pytest.raises(ValueError, match=r"micro-batch index must be an int in \[0, 4\), got 4"):
        owner_of(4, 2, 4)


# ---------------------------------------------------------------------- every shape of job


def _variants(p: int, m: int) -> list[dict]:
    """Both chunk counts x both backward modes, plus one of the other modes (rotating)."""
    out = [dict(num_chunks=v, owner_backward=ob) for v in (1, 2) for ob in (False, True)]
    others = [dict(num_transpose_layers=0, inputs="owned"), dict(trainable=False), dict(forward_only=True),
              dict(inputs="owned", overlap_p2p=True)]
    out.append(dict(num_chunks=1 + (p + m) % 2, **others[(p * 7 + m) % len(others)]))
    return out


CASES = [(p, m, mode) for p in range(1, 7) for m in range(1, 3 * p + 1) for mode in ("full", "min")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("p", range(1, 7))
def test_every_job_shape_validates_and_simulates_deadlock_free(p):
    for m in range(1, 3 * p + 1):
        for mode in ("full", "min"):
            for variant in _variants(p, m):
                options = dict(variant)
                v = options.pop("num_chunks")
                options.setdefault("num_transpose_layers", 2)
                what = f"p={p} m={m} mode={mode} v={v} {options}"
                plan, placement, lowered = plan_mpipe(p, v, m, overflow_mode=mode, **options)  # checks
                assert plan.num_owners == min(p, m), what
                for rank, steps in lowered.items():
                    pf = [s.micro_index for s in steps if s.meta_type is T.PRE_FWD]
                    assert pf == sorted(pf), what
                    assert set(pf) == {j for j in range(m) if expected_owner(j, p, m, mode) == rank}, what
                sim = simulate_mpipe(p, v, m, options.pop("num_transpose_layers"), overflow_mode=mode, **options)
                assert sim.result.makespan > 0, what
                plain = simulate_mpipe(p, v, m, 2, overflow_mode=mode, transpose=False)
                assert all(s.micro_index is None or s.meta_type is not T.PRE_SEND
                           for steps in plain.lowered.values() for s in steps), what


# ---------------------------------------------------------------------- the checks can fail


def _remove(lowered: dict, rank: int, text: str) -> dict:
    out = {r: list(steps) for r, steps in lowered.items()}
    out[rank].remove(MetaStep.from_str(text))
    return out


def test_check_names_a_missing_receive():
    plan, placement, lowered = plan_mpipe(2, 1, 4, trainable=False)
    with pytest.raises(ScheduleError, match="MPipe: RECV_P.m1 is missing"):
        check_mpipe(_remove(lowered, 0, "RECV_P.m1"), placement, plan)


def test_check_finds_sends_out_of_fifo_order():
    plan, placement, lowered = plan_mpipe(2, 1, 4, trainable=False)  # rank 1 owns micro-batches 1 and 3
    steps = lowered[1]
    a, b = steps.index(MetaStep.from_str("SEND_P.m1")), steps.index(MetaStep.from_str("SEND_P.m3"))
    steps[a], steps[b] = steps[b], steps[a]
    steps.remove(MetaStep.from_str("PF.m3"))
    steps.insert(a, MetaStep.from_str("PF.m3"))
    with pytest.raises(ScheduleError, match="FIFO order from rank 1 to rank 0"):
        check_mpipe(lowered, placement, plan)


def test_model_finds_a_preprocess_placed_after_what_waits_for_it():
    plan, placement, lowered = plan_mpipe(2, 1, 2, trainable=False)
    moved = _remove(_remove(lowered, 1, "PF.m1"), 1, "SEND_P.m1")
    moved[1] += [MetaStep.from_str("PF.m1"), MetaStep.from_str("SEND_P.m1")]
    with pytest.raises(ScheduleError, match="(?s)cannot finish.*rank 0 is stuck at F.s0.m1, waiting for the preprocess output of micro-batch 1"):
        run_mpipe(moved, placement, plan)


def test_check_refuses_a_backward_in_an_evaluation_pass():
    plan, placement, lowered = plan_mpipe(2, 1, 2)
    with pytest.raises(ScheduleError, match="PB.m0 is not expected here"):
        check_mpipe(lowered, placement, plan, forward_only=True)


def test_plan_rejects_a_backward_without_compute():
    with pytest.raises(ValueError, match="dataload-only plan"):
        MPipePlan(2, 2, compute=False, backward="recompute")


# ---------------------------------------------------------------------- the simulator, by hand


def test_warmup_of_two_ranks_by_hand():
    """p = 2, m = 2, one stage per rank (F = 1, B = 2), a frozen preprocess of 3 body layers
    (3 per micro-batch). Plain: rank 0 runs PF0 [0,3] F0 [3,4] PF1 [4,7] F1 [7,8]; rank 1 F0 [4,5]
    B0 [5,7]; rank 0 B0 [8,10]; rank 1 F1 [8,9] B1 [9,11]; rank 0 B1 [11,13]. MPipe: rank 1 runs
    PF1 [0,3] meanwhile, so rank 0 runs F1 [4,5] and B0 [7,9]; rank 1 F1 [7,8] B1 [8,10]; rank 0
    B1 [10,12]. The warm-up ends at rank 0's first backward: 8 (idle: rank 1 5) and 7 (idle:
    rank 0 2, rank 1 1)."""
    plain = simulate_mpipe(2, 1, 2, 3, trainable=False, transpose=False)
    mpipe = simulate_mpipe(2, 1, 2, 3, trainable=False)
    assert (plain.result.makespan, plain.warmup_end, plain.warmup_idle) == (13.0, 8.0, {0: 0.0, 1: 5.0})
    assert (mpipe.result.makespan, mpipe.warmup_end, mpipe.warmup_idle) == (12.0, 7.0, {0: 2.0, 1: 1.0})
    assert mpipe.warmup_bubble == 3.0


def test_owner_backward_moves_the_preprocess_backward_off_stage_zero():
    """Same job, trainable (PF = 3, PB = 6): with the owner's backward, rank 0 runs PB only for
    its own micro-batch 0; with the recompute, it runs PF + PB (9) again for micro-batch 1."""
    rec = simulate_mpipe(2, 1, 2, 3)
    own = simulate_mpipe(2, 1, 2, 3, owner_backward=True)
    assert rec.result.busy[0] == 3 + 2 * 1 + 2 * 2 + 6 + 9
    assert own.result.busy[0] == 3 + 2 * 1 + 2 * 2 + 6
    assert own.result.busy[1] == 3 + 2 * 1 + 2 * 2 + 6


def test_chart_shows_the_transposed_preprocess():
    plain = simulate_mpipe(4, 2, 8, 2, trainable=False, transpose=False)
    mpipe = simulate_mpipe(4, 2, 8, 2, trainable=False)
    rows = {r: line for r, line in enumerate(ascii_chart(mpipe.result, width=400, mode="full").splitlines()[1:5])}
    assert rows[1].split("|")[1].startswith("PF1") and rows[3].split("|")[1].startswith("PF3")
    assert "PF1" not in ascii_chart(plain.result, width=400, mode="full").splitlines()[2]
    assert "P" in ascii_chart(mpipe.result, width=60, mode="compact").splitlines()[2]
    assert mpipe.warmup_end < plain.warmup_end and mpipe.result.makespan < plain.result.makespan


def test_schedule_class_generates_one_or_more_chunks():
    one = ScheduleMPipeTranspose.generate(3, 1, 4)
    assert [str(s) for s in one[2][:2]] == ["F.s2.m0", "B.s2.m0"]
    two = ScheduleMPipeTranspose.generate(2, 2, 4)
    assert {s.stage_index for s in two[1]} == {1, 3}
