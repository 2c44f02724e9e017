"""``hyper-parallel calibrate`` on real gloo processes and ``benchmarks/fidelity.py`` at its
smallest setting: the files they write are well-formed. No assertion on any time (the figures
mean nothing on a shared machine; docs/tools.md has the measured ones)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from hyper_parallel.measure import calibration_job as calibration
from hyper_parallel.cli import main
from hyper_parallel.core.pipeline_parallel.simulation.machine import load_machine
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import KINDS, PER_KIND, SCALARS

FIDELITY = os.path.join(REPO_ROOT, "benchmarks", "fidelity.py")


def _numbers(data):
    if isinstance(data, dict):
        for value in data.values():
            yield from _numbers(value)
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield data


@pytest.mark.timeout(300)
def test_calibrate_on_two_gloo_processes_writes_a_well_formed_machine_file(capsys, tmp_path, monkeypatch):
    # the smallest calibration: one traced round of each workload (the figures are not checked)
    monkeypatch.setitem(calibration.CALIBRATION, "rounds", 1)
    monkeypatch.setitem(calibration.CALIBRATION, "warmup", 1)
    monkeypatch.setitem(calibration.CALIBRATION, "trips", 4)
    out = tmp_path / "machine.json"
    code = main(["calibrate", "--nproc", "2", "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    written = json.loads(out.read_text())
    assert printed == written
    assert written["format"] == "hyper-parallel-costs/1"
    assert set(written["runtime"]) == set(PER_KIND) | set(SCALARS)
    for name in PER_KIND:
        assert set(written["runtime"][name]) == set(KINDS)
    values = list(_numbers(written["runtime"])) + [written["p2p"]["latency_ms"]]
    assert all(math.isfinite(v) and v >= 0 for v in values)
    assert written["p2p"]["bandwidth_gb_per_s"] is None or written["p2p"]["bandwidth_gb_per_s"] > 0
    assert written["runtime"]["compute_ms"]["F"] > 0 and written["runtime"]["send_ms"] > 0
    assert written["machine"]["nproc"] == 2 and written["machine"]["backend"] == "gloo"
    machine = load_machine(out)  # what simulate --machine reads
    assert machine.runtime.send_ms == written["runtime"]["send_ms"]
    code = main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--machine", str(out), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["machine"] == str(out)


@pytest.mark.parametrize("argv,message", [
    (["calibrate", "--nproc", "1"], "argument --nproc: must be an integer >= 2, got 1"),
    (["calibrate", "--nproc", "two"], "argument --nproc: must be an integer, got 'two'"),
    (["calibrate", "--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
    (["calibrate", "--out", "/no/such/folder/m.json"], "argument --out: cannot write /no/such/folder/m.json"),
])
def test_calibrate_usage_errors_are_one_line_before_any_work(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("hyper-parallel calibrate: error:")


@pytest.mark.skipif(os.environ.get("CUDA_VISIBLE_DEVICES") is not None, reason="the check is for a CPU machine")
def test_calibrate_names_a_backend_this_machine_lacks(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--backend", "nccl"])
    assert info.value.code == 2
    assert "argument --backend: backend nccl needs CUDA devices" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["simulate", "tune"])
@pytest.mark.parametrize("content,field", [
    (None, "cannot read"),
    ("{", "not JSON"),
    ('{"runtime": {"wait_ms": -0.5}}', "runtime.wait_ms must be a finite number >= 0, got -0.5"),
    ('{"runtime": {"received_ms": {"B": "slow"}}}', "runtime.received_ms.B must be a finite number >= 0"),
    ('{"p2p": {"latency_ms": 0.1}}', "no 'runtime' object"),
    ('{"runtime": {}, "overlap": "zzz"}', "overlap must be one of sum, max"),
    ('{"runtime": {}, "p2p": 0}', "p2p must be an object"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
])
def test_a_bad_machine_file_is_one_error_line_naming_file_and_field(capsys, tmp_path, command, content, field):
    path = tmp_path / "machine.json"
    if content is not None:
        path.write_text(content)
    costs = tmp_path / "costs.json"
    costs.write_text('{"stages": [{"F": 1, "B": 2}]}')
    argv = {"simulate": ["simulate", "--costs", str(costs)],
            "tune": ["tune", "--costs", str(costs), "--memory-limit", "1GiB", "--global-batch", "8", "-p", "2"]}[command]
    with pytest.raises(SystemExit) as info:
        main(argv + ["--machine", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hyper-parallel {command}: error: argument --machine: {path}") and field in last
    assert "Traceback" not in err


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs /proc/version, a file no one can write")
def test_calibrate_into_a_file_that_cannot_be_written_is_one_error_line(capsys, monkeypatch):
    """/proc/version passes every check root has before writing (os.access, opening it); the
    write itself fails, after the calibration: one error line and exit code 2, no traceback."""
    monkeypatch.setitem(calibration.CALIBRATION, "rounds", 1)
    monkeypatch.setitem(calibration.CALIBRATION, "warmup", 1)
    monkeypatch.setitem(calibration.CALIBRATION, "trips", 4)
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--nproc", "2", "--out", "/proc/version"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("hyper-parallel calibrate: error: argument --out: cannot write "
                                                   "/proc/version")
    assert "Traceback" not in err


def _simulated(capsys, machine, *extra):
    code = main(["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--machine", str(machine), "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0
    return json.loads(captured.out)["makespan_ms"], captured.err


@pytest.mark.parametrize("backend,transport", [("nccl", "batch"), ("hccl", "batch"), ("gloo", "plain"), (None, "plain")])
def test_simulate_machine_takes_its_transport_from_the_calibrated_backend(capsys, tmp_path, backend, transport):
    """Without --transport a machine calibrated on NCCL/HCCL is simulated with the batched
    transport (what p2p_transport="auto" picks there); --transport still wins."""
    path = tmp_path / "machine.json"
    data = {"p2p": {"latency_ms": 0.5}, "runtime": {"send_ms": 0.3, "recv_ms": 0.2, "batch_ms": 2.0}}
    if backend is not None:
        data["machine"] = {"backend": backend, "nproc": 2}
    path.write_text(json.dumps(data))
    default, _ = _simulated(capsys, path)
    plain, _ = _simulated(capsys, path, "--transport", "plain")
    batch, _ = _simulated(capsys, path, "--transport", "batch")
    assert plain != batch
    assert default == {"plain": plain, "batch": batch}[transport]


def test_a_machine_calibrated_with_another_process_count_is_warned_about(capsys, tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"runtime": {"send_ms": 0.3}, "machine": {"backend": "gloo", "nproc": 4}}))
    _, err = _simulated(capsys, path)
    assert err.strip() == (f"warning: {path} was calibrated with 4 processes, not 2: its per-step costs may differ "
                           "with 2 (calibrate with --nproc 2)")
    path.write_text(json.dumps({"runtime": {"send_ms": 0.3}, "machine": {"backend": "gloo", "nproc": 2}}))
    assert _simulated(capsys, path)[1] == ""
    costs = tmp_path / "costs.json"
    costs.write_text('{"stages": [{"F": 1, "B": 2}]}')
    path.write_text(json.dumps({"runtime": {}, "machine": {"nproc": 3}}))
    code = main(["tune", "--costs", str(costs), "--memory-limit", "1GiB", "--global-batch", "4", "-p", "2",
                 "--schedules", "1f1b", "--machine", str(path), "--json"])
    assert code == 0 and "calibrated with 3 processes, not 2" in capsys.readouterr().err


def test_simulate_machine_refuses_compute_only_lists_in_one_line(capsys, tmp_path):
    """--machine predicts the lowered lists run() executes: compute-only lists are a usage error."""
    path = tmp_path / "machine.json"
    path.write_text('{"p2p": {"latency_ms": 10.0}, "runtime": {"compute_ms": 0.01}}')
    with pytest.raises(SystemExit) as info:
        main(["simulate", "-p", "2", "-m", "4", "--machine", str(path), "--compute-only"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("hyper-parallel simulate: error: argument --compute-only: not "
                                                   "allowed with --machine")
    assert "Traceback" not in err


@pytest.mark.timeout(600)
def test_fidelity_benchmark_writes_the_documented_schema(tmp_path):
    out = tmp_path / "fidelity.json"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    argv = [sys.executable, FIDELITY, "--schedules", "1f1b", "--m", "4", "--fwd-ms", "2", "--bwd-ms", "2",
            "--rounds", "5", "--p", "2", "--json", str(out)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"fidelity.py hung:\n{exc.stdout}\n{exc.stderr}") from exc
    assert proc.returncode == 0, f"fidelity.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    data = json.loads(out.read_text())
    [case] = data["cases"]
    assert (case["schedule"], case["v"], case["m"]) == ("1f1b", 1, 4)
    assert case["predicted_ms"] > 0 and case["measured_ms"] > 0
    tune = data["tune"]
    assert {"picked", "picked_measured_ms", "best_measured_ms", "candidates"} <= set(tune)
    assert 1 <= len(tune["candidates"]) <= 6
    assert tune["picked"] in tune["candidates"]
    assert tune["best_measured_ms"] == min(c["measured_ms"] for c in tune["candidates"])
    assert tune["picked_measured_ms"] == tune["picked"]["measured_ms"]


def _fidelity_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fidelity_under_test", FIDELITY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,message", [
    (["--schedules", "foo"], "argument --schedules: unknown schedule 'foo'"),
    (["--schedules", ","], "argument --schedules: name at least one schedule"),
    (["--fwd-ms", "nan"], "argument --fwd-ms: must be a finite number > 0, got 'nan'"),
    (["--bwd-ms", "inf"], "argument --bwd-ms: must be a finite number > 0, got 'inf'"),
    (["--bwd-ms", "0"], "argument --bwd-ms: must be a finite number > 0, got '0'"),
    (["--schedules", "dualpipev", "--m", "3"], "argument --m: needs at least 2 p = 4 micro-batches, got 3"),
    (["--json", "/nonexistent/x.json"], "argument --json: cannot write /nonexistent/x.json"),
    (["--rounds", "1"], "argument --rounds: must be an integer >= 5, got 1"),
    (["--p", "1"], "argument --p: must be an integer >= 2, got 1"),
])
def test_fidelity_bad_input_is_one_error_line_before_any_process_starts(capsys, monkeypatch, tmp_path, argv, message):
    """Checked before calibrating: calibrate() here would fail the test with another exception."""
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before the arguments were checked")

    monkeypatch.setattr(calibration, "calibrate", no_calibration)
    base = ["--schedules", "1f1b", "--m", "8", "--fwd-ms", "5", "--bwd-ms", "10", "--p", "2",
            "--json", str(tmp_path / "out.json")]
    with pytest.raises(SystemExit) as info:
        _fidelity_module().main(base + argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f": error: {message}" in errors[0] and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()
