"""The mutation audit tool end to end on a few fixed mutants, so it cannot rot unnoticed.

Runs ``benchmarks/mutation_audit.py`` in a subprocess on ``shared_params.py`` with one small test
file: the unmutated code must pass, a mutant that breaks the tied-gradient sum must be reported
killed, a mutant that no test of that file looks at must be reported survived, and a per-mutant
timeout shorter than any run must be reported as a hang.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "benchmarks", "mutation_audit.py")
MODULE = "hyper_parallel/core/pipeline_parallel/runtime/shared_params.py"
TESTS = "tests/pipeline/test_pp_tied_one_rank_two_holders.py::test_tie_held_twice_on_one_non_owner_rank_over_several_runs"


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_audit", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation_audit"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _key(sites, op: str, text: str) -> str:
    (site,) = [s for s in sites if s.op == op and text in s.desc]
    return site.key


def _run(tmp_path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, TOOL, "--module", MODULE, "--tests", f"{TESTS}[True-plain-ScheduleInterleaved1F1B]",
           "--results-dir", str(tmp_path), "--logdir", str(tmp_path / "logs"), "--out", "audit", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "audit.json", encoding="utf-8") as f:
        return json.load(f)


def test_sites_are_found_and_each_mutant_changes_the_code():
    tool = _tool()
    sites = tool.find_sites(MODULE)
    ops = {s.op for s in sites}
    assert {"cmp", "delete", "arith", "negate", "reverse", "int", "return"} <= ops, ops
    assert len({s.key for s in sites}) == len(sites)
    with open(os.path.join(ROOT, MODULE), encoding="utf-8") as f:
        original = compile(f.read(), os.path.join(ROOT, MODULE), "exec")

    def codes(code):
        out = [code.co_code]
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                out += codes(const)
        return out

    for site in sites[::7]:
        assert codes(tool.mutate(site)) != codes(original), site.key
    # the sum of a tie's gradients: "+" becomes "-"
    assert "total - part" in next(s.desc for s in sites if s.op == "arith" and "total + part" in s.desc)


@pytest.mark.timeout(150)
def test_killed_survived_and_hang_are_reported(tmp_path):
    sites = _tool().find_sites(MODULE)
    killed = _key(sites, "arith", "total + part")  # the owner subtracts instead of summing
    survives = _key(sites, "delete", "raise ValueError(f'shared parameter")  # no test here declares a lone tie
    result = _run(tmp_path, "--only", killed, survives)
    assert result["baseline"][MODULE]["passed"]  # the unmutated code passes the tests it is judged by
    status = {m["key"]: m["status"] for m in result["mutants"]}
    assert status == {killed: "killed", survives: "survived"}
    assert "FAILED" in next(m["detail"] for m in result["mutants"] if m["key"] == killed)
    assert result["modules"][MODULE]["survived"] == 1 and result["modules"][MODULE]["killed"] == 1
    report = (tmp_path / "audit.md").read_text()
    assert "| `total` |" in report and "total - part" not in report  # only survivors are listed
    assert "raise ValueError" in report


@pytest.mark.timeout(150)
def test_a_mutant_past_its_timeout_counts_as_a_hang(tmp_path):
    tool = _tool()
    sites = tool.find_sites(MODULE)
    site = next(s for s in sites if s.op == "arith" and "total + part" in s.desc)
    status, secs, detail = tool.run_one(site, [TESTS], 0.01, str(tmp_path / "hang.log"))
    assert status == "killed-by-hang" and "ran past" in detail
