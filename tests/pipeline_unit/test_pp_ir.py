"""MetaStep text form, CSV files and data-flow helpers."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType, consumes, message_key, produces
from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import (
    format_schedule_csv,
    load_schedule_csv,
    parse_cell,
    parse_schedule_csv,
    save_schedule_csv,
)

T = MetaStepType
S = MetaStep.from_str

indices = st.one_of(st.none(), st.integers(min_value=0, max_value=10_000))
plain_steps = st.builds(MetaStep, indices, st.sampled_from(list(T)), indices)
steps = st.recursive(
    plain_steps,
    lambda children: st.builds(
        MetaStep, indices, st.sampled_from(list(T)), indices, st.lists(children, max_size=3)
    ),
    max_leaves=8,
)


def test_codes_are_unique_and_documented_ones_match():
    codes = [t.code for t in T]
    assert len(set(codes)) == len(codes) == 26
    assert (T.FWD.code, T.BWD.code, T.BWD_INPUT.code, T.BWD_WEIGHT.code) == ("F", "B", "I", "W")
    assert (T.FWD_SEND.code, T.FWD_RECV.code) == ("SEND_F", "RECV_F")
    assert (T.BWD_SEND.code, T.BWD_RECV.code) == ("SEND_B", "RECV_B")
    assert (T.META_SEND.code, T.META_RECV.code) == ("SEND_META", "RECV_META")
    assert T.BATCH_SEND_RECV.code == "BATCH"
    assert T.OVERLAP_B_F.code == "OVERLAP_B_F"
    assert (T.PRE_FWD.code, T.PRE_BWD.code, T.PRE_SEND.code, T.PRE_RECV.code, T.PRE_GRAD_SEND.code,
            T.PRE_GRAD_RECV.code) == ("PF", "PB", "SEND_P", "RECV_P", "SEND_PG", "RECV_PG")


def test_compute_and_comm_properties():
    compute = {t for t in T if t.is_compute}
    comm = {t for t in T if t.is_comm}
    assert compute == {T.FWD, T.BWD, T.BWD_INPUT, T.BWD_WEIGHT, T.OVERLAP_B_F, T.OVERLAP_F_B}
    assert comm == {
        T.FWD_SEND, T.FWD_RECV, T.BWD_SEND, T.BWD_RECV, T.META_SEND, T.META_RECV, T.BATCH_SEND_RECV,
    }
    assert {t for t in T if t.is_meta} == {T.META_SEND, T.META_RECV}
    assert not compute & comm
    assert not (T.FSDP_UNSHARD.is_compute or T.FSDP_UNSHARD.is_comm)


@pytest.mark.parametrize("kind", list(T))
@pytest.mark.parametrize("micro", [None, 0, 7])
@pytest.mark.parametrize("stage", [None, 0, 12])
def test_round_trip_every_type(kind, micro, stage):
    step = MetaStep(micro, kind, stage)
    assert MetaStep.from_str(str(step)) == step


@pytest.mark.parametrize(
    ("step", "text"),
    [
        (MetaStep(1, T.FWD, 0), "F.s0.m1"),
        (MetaStep(3, T.BWD_RECV, 2), "RECV_B.s2.m3"),
        (MetaStep(None, T.FSDP_UNSHARD, 0), "FSDP_UNSHARD.s0"),
        (MetaStep(None, T.BATCH_SEND_RECV, None, [S("SEND_F.s0.m1"), S("RECV_B.s0.m0")]),
         "BATCH[SEND_F.s0.m1+RECV_B.s0.m0]"),
        (MetaStep(None, T.OVERLAP_B_F, None, [S("B.s1.m0"), S("F.s1.m2")]),
         "OVERLAP_B_F[B.s1.m0+F.s1.m2]"),
        (MetaStep(None, T.BATCH_SEND_RECV, None, []), "BATCH[]"),
        (MetaStep(2, T.OVERLAP_F_B, 1, [S("F.s1.m2")]), "OVERLAP_F_B[F.s1.m2].s1.m2"),
    ],
)
def test_text_form(step, text):
    assert str(step) == text
    assert MetaStep.from_str(text) == step


def test_nested_composite_round_trip():
    inner = MetaStep(None, T.BATCH_SEND_RECV, None, [S("SEND_F.s0.m1"), S("RECV_B.s0.m0")])
    outer = MetaStep(4, T.OVERLAP_F_B, 3, [inner, S("W.s3.m1"), MetaStep(None, T.BATCH_SEND_RECV, None, [])])
    assert MetaStep.from_str(str(outer)) == outer


@settings(max_examples=60, deadline=None)
@given(steps)
def test_round_trip_random_steps(step):
    text = str(step)
    assert "," not in text and " " not in text
    assert MetaStep.from_str(text) == step


def test_value_semantics_and_list_sub_steps():
    a = MetaStep(None, T.BATCH_SEND_RECV, None, [S("SEND_F.s0.m0")])
    b = MetaStep(None, T.BATCH_SEND_RECV, None, (S("SEND_F.s0.m0"),))
    assert a == b and hash(a) == hash(b) and isinstance(a.sub_steps, tuple)
    assert len({a, b, S("F.s0.m0"), S("F.s0.m0")}) == 2
    assert MetaStep(None, T.BATCH_SEND_RECV, None, []) != MetaStep(None, T.BATCH_SEND_RECV, None)
    assert repr(S("F.s0.m1")) == "<MetaStep F.s0.m1>"


@pytest.mark.parametrize(
    "args, message",
    [((True, T.FWD, 0), "micro_index must be an int or None, got True"),
     ((0, T.FWD, 1.0), "stage_index must be an int or None, got 1.0"),
     ((0, "F", 0), "meta_type must be a MetaStepType, got 'F'"),
     ((0, T.FWD, 0, ["F.s0.m0"]), "sub_steps must hold MetaSteps, got 'F.s0.m0'")],
)
def test_constructor_rejects_bad_fields(args, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        MetaStep(*args)


@pytest.mark.parametrize(
    "args, message",
    [((True, T.FWD, 0), "micro_index must be an int or None, got True"),
     (("x", T.FWD, 0), "micro_index must be an int or None, got 'x'"),
     ((0, T.FWD, 1.5), "stage_index must be an int or None, got 1.5"),
     ((0, "F", 0), "meta_type must be a MetaStepType, got 'F'"),
     ((0, T.FWD, 0, ["F.s0.m0"]), "sub_steps must hold MetaSteps, got 'F.s0.m0'")],
)
def test_a_dataclass_subclass_is_checked_too(args, message):
    """Review finding: MetaStep checks in a written-out __init__ (millions are made), which the
    __init__ a dataclass subclass generates replaces; the subclass's calls __post_init__, which must
    still check the fields and make the sub-steps a tuple (hashable)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, repr=False)
    class Tagged(MetaStep):
        tag: str = ""

    with pytest.raises(TypeError, match=re.escape(message)):
        Tagged(*args)
    batch = Tagged(None, T.BATCH_SEND_RECV, None, [S("SEND_F.s0.m0")], tag="t")
    assert isinstance(batch.sub_steps, tuple) and hash(batch) == hash(dataclasses.replace(batch))

    @dataclasses.dataclass(frozen=True, repr=False)
    class Extended(MetaStep):
        def __post_init__(self) -> None:
            super().__post_init__()

    assert str(Extended(0, T.FWD, 1)) == "F.s1.m0"


@pytest.mark.parametrize(
    "text",
    ["", "X.s0.m0", "F.s0.m", "F.m0.s0", "F.s0.m0.", "F s0", "f.s0.m0", "BATCH[F.s0.m0",
     "BATCH[F.s0.m0+]", "BATCH]", "F.s0.m0x", "BATCH[F.s0.m0,B.s0.m0]", "0F0", "F.sx"],
)
def test_bad_text_raises_value_error_quoting_it(text):
    with pytest.raises(ValueError, match="cannot parse") as info:
        MetaStep.from_str(text)
    assert repr(text) in str(info.value)


def test_from_str_ignores_outer_whitespace():
    assert MetaStep.from_str("  F.s0.m1 \n") == MetaStep(1, T.FWD, 0)


# --- CSV --------------------------------------------------------------------------------------


def test_csv_round_trip_with_idle_and_composites(tmp_path):
    schedule = {
        0: [S("F.s0.m0"), None, S("BATCH[SEND_F.s0.m0+RECV_B.s0.m0]"), S("B.s0.m0"), None],
        1: [],
        2: [None],
        3: [S("OVERLAP_B_F[B.s3.m0+F.s3.m1]"), S("FSDP_RESHARD.s3")],
    }
    text = format_schedule_csv(schedule)
    assert text.splitlines()[0] == "F.s0.m0,,BATCH[SEND_F.s0.m0+RECV_B.s0.m0],B.s0.m0,"
    assert parse_schedule_csv(text) == schedule
    path = tmp_path / "schedule.csv"
    save_schedule_csv(path, schedule)
    assert load_schedule_csv(path) == schedule


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), steps), max_size=6), min_size=1, max_size=4))
def test_csv_round_trip_random(rows):
    schedule = dict(enumerate(rows))
    assert parse_schedule_csv(format_schedule_csv(schedule)) == schedule


def test_csv_needs_ranks_zero_to_n():
    with pytest.raises(ValueError, match="0..n-1"):
        format_schedule_csv({1: [S("F.s1.m0")]})


def test_parse_torch_style_cells():
    text = "0F0,0F1,,0B0,0B1\n1F0,1I0,1W0,1B1,\n"
    assert parse_schedule_csv(text) == {
        0: [S("F.s0.m0"), S("F.s0.m1"), None, S("B.s0.m0"), S("B.s0.m1")],
        1: [S("F.s1.m0"), S("I.s1.m0"), S("W.s1.m0"), S("B.s1.m1"), None],
    }
    assert parse_cell("2I1") == MetaStep(1, T.BWD_INPUT, 2)
    assert parse_cell("12W3") == MetaStep(3, T.BWD_WEIGHT, 12)
    assert parse_cell("1SEND_F3") == S("SEND_F.s1.m3")
    assert parse_cell(" ") is None


def test_bad_csv_cell_names_row_and_text():
    with pytest.raises(ValueError, match=r"row 1 .*'0Q0'"):
        parse_schedule_csv("0F0\n0Q0\n")


# --- data flow --------------------------------------------------------------------------------


def test_consumes_and_produces():
    assert consumes(S("F.s0.m1"), 4) == []
    assert consumes(S("F.s2.m1"), 4) == [("F", 1, 1)]
    assert consumes(S("B.s3.m1"), 4) == [("F", 3, 1)]
    assert consumes(S("I.s1.m1"), 4) == [("F", 1, 1), ("G", 2, 1)]
    assert consumes(S("W.s1.m1"), 4) == [("G", 1, 1)]
    assert produces(S("B.s1.m0")) == [("G", 1, 0), ("W", 1, 0)]
    assert produces(S("I.s1.m0")) == [("G", 1, 0)]
    assert produces(S("FSDP_UNSHARD.s1")) == []


def test_message_keys_pair_sends_with_recvs():
    assert message_key(S("SEND_F.s1.m2")) == message_key(S("RECV_F.s2.m2")) == ("F", 1, 2)
    assert message_key(S("SEND_B.s2.m2")) == message_key(S("RECV_B.s1.m2")) == ("G", 2, 2)
    assert message_key(S("F.s0.m0")) is None
    assert S("BATCH[SEND_F.s0.m0+RECV_B.s0.m0]").comm_parts == (S("SEND_F.s0.m0"), S("RECV_B.s0.m0"))
    assert S("OVERLAP_B_F[B.s1.m0+F.s1.m2]").parts == (S("B.s1.m0"), S("F.s1.m2"))
