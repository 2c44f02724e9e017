"""ASCII schedule charts."""

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart, infer_stage_to_rank


def test_1f1b_chart_layout():
    chart = ascii_chart(generate_1f1b(4, 8))
    lines = chart.splitlines()
    assert len(lines) == 6
    assert lines[0].startswith("time   |0 ")
    assert lines[1].startswith("rank 0 |F0 F1 F2 F3 .. .. .. .. .. .. B0--- F4 B1---")
    assert lines[4].startswith("rank 3 |.. .. .. F0 B0--- F1 B1---")
    assert lines[-1] == "makespan 33, bubble 27.3%, peak activations r0=4 r1=3 r2=2 r3=1"
    assert max(len(line) for line in lines) <= 200


def test_chart_of_two_rank_gpipe_by_hand():
    schedule = {
        0: [MetaStep.from_str(t) for t in "F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1".split()],
        1: [MetaStep.from_str(t) for t in "F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1".split()],
    }
    chart = ascii_chart(schedule, costs={MetaStepType.FWD: 1.0, MetaStepType.BWD: 1.0})
    assert chart.splitlines()[1:] == [
        "rank 0 |F0 F1 .. .. B0 B1",
        "rank 1 |.. F0 F1 B0 B1 ..",
        "makespan 6, bubble 33.3%, peak activations r0=2 r1=2",
    ]


def test_multi_chunk_labels_and_result_input():
    placement = looped_placement(2, 2)
    result = simulate(generate_interleaved_1f1b(2, 2, 2), placement)
    chart = ascii_chart(result)
    assert "rank 0 |F0.0 F1.0 F0.1 F1.1" in chart
    assert "B1.1" in chart and "B0.0" in chart
    assert chart == ascii_chart(generate_interleaved_1f1b(2, 2, 2), placement)


def test_infer_stage_to_rank():
    assert infer_stage_to_rank(generate_interleaved_1f1b(2, 2, 2)) == looped_placement(2, 2)
    clash = {0: [MetaStep.from_str("F.s0.m0")], 1: [MetaStep.from_str("B.s0.m0")]}
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        infer_stage_to_rank(clash)


def _interleaved_result():
    from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule

    return simulate_schedule(available_schedules()["interleaved-1f1b"], 4, 2, 8)[1]


def test_wide_chart_wraps_within_the_width():
    result = _interleaved_result()
    full = ascii_chart(result, mode="full")
    assert max(len(line) for line in full.splitlines()) > 200
    wrapped = ascii_chart(result, width=120)
    lines = wrapped.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert sum(line.startswith("time") for line in lines) == 3  # three blocks
    assert lines[1].startswith("rank 0 |F0.0 F1.0 F2.0 F3.0 F0.1")
    assert lines[-1] == "makespan 28.5, bubble 15.8%, peak activations r0=11 r1=9 r2=7 r3=5"
    # the blocks put together give back the full rows
    full_rows = {ln[:6]: ln[8:] for ln in full.splitlines() if ln.startswith("rank")}
    pieces: dict[str, str] = {}
    for ln in lines:
        if ln.startswith("rank"):
            pieces[ln[:6]] = pieces.get(ln[:6], "") + ln[8:].ljust(110)
    assert all(pieces[k].rstrip().startswith(v.rstrip()[:100]) for k, v in full_rows.items())


def test_compact_chart_one_character_per_slot():
    result = _interleaved_result()
    chart = ascii_chart(result, mode="compact", width=80)
    rows = [ln for ln in chart.splitlines() if ln.startswith("rank")]
    assert len(rows) == 4 and max(len(ln) for ln in chart.splitlines() if not ln.startswith("one")) <= 80
    # slot 0.5 ms = one forward of a chunk; a backward takes two slots
    assert rows[3].startswith("rank 3 |...FFFFFBbFBb")
    assert "one column = 0.5 ms" in chart
    squeezed = ascii_chart(result, mode="compact", width=40)
    assert "each column shows what filled most of it" in squeezed
    assert max(len(ln) for ln in squeezed.splitlines() if ln.startswith(("rank", "time"))) <= 40


def test_bad_mode():
    with pytest.raises(ValueError, match="unknown chart mode 'wide'"):
        ascii_chart(_interleaved_result(), mode="wide")


def test_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    from hyper_parallel.core.pipeline_parallel.tools.visualize import plot_timelines

    result = _interleaved_result()
    plot_timelines(tmp_path / "a.png", [("plan", result.records, "ms"), ("run", result.records, "ms")])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_timelines(tmp_path / "a.svg", [("plan", result.records, "ms")])
    assert b"<svg" in (tmp_path / "a.svg").read_bytes()[:500]
    with pytest.raises(ValueError, match="use a .png or .svg name"):
        plot_timelines(tmp_path / "a.gif", [("plan", result.records, "ms")])


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import sys

    from hyper_parallel.core.pipeline_parallel.tools.visualize import plot_timelines

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'hyper-parallel\[viz\]'"):
        plot_timelines(tmp_path / "a.png", [("plan", _interleaved_result().records, "ms")])
