"""The ``hyper-parallel`` command: option checks, help, version, --chunks, a missing framework."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

import hyper_parallel
from hyper_parallel.cli import main
from hyper_parallel.demo import DemoOptions


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2, (out, err)
    assert out == ""  # nothing was started or printed
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["demo", "--steps", "-3"], "argument --steps: must be an integer >= 1, got -3"),
        (["demo", "--steps", "two"], "argument --steps: must be an integer, got 'two'"),
        (["demo", "--ranks", "1"], "argument --ranks: must be an integer >= 2, got 1"),
        (["demo", "--ranks", "-4"], "argument --ranks: must be an integer >= 2, got -4"),
        (["demo", "--ranks", "7"],
         "argument --ranks: the demo's GPT has 6 transformer blocks, so it runs on at most 6 pipeline ranks, got 7"),
        (["demo", "--schedule", "zbv", "--ranks", "16", "--micro-batches", "32", "--batch-size", "32"],
         "argument --ranks: the demo's GPT has 6 transformer blocks, so it runs on at most 6 pipeline ranks, got 16"),
        (["demo", "--micro-batches", "0"], "argument --micro-batches: must be an integer >= 1, got 0"),
        (["demo", "--batch-size", "-16"], "argument --batch-size: must be an integer >= 1, got -16"),
        (["demo", "--micro-batches", "3"],
         "--batch-size 16 does not split into --micro-batches 3 equal micro-batches"),
        (["demo", "--batch-size", "10", "--micro-batches", "4"],
         "--batch-size 10 does not split into --micro-batches 4 equal micro-batches"),
        (["demo", "--chunks", "2"],
         "argument --chunks: the 1f1b schedule runs one stage per rank, so chunks must be 1, got 2 "
         "(several stages per rank: interleaved-1f1b, looped-bfs, interleaved-zb, zbv, dualpipev)"),
        (["demo", "--schedule", "interleaved-1f1b", "--chunks", "1"],
         "argument --chunks: the interleaved-1f1b schedule runs between 2 and 64 stages per rank, got chunks=1"),
        (["demo", "--chunks", "0"], "argument --chunks: must be an integer >= 1, got 0"),
        (["demo", "--graph-mode"], "--graph-mode is MindSpore's GRAPH_MODE: it needs --backend mindspore"),
        (["chart", "--ranks", "1"], "argument --ranks: must be an integer >= 2, got 1"),
        (["chart", "--micro-batches", "-1"], "argument --micro-batches: must be an integer >= 1, got -1"),
        (["chart", "--schedule", "gpipe", "--chunks", "3"],
         "argument --chunks: the gpipe schedule runs one stage per rank, so chunks must be 1, got 3"),
        (["chart", "--schedule", "zbv", "--chunks", "3"],
         "argument --chunks: the zbv schedule runs exactly 2 stages per rank, got chunks=3"),
        (["demo", "--schedule", "dualpipev", "--micro-batches", "4", "--batch-size", "8"],
         "argument --micro-batches: the dualpipev schedule needs at least 8 micro-batches with 4 ranks, got 4"),
    ],
)
def test_bad_options_are_usage_errors(capsys, argv, message):
    err = _usage_error(capsys, argv)
    assert f"hyper-parallel {argv[0]}: error: {message}" in err, err


def test_more_ranks_than_blocks_is_refused_in_one_line(capsys):
    err = _usage_error(capsys, ["demo", "--ranks", "8"])  # nothing printed or launched (checked there)
    assert [line for line in err.splitlines() if "error" in line] == [
        "hyper-parallel demo: error: argument --ranks: the demo's GPT has 6 transformer blocks, so it runs on at "
        "most 6 pipeline ranks, got 8"]


def test_no_command_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hyper-parallel")
    assert re.search(r"^\s+demo\s+train a small GPT", out, flags=re.M)
    assert re.search(r"^\s+chart\s+print a schedule", out, flags=re.M)


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"hyper-parallel {hyper_parallel.__version__}\n"
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == hyper_parallel.__version__


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["chart", "--help"]])
def test_help_is_plain_text_with_defaults(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":class:" not in out
    if argv[0] != "--help":
        assert "(default: 1f1b)" in out and "(default: 4)" in out and "(default: 8)" in out
        assert "(default: None)" not in out
    if argv[0] == "demo":
        assert "(default: torch)" in out and "(default: 16)" in out


def test_chunks_reach_the_schedule(capsys):
    assert main(["chart", "--schedule", "interleaved-1f1b", "--ranks", "2", "--chunks", "3",
                 "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ScheduleInterleaved1F1B: 2 ranks x 3 stage(s) per rank, 4 micro-batches")
    assert "F0.2" in out and "F0.3" not in out  # chunk indices 0..2 only
    assert main(["chart", "--schedule", "looped-bfs", "--ranks", "2", "--micro-batches", "2"]) == 0
    assert "2 ranks x 2 stage(s) per rank" in capsys.readouterr().out  # the schedule's default


def test_demo_options_are_checked_in_the_library_too():
    with pytest.raises(ValueError, match="ranks must be an int >= 2, got 1"):
        DemoOptions(ranks=1)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        DemoOptions(steps=0)
    with pytest.raises(ValueError, match="the demo's GPT has 6 transformer blocks, so it runs on at most 6 pipeline "
                                         "ranks, got 8"):
        DemoOptions(ranks=8, micro_batches=8)
    assert DemoOptions(ranks=6, micro_batches=8).ranks == 6
    with pytest.raises(ValueError, match="the gpipe schedule runs one stage per rank, so chunks must be 1, got 2"):
        DemoOptions(schedule="gpipe", chunks=2)
    assert DemoOptions(schedule="looped-bfs").chunks == 2 and DemoOptions().chunks == 1


BLOCKED_IMPORT = """
import sys
sys.modules[{module!r}] = None  # as if the framework were not installed
from hyper_parallel.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_a_missing_framework_names_the_extra_to_install(backend):
    code = BLOCKED_IMPORT.format(module=backend, argv=["demo", "--backend", backend, "--steps", "1"])
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"hyper-parallel demo: error: the {backend} platform needs" in proc.stderr, proc.stderr
    assert f"pip install 'hyper-parallel[{backend}]'" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.timeout(120)
def test_chart_needs_no_framework():
    code = ("import sys\nsys.modules['torch'] = sys.modules['mindspore'] = None\n"
            "from hyper_parallel.cli import main\nsys.exit(main(['chart', '--ranks', '2', '--micro-batches', '2']))")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Schedule1F1B: 2 ranks x 1 stage(s) per rank, 2 micro-batches")


@pytest.mark.timeout(300)
def test_demo_trains_with_chosen_chunks():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    argv = ["demo", "--schedule", "looped-bfs", "--ranks", "2", "--chunks", "3", "--steps", "1",
            "--micro-batches", "2", "--batch-size", "4"]
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.cli", *argv], capture_output=True, text=True,
                          timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ScheduleLoopedBFS: 2 ranks x 3 stage(s) per rank, 2 micro-batches" in proc.stdout
    assert re.search(r"vs the same step without a pipeline: \S+ \(OK", proc.stdout)
