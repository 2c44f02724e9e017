"""Schedule CSV against torch.distributed.pipelining's own writer and reader.

Files are written by torch itself (``_dump_csv`` on schedules built from stand-in stage
objects, as torch's own schedule tests do, no process group needed), read with ours,
written back with ours in torch style and read again with torch's own loader. The expected
steps come from a mapping table written out in this file, not from the code under test.
"""

from __future__ import annotations

import csv
import io
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.pipelining.schedules as ts

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType, consumer_stage, message_key
from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import (
    format_schedule_csv,
    load_schedule_csv,
    parse_cell,
    parse_schedule_csv,
    save_schedule_csv,
)

T = MetaStepType
S = MetaStep.from_str
A = ts._Action
CT = ts._ComputationType

# torch action type (by enum name) -> our step type: the mapping the module documents
KIND = {
    "FORWARD": T.FWD,
    "FULL_BACKWARD": T.BWD,
    "BACKWARD_INPUT": T.BWD_INPUT,
    "BACKWARD_WEIGHT": T.BWD_WEIGHT,
    "SEND_F": T.FWD_SEND,
    "RECV_F": T.FWD_RECV,
    "SEND_B": T.BWD_SEND,
    "RECV_B": T.BWD_RECV,
    "UNSHARD": T.FSDP_UNSHARD,
    "RESHARD": T.FSDP_RESHARD,
    "REDUCE_GRAD": T.FSDP_REDUCE_GRAD,
    "OVERLAP_F_B": T.OVERLAP_F_B,
}


def ours(action: A | None) -> MetaStep | None:
    if action is None:
        return None
    kind = KIND[action.computation_type.name]
    if action.sub_actions is not None:
        return MetaStep(None, kind, None, tuple(ours(sub) for sub in action.sub_actions))
    return MetaStep(action.microbatch_index, kind, action.stage_index)


class FakeStage:
    """What torch's schedule constructors read from a stage (no process group, no model run)."""

    def __init__(self, index: int, num_stages: int, rank: int, ranks: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_rank, self.group_size = rank, ranks
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Linear(1, 1)


MULTI = [  # name, ranks, micro-batches
    ("ScheduleInterleaved1F1B", 2, 4),
    ("ScheduleInterleaved1F1B", 4, 8),
    ("ScheduleLoopedBFS", 2, 4),
    ("ScheduleInterleavedZeroBubble", 2, 4),
    ("ScheduleInterleavedZeroBubble", 4, 8),
    ("ScheduleZBVZeroBubble", 2, 4),
    ("ScheduleZBVZeroBubble", 4, 8),
    ("ScheduleDualPipeV", 2, 4),
    ("ScheduleDualPipeV", 4, 8),
]
SINGLE = [("ScheduleGPipe", 2, 4), ("Schedule1F1B", 4, 8)]


def torch_multi(name: str, ranks: int, micro: int) -> ts._PipelineScheduleRuntime:
    cls = getattr(ts, name)
    second = 2 * ranks - 1 if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else ranks
    stages = [FakeStage(0, 2 * ranks, 0, ranks), FakeStage(second, 2 * ranks, 0, ranks)]
    return cls(stages, micro, loss_fn=lambda out, target: out)


def torch_single(name: str, ranks: int, micro: int) -> ts.PipelineScheduleSingle:
    return getattr(ts, name)(FakeStage(0, ranks, 0, ranks), micro, loss_fn=lambda out, target: out)


def torch_dump(pipeline_order, path) -> None:
    """torch's compute-only writer, on any object that holds a ``pipeline_order``."""
    ts.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=pipeline_order), path)


def torch_read_actions(path) -> dict[int, list[A | None]]:
    """torch's action parser over the CSV rows, as its ``_load_csv`` reads them."""
    with open(path, newline="") as handle:
        return {rank: [A.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(handle))}


def rows(path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def expected(order) -> dict[int, list[MetaStep | None]]:
    return {rank: [ours(a) for a in actions] for rank, actions in order.items()}


def round_trip_checks(order, torch_file, tmp_path) -> dict[int, list[MetaStep | None]]:
    """torch's file -> ours -> torch style: same steps, same text, torch reads the same actions."""
    schedule = load_schedule_csv(torch_file)
    assert schedule == expected(order)
    ours_file = tmp_path / "ours_torch_style.csv"
    save_schedule_csv(ours_file, schedule, style="torch")
    assert rows(ours_file) == rows(torch_file)
    assert torch_read_actions(ours_file) == {rank: list(actions) for rank, actions in order.items()}
    assert parse_schedule_csv(format_schedule_csv(schedule, style="ours")) == schedule
    return schedule


@pytest.mark.parametrize("name, ranks, micro", MULTI)
def test_torch_compute_comms_files_round_trip(name, ranks, micro, tmp_path):
    theirs = torch_multi(name, ranks, micro)
    torch_file = tmp_path / "torch.csv"
    theirs._dump_csv(torch_file, format="compute_comms")
    schedule = round_trip_checks(theirs.pipeline_order_with_comms, torch_file, tmp_path)

    again = torch_multi(name, ranks, micro)
    again._load_csv(str(tmp_path / "ours_torch_style.csv"), format="compute_comms")
    assert again.pipeline_order_with_comms == theirs.pipeline_order_with_comms

    # the same P2P convention: every send has its recv on the rank of the stage that consumes it
    stage_to_rank = theirs.stage_index_to_group_rank
    recvs = {(rank, message_key(s)) for rank, steps in schedule.items() for s in steps if s.meta_type.is_recv}
    sends = [s for steps in schedule.values() for s in steps if s.meta_type.is_send]
    assert sends and len(sends) == len(recvs)
    for send in sends:
        key = message_key(send)
        assert (stage_to_rank[consumer_stage(key)], key) in recvs, send


@pytest.mark.parametrize("name, ranks, micro", MULTI)
def test_torch_compute_only_files_round_trip(name, ranks, micro, tmp_path):
    theirs = torch_multi(name, ranks, micro)
    torch_file = tmp_path / "torch.csv"
    theirs._dump_csv(torch_file, format="compute_only")
    round_trip_checks(theirs.pipeline_order, torch_file, tmp_path)

    again = torch_multi(name, ranks, micro)
    again._load_csv(str(tmp_path / "ours_torch_style.csv"), format="compute_only")
    assert again.pipeline_order == theirs.pipeline_order
    assert again.pipeline_order_with_comms == theirs.pipeline_order_with_comms


@pytest.mark.parametrize("name, ranks, micro", SINGLE)
def test_torch_single_stage_schedules_round_trip(name, ranks, micro, tmp_path):
    theirs = torch_single(name, ranks, micro)
    torch_file = tmp_path / "torch.csv"
    torch_dump(theirs.pipeline_order, torch_file)
    schedule = round_trip_checks(theirs.pipeline_order, torch_file, tmp_path)
    assert schedule[0][-1] == S("FSDP_REDUCE_GRAD.s0")


def test_dual_pipe_v_overlap_cells_are_composites():
    theirs = torch_multi("ScheduleDualPipeV", 2, 4)
    text = io.StringIO()
    csv.writer(text).writerows(theirs.pipeline_order_with_comms[r] for r in sorted(theirs.pipeline_order_with_comms))
    schedule = parse_schedule_csv(text.getvalue())
    overlaps = [s for steps in schedule.values() for s in steps if s.meta_type is T.OVERLAP_F_B]
    assert overlaps
    assert S("OVERLAP_F_B[F.s0.m3+B.s3.m1]") in schedule[0]
    assert all([p.meta_type for p in s.sub_steps] == [T.FWD, T.BWD] for s in overlaps)


# every torch action type, written by torch's own writer
HAND_BUILT = {
    0: [
        A(0, CT.UNSHARD), A(2, CT.UNSHARD), A(0, CT.FORWARD, 0), A(0, CT.SEND_F, 0), None,
        A(0, CT.RECV_B, 0), A(0, CT.BACKWARD_INPUT, 0), A(0, CT.BACKWARD_WEIGHT, 0),
        A(-1, CT.OVERLAP_F_B, None, (A(2, CT.FORWARD, 1), A(0, CT.FULL_BACKWARD, 1))),
        A(0, CT.REDUCE_GRAD), A(0, CT.RESHARD), A(12, CT.FORWARD, 340),
    ],
    1: [],
    2: [None, A(1, CT.RECV_F, 0), A(1, CT.FORWARD, 0), A(1, CT.FULL_BACKWARD, 0), A(1, CT.SEND_B, 0), None],
}
HAND_BUILT_OURS = {
    0: [
        S("FSDP_UNSHARD.s0"), S("FSDP_UNSHARD.s2"), S("F.s0.m0"), S("SEND_F.s0.m0"), None,
        S("RECV_B.s0.m0"), S("I.s0.m0"), S("W.s0.m0"), S("OVERLAP_F_B[F.s2.m1+B.s0.m1]"),
        S("FSDP_REDUCE_GRAD.s0"), S("FSDP_RESHARD.s0"), S("F.s12.m340"),
    ],
    1: [],
    2: [None, S("RECV_F.s1.m0"), S("F.s1.m0"), S("B.s1.m0"), S("SEND_B.s1.m0"), None],
}


def test_hand_built_actions_cover_every_torch_action_type(tmp_path):
    used = {a.computation_type for actions in HAND_BUILT.values() for a in actions if a is not None}
    assert used == set(CT)
    torch_file = tmp_path / "torch.csv"
    torch_dump(HAND_BUILT, torch_file)
    assert rows(torch_file)[0][:3] == ["0UNSHARD", "2UNSHARD", "0F0"]
    assert load_schedule_csv(torch_file) == HAND_BUILT_OURS
    schedule = round_trip_checks(HAND_BUILT, torch_file, tmp_path)
    assert format_schedule_csv(schedule, style="torch").splitlines()[0] == (
        "0UNSHARD,2UNSHARD,0F0,0SEND_F0,,0RECV_B0,0I0,0W0,(2F1;0B1)OVERLAP_F_B,0REDUCE_GRAD,0RESHARD,12F340"
    )


def test_ours_style_round_trip_covers_every_step_type(tmp_path):
    schedule = {
        0: [S("F.s0.m0"), None, S("BATCH[SEND_F.s0.m0+RECV_B.s0.m0]"), S("OVERLAP_B_F[B.s0.m0+F.s0.m1]")],
        1: [S(f"{t.code}.s1.m2") for t in T],
        2: [S(f"{t.code}.s3") for t in T] + [S("OVERLAP_F_B[F.s2.m1+B.s5.m0]")],
    }
    path = tmp_path / "ours.csv"
    save_schedule_csv(path, schedule)
    assert rows(path)[0] == ["F.s0.m0", "", "BATCH[SEND_F.s0.m0+RECV_B.s0.m0]", "OVERLAP_B_F[B.s0.m0+F.s0.m1]"]
    assert load_schedule_csv(path) == schedule
    assert parse_schedule_csv(format_schedule_csv(HAND_BUILT_OURS)) == HAND_BUILT_OURS


def test_cells_of_both_styles_mix_in_one_file():
    text = "0UNSHARD,F.s0.m0,0SEND_F0,,(0F1;1B0)OVERLAP_F_B,OVERLAP_F_B[F.s0.m2+B.s1.m1]\r\n1RECV_F0,FSDP_RESHARD.s1\r\n"
    assert parse_schedule_csv(text) == {
        0: [S("FSDP_UNSHARD.s0"), S("F.s0.m0"), S("SEND_F.s0.m0"), None,
            S("OVERLAP_F_B[F.s0.m1+B.s1.m0]"), S("OVERLAP_F_B[F.s0.m2+B.s1.m1]")],
        1: [S("RECV_F.s1.m0"), S("FSDP_RESHARD.s1")],
    }
    assert parse_cell(" 3REDUCE_GRAD ") == MetaStep(None, T.FSDP_REDUCE_GRAD, 3)
    assert parse_cell("( 0F1 ; 1I0 )OVERLAP_F_B") == S("OVERLAP_F_B[F.s0.m1+I.s1.m0]")
    assert parse_cell("()OVERLAP_F_B") == S("OVERLAP_F_B[]")


def test_batch_is_written_as_its_sub_steps_in_order(tmp_path):
    schedule = {0: [S("F.s0.m0"), S("BATCH[SEND_F.s0.m0+SEND_B.s0.m1+RECV_B.s0.m0+RECV_F.s0.m2]"), S("B.s0.m0")]}
    text = format_schedule_csv(schedule, style="torch")
    assert text == "0F0,0SEND_F0,0SEND_B1,0RECV_B0,0RECV_F2,0B0\n"
    path = tmp_path / "batch.csv"
    save_schedule_csv(path, schedule, style="torch")
    assert torch_read_actions(path)[0] == [
        A(0, CT.FORWARD, 0), A(0, CT.SEND_F, 0), A(0, CT.SEND_B, 1), A(0, CT.RECV_B, 0), A(0, CT.RECV_F, 2),
        A(0, CT.FULL_BACKWARD, 0),
    ]
    assert load_schedule_csv(path)[0] == [S(c) for c in ("F.s0.m0", "SEND_F.s0.m0", "SEND_B.s0.m1", "RECV_B.s0.m0",
                                                          "RECV_F.s0.m2", "B.s0.m0")]


@pytest.mark.parametrize("text, why", [
    ("OVERLAP_B_F[B.s1.m0+F.s1.m2]", "torch.distributed.pipelining has no OVERLAP_B_F action"),
    ("SWAP_LAUNCH_OFFLOAD.s0.m1", "has no SWAP_LAUNCH_OFFLOAD action"),
    ("SWAP_WAIT_LOAD.s0.m1", "has no SWAP_WAIT_LOAD action"),
    ("F.s0", "torch's F needs a non-negative micro-batch index"),
    ("SEND_B.m0", "torch's SEND_B needs a non-negative stage index"),
    ("F.s-1.m0", "torch's F needs a non-negative stage index"),
    ("FSDP_UNSHARD.s0.m3", "torch's UNSHARD takes no micro-batch index"),
    ("F[B.s0.m0].s0.m1", "torch's F has no sub-actions"),
    ("OVERLAP_F_B[F.s0.m1+B.s1.m0].s0", "OVERLAP_F_B carries neither a stage nor a micro-batch index"),
    ("OVERLAP_F_B[]", "OVERLAP_F_B needs at least one sub-action"),
    ("OVERLAP_F_B", "OVERLAP_F_B needs at least one sub-action"),
    ("OVERLAP_F_B.s0.m0", "OVERLAP_F_B carries neither a stage nor a micro-batch index"),
    ("OVERLAP_F_B[BATCH[SEND_F.s0.m0]+B.s1.m0]", r"OVERLAP_F_B may hold only plain actions in torch style, not BATCH"),
    ("BATCH[SEND_F.s0.m0].s0", "a BATCH is written as its sub-steps"),
    ("BATCH[SEND_F.s0.m0+SWAP_WAIT_LOAD.s0.m0]", "has no SWAP_WAIT_LOAD action"),
])
def test_steps_torch_cannot_express_raise_naming_the_step(text, why):
    schedule = {0: [S("F.s0.m0")], 1: [None, S("F.s1.m0"), S(text)]}
    with pytest.raises(ValueError, match=r"rank 1, position 2: cannot write .* in torch style: .*" + why) as info:
        format_schedule_csv(schedule, style="torch")
    assert text in str(info.value)
    assert format_schedule_csv(schedule, style="ours").splitlines()[1] == f",F.s1.m0,{text}"


def test_bad_style_and_bad_torch_cells():
    with pytest.raises(ValueError, match=r"style must be one of \('ours', 'torch'\), got 'megatron'"):
        format_schedule_csv({0: []}, style="megatron")
    with pytest.raises(ValueError, match="0..n-1"):
        format_schedule_csv({1: [S("F.s1.m0")]}, style="torch")
    bad = {
        "0F": "torch's F needs a micro-batch index",
        "0RESHARD1": "torch's RESHARD takes no micro-batch index",
        "0X1": "neither our step text nor a torch.distributed.pipelining action",
        "(0F0;1B0)F": "the only torch composite action is OVERLAP_F_B, got 'F'",
        "(0F0;1Q0)OVERLAP_F_B": "cannot parse '1Q0'",
        "0F0;": "cannot parse '0F0;'",
    }
    for cell, why in bad.items():
        with pytest.raises(ValueError, match=r"row 1 of the schedule CSV, column 1: .*" + why):
            parse_schedule_csv(f"0F0\n1F0,{cell}\n")
