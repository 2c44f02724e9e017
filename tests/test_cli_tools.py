"""Smoke tests of the schedule tools of the ``hyper-parallel`` command (every subcommand)."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import REPO_ROOT

from hyper_parallel.cli import main
from hyper_parallel.core.pipeline_parallel.tools.trace import causality_violations, load_trace

EXAMPLE = os.path.join(REPO_ROOT, "examples", "pipeline_mlp.py")


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_prints_chart_bubbles_and_peaks(capsys):
    code, out, _ = run(capsys, ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8"])
    assert code == 0
    assert out.startswith("Schedule1F1B: 4 ranks x 1 stage(s) per rank, 8 micro-batches")
    assert "rank 3 |.. .. .. F0 B0---" in out
    assert re.search(r"^\s+0\s+24\s+0\.2727\s+27\.27%\s+4\s+4$", out, flags=re.M)
    assert re.search(r"^\s+3\s+24\s+0\.2727\s+27\.27%\s+1\s+1$", out, flags=re.M)
    assert "makespan 33 ms; overall bubble 0.2727 (27.27%)" in out


def test_simulate_json_trace_and_png(capsys, tmp_path):
    trace, png = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    code, out, _ = run(capsys, ["simulate", "--schedule", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "2",
                                "--trace", trace, "--json"] + (["--png", png] if _has_matplotlib() else []))
    assert code == 0
    data = json.loads(out)
    assert data["makespan_ms"] == 28.5 and data["chunks"] == 2
    assert data["bubble_fraction"] == pytest.approx(3 / 19) and data["bubble_percent"] == pytest.approx(300 / 19)
    assert [r["peak_activations"] for r in data["ranks"]] == [11, 9, 7, 5]
    events = json.load(open(trace))["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {f"rank {r}" for r in range(4)}
    if _has_matplotlib():
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_simulate_with_costs_file_and_batch_transport(capsys, tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"p2p": {"latency_ms": 0.5}, "stages": [{"F": 1, "B": 2, "output_bytes": 10}]}))
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "2", "--costs", str(costs), "--json"])
    assert code == 0
    # 1F1B, p = 2, m = 2: the critical path holds 3 steps of F + B and two messages of 0.5 ms
    assert json.loads(out)["makespan_ms"] == pytest.approx(3 * 3 + 2 * 0.5)
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "2", "--costs", str(costs), "--transport", "batch",
                                "--json"])
    # one stream, the lists run() executes by default (receives posted ahead, shapes of the first
    # micro-batch sent first): the shapes cost rank 1 one more message time than eager sends
    assert code == 0 and json.loads(out)["makespan_ms"] == pytest.approx(10.5)
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "2", "--costs", str(costs), "--transport", "batch",
                                "--no-overlap-p2p", "--json"])
    # overlap_p2p=False: rank 1 also receives F.s0.m1 in the group that sends B.s1.m0's gradient,
    # so that forward waits one message time more
    assert code == 0 and json.loads(out)["makespan_ms"] == pytest.approx(11.0)


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_simulate_and_tune_charge_a_costs_files_runtime_on_the_lists_run_executes(capsys, tmp_path, transport):
    """A costs file may carry the runtime's costs (no --machine): simulate then lowers the lists
    run() executes on plain too, as tune --lowered does (review finding: it lowered the cheaper
    lists, whose times are equal only without runtime costs)."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
    from hyper_parallel.core.pipeline_parallel.simulation.costs import load_costs
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate

    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"p2p": {"latency_ms": 0.05}, "stages": [{"F": 1.0, "B": 2.0, "output_bytes": 1e6}],
                                 "runtime": {"send_ms": 0.1, "recv_ms": 0.1, "meta_ms": 0.3, "meta_recv_ms": 0.2,
                                             "batch_ms": 0.1}}))
    placement = Schedule1F1B.stage_placement(4, 1)
    lists = lower(Schedule1F1B.generate(4, 1, 8), placement, transport, prefetch=True, metadata="first")
    expected = simulate(lists, placement, load_costs(costs).for_stages(4),
                        model="stream" if transport == "batch" else "eager").makespan
    code, out, _ = run(capsys, ["simulate", "-p", "4", "-m", "8", "--costs", str(costs), "--transport", transport,
                                "--json"])
    assert code == 0 and json.loads(out)["makespan_ms"] == expected
    code, out, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "1e15", "--global-batch", "8",
                                "-p", "4", "--schedules", "1f1b", "--micro-batches", "8", "--lowered", "--transport",
                                transport, "--json", "--jobs", "1"])
    assert code == 0 and json.loads(out)["best"]["makespan_ms"] == expected


@pytest.mark.parametrize("machine", [False, True])
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("overlap", [True, False])
def test_simulate_lowers_the_lists_run_executes(capsys, tmp_path, machine, transport, overlap):
    """The simulated lists are those of schedule.run(overlap_p2p=...): the chart, the table and the
    trace equal a simulation of `lower`'s lists with run()'s options (receives ahead with
    overlap_p2p, shapes of the first micro-batch), machine file or not."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B
    from hyper_parallel.core.pipeline_parallel.simulation.costs import load_costs
    from hyper_parallel.core.pipeline_parallel.simulation.machine import load_machine
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate

    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"p2p": {"latency_ms": 0.3, "bandwidth_gb_per_s": 1.0},
                                 "stages": [{"F": 1, "B": 2, "output_bytes": 2e5}]}))
    argv = ["simulate", "--schedule", "interleaved-1f1b", "-p", "4", "-v", "2", "-m", "8", "--costs", str(costs),
            "--transport", transport, "--json"] + ([] if overlap else ["--no-overlap-p2p"])
    model = load_costs(costs).for_stages(8)
    if machine:
        path = tmp_path / "m.json"
        path.write_text(json.dumps({"p2p": {"latency_ms": 0.2},
                                    "runtime": {"send_ms": 0.05, "recv_ms": 0.04, "meta_ms": 0.1,
                                                "meta_recv_ms": 0.4, "batch_ms": 0.07}}))
        argv += ["--machine", str(path)]
        model = load_machine(path).apply(model)
    code, out, _ = run(capsys, argv)
    assert code == 0
    cls, placement = ScheduleInterleaved1F1B, ScheduleInterleaved1F1B.stage_placement(4, 2)
    lists = lower(cls.generate(4, 2, 8), placement, transport, prefetch=overlap, metadata="first")
    expected = simulate(lists, placement, model, model="stream" if transport == "batch" else "eager")
    assert json.loads(out)["makespan_ms"] == expected.makespan
    assert [r["busy_ms"] for r in json.loads(out)["ranks"]] == [expected.busy[r] for r in range(4)]


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--schedule", "nope"], "argument --schedule: unknown schedule 'nope'"),
    (["simulate", "--schedule", "1f1b", "-v", "2"], "argument -v/--chunks: 1f1b runs 1..1 chunks per rank, got 2"),
    (["simulate", "--costs", "/nonexistent.json"], "argument --costs:"),
    (["simulate", "--compute-only", "--no-overlap-p2p"],
     "argument --no-overlap-p2p: not allowed with --compute-only (it chooses lowered lists)"),
    (["tune", "--costs", "c.json", "--memory-limit", "1GB", "--global-batch", "8", "-p", "2", "--no-overlap-p2p"],
     "argument --no-overlap-p2p: needs --lowered or --machine (it chooses lowered lists)"),
    (["tune", "--costs", "c.json", "--memory-limit", "lots", "--global-batch", "8", "-p", "2"],
     "argument --memory-limit: must be a byte count"),
    (["partition", "-p", "2"], "give exactly one of --costs and --layer-costs"),
    (["visualize", "/nonexistent.json"], "argument TRACE:"),
    (["tune", "--costs", "c.json", "--memory-limit", "1GB", "--global-batch", "8", "-p", "2", "--state-factor=-1"],
     "argument --state-factor: must be a finite number >= 0, got '-1'"),
    (["tune", "--costs", "c.json", "--memory-limit", "1GB", "--global-batch", "8", "-p", "2", "--state-factor", "nan"],
     "argument --state-factor: must be a finite number >= 0, got 'nan'"),
    (["profile", "s.py", "--max-spread", "inf"], "argument --max-spread: must be a finite number > 0, got 'inf'"),
    (["tune", "--costs", "c.json", "--memory-limit", "1GB", "--global-batch", "8", "-p", "2", "--jobs", "0"],
     "argument --jobs:"),
])
def test_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "visualize", "profile", "tune", "partition", "dryrun"])
def test_help_shows_defaults(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hyper-parallel {command}")
    assert "(default: None)" not in out
    if command != "visualize":
        assert "(default:" in out
    if command not in ("partition",):
        assert "--json" in out


def test_visualize_a_plan_and_a_measured_trace(capsys, tmp_path):
    plan = str(tmp_path / "plan.json")
    assert main(["simulate", "-p", "2", "-m", "2", "--trace", plan, "--json"]) == 0
    capsys.readouterr()
    measured = tmp_path / "run.json"
    records = [{"rank": 0, "step": "F.s0.m0", "kind": "compute", "start": 0.0, "end": 0.002},
               {"rank": 1, "step": "F.s1.m0", "kind": "compute", "start": 0.002, "end": 0.004}]
    measured.write_text(json.dumps({"format": "hyper-parallel-trace/1", "unit": "s", "records": records}))
    code, out, _ = run(capsys, ["visualize", str(measured), "--plan", plan, "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["plan"]["makespan_ms"] == pytest.approx(9.0)
    assert data["trace"]["makespan_ms"] == pytest.approx(4.0)
    assert data["compare"]["order_mismatch"]["0"]["planned"] == "F.s0.m1"
    code, out, _ = run(capsys, ["visualize", plan])
    assert code == 0 and "rank 1 |" in out and "makespan 9 ms" in out


def test_partition(capsys):
    code, out, _ = run(capsys, ["partition", "--layer-costs", "4,1,1,1,1", "-p", "2", "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["ranges"] == [[0, 1], [1, 5]] and data["bottleneck"] == 4.0 and data["optimal"]
    code, out, _ = run(capsys, ["partition", "--layer-costs", "6,1,1,1,1,1,1,6", "-p", "2", "-v", "2",
                                "--placement", "v"])
    assert code == 0 and "busiest rank 12" in out  # rank 0 holds both 6s (first and last stage)


def test_tune_prints_a_table_and_json(capsys, tmp_path):
    costs = tmp_path / "c.json"
    layer = {"F": 1, "B": 2, "activation_bytes": 100, "param_bytes": 10, "overhead_ms": 0.25}
    costs.write_text(json.dumps({"micro_batch_size": 2, "layers": [layer] * 8}))
    code, out, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "500", "--global-batch", "16",
                                "-p", "4", "--schedules", "1f1b,interleaved-1f1b,gpipe", "--chunks", "1,2"])
    assert code == 0
    assert "choice: 1f1b with 1 chunk(s) per rank and 16 micro-batches of 1" in out
    assert re.search(r"^\* 1f1b\s+1\s+16\s+1\s", out, flags=re.M)
    code, out, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "1GiB", "--global-batch", "16",
                                "-p", "4", "--json"])
    data = json.loads(out)
    assert code == 0 and data["best"]["fits"] and len(data["candidates"]) > 10
    for jobs in ("1", "2"):  # in one process and in two workers: the same table
        code, alone, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "1GiB", "--global-batch", "16",
                                      "-p", "4", "--json", "--jobs", jobs])
        assert code == 0 and json.loads(alone) == data
    code, out, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "10", "--global-batch", "16",
                                "-p", "4"])
    assert code == 1 and "nothing fits" in out
    order = tmp_path / "order.csv"
    code, out, _ = run(capsys, ["tune", "--costs", str(costs), "--memory-limit", "1000", "--global-batch", "16",
                                "-p", "4", "--schedules", "1f1b", "--search", "--save-order", str(order)])
    assert code == 0 and "choice: search-" in out
    from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import load_schedule_csv

    assert sorted(load_schedule_csv(order)) == [0, 1, 2, 3]


@pytest.mark.timeout(200)
def test_profile_writes_a_costs_file(capsys, tmp_path):
    out_file = str(tmp_path / "costs.json")
    code, out, _ = run(capsys, ["profile", EXAMPLE, "--stages", "2", "--repeats", "1", "--warmup", "0",
                                "-o", out_file, "--as-layers"])
    assert code == 0, out
    data = json.load(open(out_file))
    assert len(data["stages"]) == len(data["layers"]) == 2
    for stage in data["stages"]:
        assert stage["F"] > 0 and stage["B"] > 0 and stage["param_bytes"] == 2 * (64 * 64 + 64) * 4
    assert data["stages"][0]["output_bytes"] == 8 * 64 * 4 and data["micro_batch_size"] == 8
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "4", "--costs", out_file, "--json"])
    assert code == 0 and json.loads(out)["makespan_ms"] > 0


@pytest.mark.timeout(200)
def test_profile_says_what_it_measured_with_and_how_far_to_trust_it(capsys, tmp_path):
    import torch

    before = torch.get_num_threads()
    out_file = str(tmp_path / "costs.json")
    code, out, _ = run(capsys, ["profile", EXAMPLE, "--stages", "3", "--repeats", "2", "--no-overhead",
                                "-o", out_file])
    assert code == 0, out
    assert ", 1 CPU thread(s) (median of 2 after 1 warm-up round(s))" in out.splitlines()[0]
    assert out.splitlines()[1].split()[9] == "spread"  # stage, F ms, B ms, I ms, W ms, spread
    assert "relative to the median (warned above 25%)" in out
    code, out, _ = run(capsys, ["profile", EXAMPLE, "--stages", "3", "--repeats", "2", "--no-overhead",
                                "--threads", "2", "--max-spread", "0.5", "-o", out_file, "--json"])
    data = json.loads(out)
    assert (data["threads"], data["repeats"], data["max_spread"]) == (2, 2, 0.5)
    assert len(data["spread"]) == 3 and isinstance(data["warnings"], list)
    assert torch.get_num_threads() == before  # restored after the measurement
    for bad, why in (("--threads", "0"), ("--max-spread", "0"), ("--max-spread", "x")):
        with pytest.raises(SystemExit) as info:
            main(["profile", EXAMPLE, bad, why])
        assert info.value.code == 2 and f"argument {bad}: must be" in capsys.readouterr().err


@pytest.mark.timeout(200)
def test_dryrun_reports_boundaries_memory_and_schedule(capsys, tmp_path):
    trace = str(tmp_path / "dry.json")
    code, out, _ = run(capsys, ["dryrun", EXAMPLE, "--ranks", "2", "--trace", trace, "--json", "--",
                                "--micro-batches", "4", "--steps", "1"])
    assert code == 0, out
    data = json.loads(out[out.index("{"):])
    assert {"src": 0, "dst": 1, "dtype": "float32", "shape": [2, 64], "count": 4, "bytes": 512} in data["boundaries"]
    assert {"src": 1, "dst": 0, "dtype": "float32", "shape": [2, 64], "count": 4, "bytes": 512} in data["boundaries"]
    assert [r["peak_forwards_held"] for r in data["ranks"]] == [2, 1]
    assert data["ranks"][0]["peak_activation_bytes"] > 0
    assert data["check"]["status"] == "ok" and data["check"]["class"] == "Schedule1F1B"
    assert data["check"]["simulated"]["makespan_ms"] == 15.0
    assert json.load(open(trace))["traceEvents"]


@pytest.mark.parametrize(("schedule", "makespan", "peak"), [
    # p = 4, m = 8, two chunks per rank (F = I = W = 0.5 ms per chunk): ZB-H1 and ZB-V idle p - 1
    # chunk units, (3 v m + p - 1) / 2 = (6 m + p - 1) / 2 ms; DualPipeV 2 (p - 1), (6 m + 2 (p - 1)) / 2 ms
    ("interleaved-zb", 25.5, 8), ("zbv", 25.5, 8), ("dualpipev", 27.0, 9),
])
def test_simulate_zero_bubble_schedules(capsys, schedule, makespan, peak):
    code, out, _ = run(capsys, ["simulate", "--schedule", schedule, "-p", "4", "-m", "8", "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["schedule"] == schedule and data["chunks"] == 2
    assert data["makespan_ms"] == pytest.approx(makespan)
    assert [r["peak_activations"] for r in data["ranks"]] == [peak] * 4


def _costs_file(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"F": 1, "B": 2, "activation_bytes": 10, "param_bytes": 10}]}))
    return str(costs)


# every file a subcommand writes: (argv before the path, the option, argv after it)
OUTPUTS = [
    (["simulate", "-p", "2", "-m", "2"], "--trace", []),
    (["simulate", "-p", "2", "-m", "2"], "--png", []),
    (["visualize", "TRACE"], "--png", []),
    (["profile", EXAMPLE, "--stages", "2"], "-o", []),
    (["tune", "--costs", "COSTS", "--memory-limit", "1GB", "--global-batch", "4", "-p", "2", "--search"],
     "--save-order", []),
    (["dryrun", EXAMPLE, "--ranks", "2"], "--trace", ["--", "--steps", "1"]),
]


def _unwritable(tmp_path):
    """Paths no file can be written at: a missing folder, a folder inside a regular file, a folder
    itself, and a folder without write permission (/sys when running as root, where permissions
    do not bind)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    folder = tmp_path / "a_folder.png"
    folder.mkdir()
    paths = [(str(tmp_path / "missing" / "out.png"), "does not exist"), (str(blocker / "out.png"), "is not a folder"),
             (str(folder), "it is a folder")]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(str(locked), os.W_OK):
        locked = "/sys" if os.path.isdir("/sys") else None
    if locked is not None:
        paths.append((os.path.join(str(locked), "out.png"), "is not writable"))
    return paths


@pytest.mark.parametrize(("before", "option", "after"), OUTPUTS, ids=[f"{b[0]}{o}" for b, o, _ in OUTPUTS])
def test_an_output_path_that_cannot_be_written_is_a_usage_error_before_any_work(capsys, tmp_path, before, option,
                                                                                 after):
    trace = tmp_path / "plan.json"
    trace.write_text(json.dumps([{"rank": 0, "step": "F.s0.m0", "kind": "compute", "start": 0, "end": 1}]))
    before = [{"TRACE": str(trace), "COSTS": _costs_file(tmp_path)}.get(a, a) for a in before]
    for path, why in _unwritable(tmp_path):
        with pytest.raises(SystemExit) as info:
            main([*before, option, path, *after])
        out, err = capsys.readouterr()
        assert info.value.code == 2 and out == "", (path, out, err)  # nothing ran, nothing printed
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(f"hyper-parallel {before[0]}: error: argument "), err
        assert option in errors[0] and (why in errors[0] or "matplotlib" in errors[0]), err


@pytest.mark.parametrize("name", ["new.json/", "x" * 300 + ".json", "missing/../new.json"],
                         ids=["trailing-slash", "name-too-long", "through-a-missing-folder"])
def test_an_output_name_no_file_can_have_is_a_usage_error_before_any_work(capsys, tmp_path, name):
    # the folder exists and is writable, but no file can be created under this very name
    for argv in (["simulate", "-p", "2", "-m", "2", "--trace"],
                 ["tune", "--costs", _costs_file(tmp_path), "--memory-limit", "1GB", "--global-batch", "4", "-p",
                  "2", "--search", "--save-order"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, f"{tmp_path}{os.sep}{name}"])  # not tmp_path / name: pathlib drops a trailing slash
        out, err = capsys.readouterr()
        assert info.value.code == 2 and out == "" and "Traceback" not in err, err
        assert f"error: argument {argv[-1]}: cannot write" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json"]  # the check leaves nothing behind


def test_an_output_path_may_be_a_link_to_a_file_not_written_yet(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    link, broken = tmp_path / "trace.json", tmp_path / "broken.json"
    link.symlink_to(tmp_path / "out" / "trace.json")
    broken.symlink_to(tmp_path / "missing" / "trace.json")
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "2", "--trace", str(link)])
    assert code == 0 and (tmp_path / "out" / "trace.json").is_file()
    with pytest.raises(SystemExit) as info:
        main(["simulate", "-p", "2", "-m", "2", "--trace", str(broken)])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_an_output_path_with_a_quoted_tilde_is_written_in_the_home_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, err = run(capsys, ["simulate", "-p", "2", "-m", "2", "--trace", "~/trace.json"])
    assert code == 0 and "Traceback" not in err, err
    assert (tmp_path / "trace.json").is_file() and f"wrote {tmp_path / 'trace.json'}" in out


def test_a_picture_path_needs_a_known_extension(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--png", str(tmp_path / "chart.gif")])
    assert info.value.code == 2
    assert "argument --png: cannot tell the picture format of" in capsys.readouterr().err


BAD_COSTS = [
    ({"stages": [{"F": 1}], "p2p": 5}, "p2p must be an object"),
    ({"stages": [{"F": 1}], "p2p": {"latency_ms": -3}}, "p2p.latency_ms must be a finite number >= 0, got -3"),
    ({"stages": [{"F": 1}], "p2p": {"latency_ms": "fast"}}, "p2p.latency_ms must be a finite number >= 0, got 'fast'"),
    ({"stages": [{"F": 1}], "p2p": {"bandwidth_gb_per_s": 0}},
     "p2p.bandwidth_gb_per_s must be > 0 (leave it out for an infinitely fast link), got 0"),
    ({"stages": 5}, "stages must be a list of objects, got 5"),
    ({"layers": {"F": 1}}, "layers must be a list of objects"),
    ({"stages": [{"F": -1}]}, "stages[0]: F must be a finite number >= 0, got -1"),
    ({"stages": [{"F": 1, "B": "slow"}]}, "stages[0]: B must be a finite number >= 0, got 'slow'"),
    ({"stages": [{"F": 1, "activation_bytes": -5}]}, "stages[0]: activation_bytes must be a finite number >= 0"),
    ({"stages": [{"F": 1}, {"F": 1}, {"F": 1}]}, "cannot describe 2 stages"),
]


@pytest.mark.parametrize("command", ["simulate", "tune", "partition"])
def test_a_bad_costs_file_is_one_error_line_naming_the_file_and_field(capsys, tmp_path, command):
    cases = [(json.dumps(data), why) for data, why in BAD_COSTS]
    cases += [('{"stages": [{"F": 1', "not JSON"), ("\xff\xfe", "not a UTF-8 text file"), (None, "No such file")]
    argv = {"simulate": ["simulate", "-p", "2", "-m", "2"],
            "tune": ["tune", "--memory-limit", "1GB", "--global-batch", "4", "-p", "2"],
            "partition": ["partition", "-p", "2"]}[command]
    for k, (text, why) in enumerate(cases):
        if command != "simulate" and "cannot describe" in why:
            continue  # tune and partition regroup whatever entries there are
        path = tmp_path / f"costs{k}.json"
        if text is not None:
            path.write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
        with pytest.raises(SystemExit) as info:
            main([*argv, "--costs", str(path)])
        out, err = capsys.readouterr()
        assert info.value.code == 2 and out == "" and "Traceback" not in err, (text, err)
        (line,) = [line for line in err.splitlines() if "error:" in line]
        assert "argument --costs: " in line and str(path.name) in line and why in line, (text, line)


BAD_TRACES = [
    ({"records": 5}, "records must be a list, got 5"),
    ({"records": [5]}, "record 0 of part 0 must be a dict"),
    ({"traceEvents": [{"ph": "X"}]}, "traceEvents[0]: a complete event ('X') needs numbers pid, ts"),
    ({"records": [{"rank": 0, "step": "Q.s0", "kind": "compute", "start": 0, "end": 1}]},
     "record 0: cannot parse 'Q.s0' as a MetaStep"),
    ({"records": [{"rank": 0, "step": "F.s0.m0", "kind": "compute", "start": "0", "end": 1}]},
     "start must be a number"),
]


@pytest.mark.parametrize(("data", "why"), BAD_TRACES)
def test_a_bad_trace_file_is_one_error_line_naming_the_file(capsys, tmp_path, data, why):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    for argv, option in ((["visualize", str(path)], "TRACE"), (["simulate", "--measured", str(path)], "--measured")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        out, err = capsys.readouterr()
        assert info.value.code == 2 and out == "" and "Traceback" not in err, err
        (line,) = [line for line in err.splitlines() if "error:" in line]
        assert f"argument {option}: {path}: " in line and why in line, line


@pytest.mark.parametrize("other", ["a string", [1, 2], 5, None])
def test_a_chrome_trace_with_a_foreign_other_data_still_loads(capsys, tmp_path, other):
    # otherData is free-form for other tools; only its hyper_parallel entry is ours to check
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "ts": 0, "dur": 1000, "name": "F.s0.m0"}],
                                "otherData": other}))
    code, out, err = run(capsys, ["visualize", str(path), "--json"])
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["trace"]["makespan_ms"] == pytest.approx(1.0)


def test_a_malformed_hyper_parallel_entry_of_other_data_is_one_error_line(capsys, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "ts": 0, "dur": 1000, "name": "F.s0.m0"}],
                                "otherData": {"hyper_parallel": {"": {"peak_activations": {"zero": 1}}}}}))
    with pytest.raises(SystemExit) as info:
        main(["visualize", str(path)])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert f"argument TRACE: {path}: " in line and "peak_activations" in line, line


def test_visualize_loads_a_compute_only_simulate_trace(capsys, tmp_path):
    # without lowering, a wait names what it waits for ("B.s3.m0 or I.s3.m0"), not a step: only the
    # compute records' steps must parse
    path = str(tmp_path / "plan.json")
    code, out, _ = run(capsys, ["simulate", "--schedule", "interleaved-1f1b", "-p", "2", "-m", "4", "-v", "2",
                                "--compute-only", "--json", "--trace", path])
    assert code == 0
    planned = [r["peak_activations"] for r in json.loads(out)["ranks"]]
    assert any(" or " in r["step"] for r in load_trace(path)[""])
    code, out, err = run(capsys, ["visualize", path, "--json"])
    assert code == 0 and "Traceback" not in err, err
    assert [r["peak_activations"] for r in json.loads(out)["trace"]["ranks"]] == planned
    # no sends in an unlowered plan: every cross-rank consumer is reported (and nothing raises)
    assert all("never posted" in v for v in causality_violations(load_trace(path)[""]))


@pytest.mark.parametrize("costs", [False, True])
def test_visualize_keeps_the_peak_activation_memory_of_a_simulated_trace(capsys, tmp_path, costs):
    argv = ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--json", "--trace", str(tmp_path / "plan.json")]
    if costs:
        argv += ["--costs", _costs_file(tmp_path)]  # 10 activation bytes per forward
    code, out, _ = run(capsys, argv)
    assert code == 0
    planned = {r["rank"]: (r["peak_activations"], r["peak_activation_bytes"]) for r in json.loads(out)["ranks"]}
    assert planned == {0: (4, 40.0 if costs else 4.0), 1: (3, 30.0 if costs else 3.0), 2: (2, 20.0 if costs else 2.0),
                       3: (1, 10.0 if costs else 1.0)}
    code, out, _ = run(capsys, ["visualize", str(tmp_path / "plan.json"), "--json"])
    assert code == 0
    shown = {r["rank"]: (r["peak_activations"], r["peak_activation_bytes"]) for r in json.loads(out)["trace"]["ranks"]}
    assert shown == planned
    code, out, _ = run(capsys, ["visualize", str(tmp_path / "plan.json")])
    memory = 40 if costs else 4
    assert re.search(rf"^\s+0\s+24\s+0\.2727\s+27\.27%\s+4\s+{memory}$", out, flags=re.M), out


def test_visualize_with_a_simulated_plan_given_by_plan_keeps_its_peak_activation_memory(capsys, tmp_path):
    plan = str(tmp_path / "plan.json")
    code, out, _ = run(capsys, ["simulate", "-p", "2", "-m", "4", "--costs", _costs_file(tmp_path), "--json",
                                "--trace", plan])
    assert code == 0
    planned = {r["rank"]: r["peak_activation_bytes"] for r in json.loads(out)["ranks"]}
    assert planned == {0: 20.0, 1: 10.0}  # 10 activation bytes per forward held
    measured = tmp_path / "run.json"  # a records file (as gather_trace gives) of the same schedule
    measured.write_text(json.dumps(load_trace(plan)[""]))
    code, out, _ = run(capsys, ["visualize", str(measured), "--plan", plan, "--json"])
    assert code == 0
    assert {r["rank"]: r["peak_activation_bytes"] for r in json.loads(out)["plan"]["ranks"]} == planned


def test_visualize_of_a_dryrun_trace_counts_the_peaks_of_a_rank_the_watchers_did_not_see(capsys, tmp_path):
    # MindSpore's dry run of examples/mindspore_decoder.py watches no stage call ("peak 0 forward(s)"):
    # its 0 must not replace the peak that the records show
    from hyper_parallel.core.pipeline_parallel.tools.visualize import write_chrome_trace
    from hyper_parallel.dryrun import DryRunReport, RankReport

    steps = ["F.s{r}.m0", "F.s{r}.m1", "B.s{r}.m0", "B.s{r}.m1"]
    records = [{"rank": r, "step": s.format(r=r), "kind": "compute", "start": k * 1e-3, "end": (k + 1) * 1e-3}
               for r in (0, 1) for k, s in enumerate(steps)]
    report = DryRunReport("s.py", 2, "mindspore", [RankReport(0, peak_forwards=0, peak_bytes=0),
                                                   RankReport(1, peak_forwards=2, peak_bytes=None)])
    path = tmp_path / "dry.json"
    write_chrome_trace(path, None, records, measured_facts=report.trace_facts())
    code, out, _ = run(capsys, ["visualize", str(path), "--json"])
    assert code == 0
    shown = {r["rank"]: (r["peak_activations"], r["peak_activation_bytes"]) for r in json.loads(out)["trace"]["ranks"]}
    assert shown == {0: (2, 0.0), 1: (2, 0.0)}


def test_simulate_measured_and_trace_keeps_what_the_measured_file_knew_of_its_run(capsys, tmp_path):
    from hyper_parallel.core.pipeline_parallel.tools.visualize import write_chrome_trace

    steps = ["F.s{r}.m0", "F.s{r}.m1", "B.s{r}.m0", "B.s{r}.m1"]
    records = [{"rank": r, "step": s.format(r=r), "kind": "compute", "start": k * 1e-3, "end": (k + 1) * 1e-3}
               for r in (0, 1) for k, s in enumerate(steps)]
    dry = tmp_path / "dry.json"  # a run as 'dryrun --trace' stores it: the bytes it held per rank
    write_chrome_trace(dry, None, records, measured_facts={"peak_activations": {0: 2, 1: 2},
                                                            "peak_activation_bytes": {0: 6144, 1: 3584}})
    both = str(tmp_path / "both.json")
    code, _, _ = run(capsys, ["simulate", "-p", "2", "-m", "2", "--measured", str(dry), "--trace", both])
    assert code == 0
    code, out, _ = run(capsys, ["visualize", both, "--json"])
    assert code == 0
    assert [r["peak_activation_bytes"] for r in json.loads(out)["run"]["ranks"]] == [6144, 3584]


def test_visualize_of_a_dryrun_trace_shows_the_measured_activation_memory(capsys, tmp_path):
    trace = str(tmp_path / "dry.json")
    code, out, _ = run(capsys, ["dryrun", EXAMPLE, "--ranks", "2", "--trace", trace, "--json", "--",
                                "--micro-batches", "4", "--steps", "1"])
    assert code == 0
    held = {r["rank"]: r["peak_activation_bytes"] for r in json.loads(out[out.index("{"):])["ranks"]}
    code, out, _ = run(capsys, ["visualize", trace, "--json"])
    assert code == 0
    assert {r["rank"]: r["peak_activation_bytes"] for r in json.loads(out)["run"]["ranks"]} == held
    assert all(v > 0 for v in held.values())


def test_planning_commands_pause_the_collector_only_while_they_run(capsys, monkeypatch):
    """simulate and tune run without the cyclic collector (millions of objects live until they end)
    and give it back to an in-process caller as they found it; they keep no schedule behind them
    (tearing those down at exit cost more than the command's end)."""
    import gc

    import hyper_parallel.cli_tools as tools

    seen = []
    real = tools._simulate
    monkeypatch.setattr(tools, "_simulate", lambda parser, args: seen.append(gc.isenabled()) or real(parser, args))
    assert gc.isenabled()
    code, out, _ = run(capsys, ["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4"])
    assert code == 0 and "makespan" in out
    assert seen == [False] and gc.isenabled()
    from hyper_parallel.core.pipeline_parallel.lowering import plan_cache

    assert not plan_cache._GENERATED and not plan_cache._PLANS  # nothing kept for a teardown at exit
