"""The schedule-driven swap pass: which micro-batches swap (the gap rule) and where the four swap
steps land in a rank's lowered list. Pure Python, no tensors."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_dualpipe_v,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_interleaved_zero_bubble,
    generate_zbv_zero_bubble,
)
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.features.swap import check_threshold, insert_swap_steps, swapped_keys
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

T = MetaStepType
S = MetaStep.from_str


def _gaps_by_hand(steps):
    """(stage, micro) -> slot of its backward minus slot of its forward, read off the text form."""
    text = [str(s) if s is not None else "-" for s in steps]
    out = {}
    for slot, cell in enumerate(text):
        for part in cell.replace("OVERLAP_B_F[", "").rstrip("]").split("+"):
            if part.startswith(("B.", "I.")):
                _, s, m = part.split(".")
                key = (int(s[1:]), int(m[1:]))
                fwd = text.index(f"F.{s}.{m}") if f"F.{s}.{m}" in text else next(
                    i for i, c in enumerate(text) if f"F.{s}.{m}" in c)
                out[key] = slot - fwd
    return out


def test_1f1b_four_ranks_eight_micro_batches_swap_by_gap():
    compute = generate_1f1b(4, 8)
    # rank 0: F0..F3 then B0 F4 B1 ...: every backward is 4 to 7 slots after its forward
    assert swapped_keys(compute[0], 4) == [(0, m) for m in range(8)]
    # rank 1: micro-batches 0 and 7 have a gap of 3, the others 4 or 5
    assert swapped_keys(compute[1], 4) == [(1, m) for m in range(1, 7)]
    # the last two ranks alternate F and B closely: everything stays resident
    assert swapped_keys(compute[2], 4) == []
    assert swapped_keys(compute[3], 4) == []


@pytest.mark.parametrize("threshold", [2, 3, 4, 6])
@pytest.mark.parametrize("compute", [generate_1f1b(4, 8), generate_gpipe(3, 5), generate_interleaved_1f1b(2, 2, 4)],
                         ids=["1f1b", "gpipe", "interleaved"])
def test_gap_rule_matches_a_hand_count(compute, threshold):
    for rank, steps in compute.items():
        expected = sorted(k for k, gap in _gaps_by_hand(steps).items() if gap >= threshold)
        assert swapped_keys(steps, threshold) == expected, f"rank {rank}"


def _positions(steps):
    return {str(s): i for i, s in enumerate(steps)}


def _only_swap_steps(steps, lo, hi):
    return all(steps[i].meta_type.name.startswith("SWAP_") for i in range(lo, hi))


def test_swap_steps_order_around_compute():
    compute = generate_1f1b(4, 8)
    lowered = lower(compute, {i: i for i in range(4)}, "plain", metadata="first", prefetch=False)
    keys = swapped_keys(compute[0], 4)
    steps = insert_swap_steps(lowered[0], keys)
    at = _positions(steps)
    computes = [i for i, s in enumerate(steps) if s.meta_type.is_compute]
    for s, m in keys:
        f, b = at[f"F.s{s}.m{m}"], at[f"B.s{s}.m{m}"]
        lo, wo = at[f"SWAP_LAUNCH_OFFLOAD.s{s}.m{m}"], at[f"SWAP_WAIT_OFFLOAD.s{s}.m{m}"]
        ll, wl = at[f"SWAP_LAUNCH_LOAD.s{s}.m{m}"], at[f"SWAP_WAIT_LOAD.s{s}.m{m}"]
        assert f < lo and _only_swap_steps(steps, f + 1, lo), "the offload starts right after the forward"
        next_compute = min(i for i in computes if i > f)
        assert next_compute < wo and _only_swap_steps(steps, next_compute + 1, wo), \
            "its wait comes right after the next compute step"
        prev_compute = max(i for i in computes if i < b)
        assert ll < prev_compute and _only_swap_steps(steps, ll, prev_compute), \
            "the load starts right before the compute step preceding the backward"
        assert wo < ll < wl < b and _only_swap_steps(steps, wl, b), "the load is waited right before B"
    assert len(steps) == len(lowered[0]) + 4 * len(keys)


def test_adjacent_forward_and_backward_still_ordered():
    # one idle slot between F and B: the gap is 2 slots, but there is no compute between them
    steps = [S("F.s0.m0"), S("B.s0.m0")]
    assert swapped_keys([S("F.s0.m0"), None, S("B.s0.m0")], 2) == [(0, 0)]
    out = [str(s) for s in insert_swap_steps(steps, [(0, 0)])]
    assert out == ["F.s0.m0", "SWAP_LAUNCH_OFFLOAD.s0.m0", "SWAP_WAIT_OFFLOAD.s0.m0",
                   "SWAP_LAUNCH_LOAD.s0.m0", "SWAP_WAIT_LOAD.s0.m0", "B.s0.m0"]


def test_split_backward_loads_before_the_input_backward():
    steps = [S("F.s0.m0"), S("F.s0.m1"), S("F.s0.m2"), S("I.s0.m0"), S("W.s0.m0")]
    assert swapped_keys(steps, 3) == [(0, 0)]
    out = [str(s) for s in insert_swap_steps(steps, [(0, 0)])]
    assert out.index("SWAP_WAIT_LOAD.s0.m0") == out.index("I.s0.m0") - 1
    assert out.index("SWAP_LAUNCH_LOAD.s0.m0") == out.index("F.s0.m2") - 1


def test_overlap_pair_parts_anchor_the_swap_steps():
    steps = [S("F.s0.m0"), S("F.s1.m0"), S("F.s0.m1"), S("OVERLAP_B_F[B.s1.m0+F.s0.m2]"), S("B.s0.m0")]
    keys = swapped_keys(steps, 3)
    assert keys == [(0, 0)]
    out = [str(s) for s in insert_swap_steps(steps, keys)]
    assert out.index("SWAP_LAUNCH_LOAD.s0.m0") == out.index("OVERLAP_B_F[B.s1.m0+F.s0.m2]") - 1
    assert out[-2:] == ["SWAP_WAIT_LOAD.s0.m0", "B.s0.m0"]


def test_swapped_lists_still_validate():
    compute = generate_1f1b(4, 8)
    stage_to_rank = {i: i for i in range(4)}
    lowered = lower(compute, stage_to_rank, "plain", metadata="first", prefetch=False)
    swapped = {r: insert_swap_steps(st, swapped_keys(compute[r], 2)) for r, st in lowered.items()}
    validate_lowered(swapped, stage_to_rank, 8, "plain", False)


def _real(name, p, m):
    """(compute lists, stage -> rank) of the dx/dW-split and OVERLAP_B_F schedules."""
    if name == "zb_h1":
        return generate_interleaved_zero_bubble(p, 1, m), looped_placement(p, 1)
    if name == "zb_interleaved":
        return generate_interleaved_zero_bubble(p, 2, m), looped_placement(p, 2)
    if name == "zbv":
        return generate_zbv_zero_bubble(p, m), v_placement(p)
    if name == "dualpipe_v":
        return generate_dualpipe_v(p, m), v_placement(p)
    placement = looped_placement(p, 2)  # Interleaved1F1B(overlap_b_f=True)
    return fuse_overlap_pairs(generate_interleaved_1f1b(p, 2, m), placement), placement


REAL = [("zb_h1", 4, 8), ("zb_interleaved", 2, 4), ("zbv", 2, 4), ("zbv", 4, 8), ("dualpipe_v", 2, 4),
        ("dualpipe_v", 4, 8), ("overlap_b_f", 2, 4), ("overlap_b_f", 4, 8)]


def _compute_index(steps, kinds, s, m):
    """Index in ``steps`` of the compute step that holds a part of kind ``kinds`` for (s, m)."""
    return next(j for j, st in enumerate(steps) if st.meta_type.is_compute and any(
        q.meta_type in kinds and (q.stage_index, q.micro_index) == (s, m) for q in st.parts))


@pytest.mark.parametrize("threshold", [2, 4])
@pytest.mark.parametrize(("name", "p", "m"), REAL, ids=[f"{n}-p{p}-m{m}" for n, p, m in REAL])
def test_swap_pass_on_split_and_overlap_schedules(name, p, m, threshold):
    """The pass on the real ZB-H1, ZB-V, DualPipeV and overlap_b_f lists: every swapped (stage,
    micro) gets its four steps once, the offload right after the step holding its forward (an
    OVERLAP_B_F pair included), the load waited right before the step holding its B or I (so
    before W), the load launched before the compute step preceding that; the lists still validate."""
    compute, placement = _real(name, p, m)
    lowered = lower(compute, placement, "plain", metadata="first", prefetch=False)
    swapped = {}
    for rank, steps in lowered.items():
        keys = swapped_keys(compute[rank], threshold)
        out = swapped[rank] = insert_swap_steps(steps, keys)
        assert len(out) == len(steps) + 4 * len(keys)
        swap_steps = [(st.meta_type, st.stage_index, st.micro_index) for st in out if st.meta_type.name.startswith("SWAP_")]
        assert sorted({(s, i) for _, s, i in swap_steps}) == keys
        assert len(set(swap_steps)) == len(swap_steps), "each swap step once"
        computes = [j for j, st in enumerate(out) if st.meta_type.is_compute]
        for s, i in keys:
            at = {st.meta_type: j for j, st in enumerate(out)
                  if st.meta_type.name.startswith("SWAP_") and (st.stage_index, st.micro_index) == (s, i)}
            f = _compute_index(out, (T.FWD,), s, i)
            b = _compute_index(out, (T.BWD, T.BWD_INPUT), s, i)
            lo, wo, ll, wl = (at[T.SWAP_LAUNCH_OFFLOAD], at[T.SWAP_WAIT_OFFLOAD], at[T.SWAP_LAUNCH_LOAD],
                              at[T.SWAP_WAIT_LOAD])
            assert f < lo < wo < ll < wl < b, (rank, s, i, [str(x) for x in out])
            assert _only_swap_steps(out, f + 1, lo) and _only_swap_steps(out, wl, b)
            between = [j for j in computes if f < j < b]
            if between:
                assert between[0] < wo and _only_swap_steps(out, between[0] + 1, wo), "offload waited after the next compute"
            if len(between) > 1:
                assert ll < between[-1] and _only_swap_steps(out, ll, between[-1]), "load overlaps the step before B"
            weights = [j for j, st in enumerate(out) if any(
                q.meta_type is T.BWD_WEIGHT and (q.stage_index, q.micro_index) == (s, i) for q in st.parts)]
            assert all(j > b for j in weights)
    validate_lowered(swapped, placement, m, "plain", False)
    if name in ("dualpipe_v", "overlap_b_f") and threshold == 2:  # pairs anchor swap steps
        pair_keys = {(q.stage_index, q.micro_index) for steps in compute.values() for st in steps
                     if st is not None and st.meta_type is T.OVERLAP_B_F for q in st.parts}
        assert pair_keys & {k for r in compute for k in swapped_keys(compute[r], threshold)}


@pytest.mark.parametrize(("value", "error", "match"), [
    (1, ValueError, "swap_threshold must be >= 2"),
    (0, ValueError, "swap_threshold must be >= 2"),
    (2.5, TypeError, "swap_threshold must be an int"),
    (True, TypeError, "swap_threshold must be an int"),
])
def test_bad_threshold(value, error, match):
    with pytest.raises(error, match=match):
        check_threshold(value)
