"""`make bench` cannot rot: the reduced suite (`bench.py --smoke`) runs and writes every table.

No assertion on any time: the smoke figures mean nothing on a shared machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
SECTIONS = ("efficiency", "overhead", "p2p", "memory", "gpt", "ms", "profile", "planning")
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@pytest.mark.timeout(420)
def test_smoke_bench_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(tmp_path)], capture_output=True,
                              text=True, timeout=400, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"bench --smoke hung:\n{exc.stdout}\n{exc.stderr}") from exc
    assert proc.returncode == 0, f"bench --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    text = (tmp_path / "results.md").read_text()
    for section in SECTIONS:
        assert section in results, f"results.json lacks section {section}"
    assert [r["schedule"] for r in results["efficiency"]] == list(SCHEDULES)
    assert {r["schedule"] for r in results["overhead"]} == {"Schedule1F1B", "ScheduleInterleaved1F1B"}
    assert [r["variant"] for r in results["p2p"]] == ["ours", "ours+overlap_p2p", "torch"]
    assert {(r["schedule"], r["rank"]) for r in results["memory"]} == {
        (s, r) for s in ("Schedule1F1B", "ScheduleInterleaved1F1B") for r in range(4)}
    assert {(r["processes"], r["schedule"]) for r in results["gpt"]} == {
        (n, s) for n in (2, 4) for s in ("Schedule1F1B", "ScheduleInterleaved1F1B")}
    assert len(results["ms"]) == 4
    assert [r["category"] for r in results["profile"]["rows"]][:3] == ["library Python", "metadata", "waits"]
    assert [r["schedule"] for r in results["planning"]["rows"]] == [
        "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleDualPipeV", "ScheduleMPipeTranspose"]
    assert all(r[t]["seconds"] is not None for r in results["planning"]["rows"] for t in ("plain", "batch")
               if r[t].get("error") != "plain only")  # MPipe runs plain only
    assert results["planning"]["rows"][-1]["batch"] == {"seconds": None, "peak_mib": None, "error": "plain only"}
    for title in ("Schedule efficiency", "Runtime overhead", "Exposed P2P", "Peak live activations", "Tiny GPT",
                  "MindSpore", "Profile", "Planning at scale"):
        assert title in text, f"results.md lacks the {title} table"
    for name in SCHEDULES:
        assert f"| {name} |" in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, args, rows", [
    ("saved_pool_cost.py", ["--rounds", "1"], ["| 2 | ", "| 4 | "]),
    ("handover_cost.py", ["--steps", "2", "--m", "4", "--trips", "3"],
     ["| send, receive posted | 0 |", "| wait, data arrived | 1 |", "| ours | ", "| torch | "]),
    ("planning_scale.py", ["--smoke"], ["| Schedule1F1B | 2 | 1 | 4 | ", "| ScheduleDualPipeV | 2 | 2 | 8 | - | ",
                                        "| Schedule1F1B | 2 | 1 | 4 -> 8 | "]),
    ("generate_speed.py", ["--p", "2", "--m", "4", "--rounds", "1"], ["| gpipe | 1 | ", "| interleaved-zb | 4 | ",
                                                                      "| dualpipev | 2 | "]),
    ("tools_scale.py", ["--p", "2", "--v", "2", "--m", "4", "--slow"],
     ["| `simulate --transport batch --no-overlap-p2p` | ", "| `tune, every schedule (default workers)` | "]),
])
def test_on_demand_benchmarks_write_their_tables(tmp_path, script, args, rows):
    out = tmp_path / "table.md"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    text = out.read_text()
    for row in rows:
        assert row in text, f"{script}: no row {row!r} in\n{text}"
