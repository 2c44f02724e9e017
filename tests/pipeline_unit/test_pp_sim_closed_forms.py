"""The timed simulator against the closed forms of every schedule, with uniform costs.

Costs: each rank's share of the model costs F and B (I, W when split), so one of its v chunks
costs F / v and B / v (`CostModel.per_rank_share`). Closed forms (docs/schedules.md):

- GPipe, 1F1B: makespan (m + p - 1)(F + B), bubble (p - 1) / (m + p - 1) on every rank;
  1F1B holds min(m, p - r) forwards on rank r, GPipe m;
- interleaved 1F1B, m a multiple of p: makespan (v m + p - 1)(F + B) / v, bubble
  (p - 1) / (v m + p - 1); otherwise the bubble is at least that;
- looped BFS, m >= p: the same makespan as interleaved, holding v m forwards;
- zero-bubble schedules: bubble time per rank within the papers' bounds (when importable).
"""

from __future__ import annotations

import importlib

import pytest

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule

S = available_schedules()
GRID_P = [1, 2, 3, 4, 6]
GRID_M = [1, 2, 3, 4, 5, 8, 12]


def _sim(name, p, v, m, lowered=False, transport="plain", **costs):
    costs = CostModel.per_rank_share(p, v if name not in ("zbv", "dualpipev") else 2, **costs)
    return simulate_schedule(S[name], p, v, m, costs, lowered=lowered, transport=transport)[1]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", GRID_P)
@pytest.mark.parametrize("m", GRID_M)
def test_gpipe_and_1f1b(name, p, m):
    result = _sim(name, p, 1, m, F=1.0, B=2.0)
    assert result.makespan == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    for r in range(p):
        assert result.bubble_per_rank[r] == pytest.approx((p - 1) / (m + p - 1))
    expected_peak = {r: (m if name == "gpipe" else min(m, p - r)) for r in range(p)}
    assert result.peak_activations == expected_peak


@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (2.0, 3.0), (1.0, 1.0)])
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_1f1b_lowered_equals_closed_form(tf, tb, transport):
    for p, m in [(2, 5), (4, 8), (3, 2)]:
        result = _sim("1f1b", p, 1, m, lowered=True, transport=transport, F=tf, B=tb)
        assert result.makespan == pytest.approx((m + p - 1) * (tf + tb))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_interleaved_full_rounds(p, v, k):
    m = k * p
    result = _sim("interleaved-1f1b", p, v, m, F=1.0, B=2.0)
    assert result.makespan == pytest.approx((v * m + p - 1) * 3.0 / v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    # Megatron's warm-up (v - 1) p + 2 (p - 1 - r) forwards, plus the one of the first 1F1B pair
    assert result.peak_activations == {r: min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)}


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4) for m in (1, 3, 5, 7) if m % p])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_partial_rounds_are_at_least_the_formula(p, v, m):
    result = _sim("interleaved-1f1b", p, v, m, F=1.0, B=2.0)
    assert result.bubble_fraction >= (p - 1) / (v * m + p - 1) - 1e-12
    assert result.makespan >= (v * m + p - 1) * 3.0 / v - 1e-9


def test_interleaved_reads_shorter_than_1f1b_for_the_same_work():
    one = _sim("1f1b", 4, 1, 8)
    two = _sim("interleaved-1f1b", 4, 2, 8)
    assert one.makespan == 33.0 and two.makespan == 28.5
    assert sum(one.busy.values()) == sum(two.busy.values()) == 4 * 8 * 3.0


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", [4, 8])
def test_looped_bfs(p, v, m):
    result = _sim("looped-bfs", p, v, m, F=1.0, B=2.0)
    assert result.makespan == pytest.approx((v * m + p - 1) * 3.0 / v)
    assert result.peak_activations == dict.fromkeys(range(p), v * m)


def test_activation_bytes_follow_the_chunk_size():
    # a rank's share keeps 1 byte per micro-batch: interleaved chunks keep 1/v each
    one = _sim("1f1b", 4, 1, 8, activation_bytes=1.0)
    two = _sim("interleaved-1f1b", 4, 2, 8, activation_bytes=1.0)
    assert one.peak_activation_bytes == {0: 4.0, 1: 3.0, 2: 2.0, 3: 1.0}
    assert two.peak_activation_bytes == {r: two.peak_activations[r] / 2 for r in range(4)}


# ---------------------------------------------------------------------- zero-bubble schedules
# Per-chunk costs f = i = w = 1 (b = i + w = 2), an overlapped pair costing f + b (the "sum"
# rule), plain transport, m a multiple of p (DualPipeV: m >= 2p). Bubble time per rank:
# ZB-H1 over v looped chunks (Qi et al. 2023): (p - 1)(f + i - w) = p - 1, makespan 3 v m + p - 1;
# ZB-V: p - 1 (the ramp of one chunk's forwards), makespan 6 m + p - 1;
# DualPipeV (DeepSeek-V3 report, p devices): (p - 1)(F&B + b - 3 w) = 2 (p - 1), makespan 6 m + 2 (p - 1).


def _zero_bubble(class_name):
    module = importlib.import_module("hyper_parallel.core.pipeline_parallel")
    cls = getattr(module, class_name, None)
    if cls is None:
        pytest.skip(f"{class_name} is not in this version yet")
    return cls


ZB_CASES = [("ScheduleInterleavedZeroBubble", v) for v in (1, 2, 3)] + [("ScheduleZBVZeroBubble", 2),
                                                                        ("ScheduleDualPipeV", 2)]


@pytest.mark.parametrize(("class_name", "v"), ZB_CASES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_zero_bubble_closed_forms(class_name, v, p, k):
    from hyper_parallel.core.pipeline_parallel.tools.catalog import chunk_range

    cls = _zero_bubble(class_name)
    low, high = chunk_range(cls)
    if not low <= v <= high:
        pytest.skip(f"{class_name} does not take {v} chunks per rank")
    m = k * p
    if class_name == "ScheduleDualPipeV":
        m = max(m, 2 * p)
    costs = CostModel.uniform(len(cls.stage_placement(p, v)), F=1.0, I=1.0, W=1.0)
    _, result = simulate_schedule(cls, p, v, m, costs, lowered=True, transport="plain")
    idle = {"ScheduleInterleavedZeroBubble": p - 1, "ScheduleZBVZeroBubble": p - 1,
            "ScheduleDualPipeV": 2 * (p - 1)}[class_name]
    chunks = len(cls.stage_placement(p, v)) // p
    assert result.makespan == pytest.approx(3 * chunks * m + idle)
    for r in range(p):
        assert result.makespan - result.busy[r] == pytest.approx(idle)
