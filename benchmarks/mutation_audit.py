"""Mutation audit of the pipeline runtime: one small plausible bug at a time, does a test see it?

A small AST mutator (no third-party tool): every *site* is one place where one operator applies

* ``cmp``      a comparison flipped (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``)
* ``boolop``   ``and`` <-> ``or``
* ``int``      an integer constant moved by one (0 -> 1, 1 -> 0, n -> n + 1)
* ``bool``     ``True`` <-> ``False``
* ``not``      a ``not`` dropped
* ``negate``   the test of an ``if`` / ``while`` / conditional expression negated
* ``arith``    ``+`` <-> ``-``, ``*`` <-> ``//``
* ``delete``   a statement (call, assignment, ``raise``, ``del``) replaced by ``pass``
* ``return``   ``return <value>`` -> ``return None``
* ``reverse``  a ``for`` loop iterates in reverse order
* ``loopctl``  ``break`` <-> ``continue``

Docstrings, type annotations, ``TYPE_CHECKING`` blocks and f-string parts are not mutated.
Sites are sampled with a fixed seed over all modules together. Each mutant runs a chosen subset of
tests for its module in a child process forked from a parent that has already imported torch and
pytest (so a mutant costs the tests, not the imports); the mutated module is compiled from the
mutated tree under its own file name (so tracebacks point at the original lines) and served to the
child by an import hook, so nothing on disk changes. ``-x`` stops at the first failing test.
A mutant is *killed* when a test fails (or the mutated module cannot even be imported), *killed by
hang* when it runs past the per-mutant timeout, and *survived* when every test passes.

    PYTHONPATH=$PWD nice .venv/bin/python benchmarks/mutation_audit.py            # full audit
    PYTHONPATH=$PWD .venv/bin/python benchmarks/mutation_audit.py --list-sites     # count sites
    PYTHONPATH=$PWD .venv/bin/python benchmarks/mutation_audit.py --only KEY ...   # chosen mutants

Results: ``benchmarks/results/mutation_audit.{md,json}``; survivors are marked equivalent /
unimportant with a reason in ``benchmarks/mutation_audit_notes.json`` (keyed by mutant key).
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.util
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
NOTES = os.path.join(ROOT, "benchmarks", "mutation_audit_notes.json")

PP = "hyper_parallel/core/pipeline_parallel"
PT = "hyper_parallel/platform/torch"

# Tests per module: fast, in-process (torch LocalCluster), most likely killers first.
_UNIT = ["tests/pipeline_unit/test_pp_lowering_kills.py", "tests/pipeline_unit/test_pp_lowering.py", "tests/pipeline_unit/test_pp_validate.py",
         "tests/pipeline_unit/test_pp_zero_bubble_classes.py", "tests/pipeline_unit/test_pp_swap_pass.py"]
_CORE = ["tests/pipeline/test_pp_review_regressions.py", "tests/pipeline/test_pp_run_contract.py",
         "tests/pipeline/test_pp_runtime_kills.py"]
_MATRIX = ["tests/pipeline/test_pp_matrix_local.py::test_tied_weights_under_every_schedule",
           "tests/pipeline/test_pp_matrix_local.py::test_shapes_that_change_per_micro_batch",
           "tests/pipeline/test_pp_matrix_local.py::test_batch_metadata_order_regression"]
_TIED = "tests/pipeline/test_pp_tied_one_rank_two_holders.py"
_NESTED = "tests/pipeline/test_pp_nested_inputs.py"
_ZB = "tests/pipeline/test_pp_zero_bubble_local.py"
_SPLIT = ["tests/platform/test_torch_autograd_kills.py", "tests/platform/test_backward_split.py", "tests/pipeline/test_pp_split_backward.py", _ZB]
TESTS: dict[str, list[str]] = {
    f"{PP}/runtime/executor.py": [*_CORE, *_MATRIX, _TIED, "tests/pipeline/test_pp_edge_cases.py",
                         "tests/pipeline/test_pp_errors.py", "tests/pipeline/test_pp_eval_step.py",
                         "tests/pipeline/test_pp_overlap_b_f_local.py", _NESTED, _ZB],
    f"{PP}/lowering/p2p.py": [*_UNIT, *_CORE, *_MATRIX[1:]],
    f"{PP}/runtime/microbatch.py": ["tests/pipeline_unit/test_pp_microbatch_kills.py", "tests/pipeline_unit/test_pp_microbatch.py", _NESTED, *_CORE],
    f"{PP}/runtime/shared_params.py": [_TIED, _MATRIX[0], _CORE[0], "tests/pipeline/test_pp_edge_cases.py",
                               f"{_ZB}::test_tied_first_and_last_weights"],
    f"{PT}/autograd.py": [*_SPLIT, *_CORE],
    f"{PT}/split_backward.py": _SPLIT,
}
# Never run in the audit: MindSpore cases (one run costs seconds) and the slowest exhaustive sweeps.
DESELECT_K = "not mindspore"
_SLOW = [f"tests/pipeline_unit/test_pp_lowering.py::test_interleaved_lowered_valid_for_every_m[{p}-{m}]"
         for p, m in ((4, 5), (4, 6), (3, 5), (3, 6), (2, 6))]
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore", "-k", DESELECT_K,
               *(f"--deselect={n}" for n in _SLOW)]

HANG_FACTOR = 4.0  # a mutant may take this many times its module's unmutated run (the machine may be busy)

CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
ARITH_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}


@dataclass
class Site:
    path: str
    index: int  # the site's number in its module (visiting order)
    line: int
    col: int
    op: str
    desc: str

    @property
    def key(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.op}"


def _short(node: ast.AST, limit: int = 70) -> str:
    text = ast.unparse(node).replace("\n", " ; ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Mutator(ast.NodeTransformer):
    """Numbers every site in visiting order; with ``target`` set, applies only that one."""

    def __init__(self, path: str, target: int | None = None) -> None:
        self.path, self.target = path, target
        self.sites: list[Site] = []
        self.applied: Site | None = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _site(self, node: ast.AST, op: str, before: ast.AST, after: ast.AST | None) -> bool:
        desc = f"{_short(before)}  ->  {_short(after) if after is not None else 'pass'}"
        site = Site(self.path, len(self.sites), node.lineno, node.col_offset, op, desc)
        self.sites.append(site)
        if site.index == self.target:
            self.applied = site
            return True
        return False

    # -- what is never mutated -----------------------------------------------------------------
    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for i, stmt in enumerate(body):
            if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                out.append(stmt)  # docstring
                continue
            new = self._stmt(stmt)
            out.append(new)
        return out

    def _stmt(self, stmt: ast.stmt) -> ast.stmt:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            return stmt
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            return stmt
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            return stmt
        deletable = isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.Raise, ast.Delete)) or (
            isinstance(stmt, ast.AnnAssign) and stmt.value is not None)
        if deletable and not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            if self._site(stmt, "delete", stmt, None):
                return ast.copy_location(ast.Pass(), stmt)
        return self.visit(stmt)

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = self._body(node.body)
        return node

    def _visit_def(self, node: Any) -> Any:
        node.body = self._body(node.body)  # decorators, defaults and annotations are left alone
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_def

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.body = self._body(node.body)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AnnAssign:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.JoinedStr:
        return node  # messages

    def _blocks(self, node: Any) -> None:
        for name in ("body", "orelse", "finalbody"):
            if hasattr(node, name):
                setattr(node, name, [self._stmt(s) for s in getattr(node, name)])
        if hasattr(node, "handlers"):
            for h in node.handlers:
                h.body = [self._stmt(s) for s in h.body]

    # -- operators ------------------------------------------------------------------------------
    def visit_If(self, node: ast.If) -> ast.If:
        if self._site(node, "negate", node.test, ast.UnaryOp(ast.Not(), node.test)):
            node.test = ast.UnaryOp(ast.Not(), node.test)
        else:
            node.test = self.visit(node.test)
        self._blocks(node)
        return node

    def visit_While(self, node: ast.While) -> ast.While:
        if self._site(node, "negate", node.test, ast.UnaryOp(ast.Not(), node.test)):
            node.test = ast.UnaryOp(ast.Not(), node.test)
        else:
            node.test = self.visit(node.test)
        self._blocks(node)
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        if self._site(node, "negate", node.test, ast.UnaryOp(ast.Not(), node.test)):
            node.test = ast.UnaryOp(ast.Not(), node.test)
            return node
        return self.generic_visit(node)

    def visit_For(self, node: ast.For) -> ast.For:
        rev = ast.Call(ast.Name("reversed", ast.Load()), [ast.Call(ast.Name("list", ast.Load()), [node.iter], [])], [])
        if self._site(node, "reverse", node.iter, rev):
            node.iter = rev
        else:
            node.iter = self.visit(node.iter)
        node.target = self.visit(node.target)
        self._blocks(node)
        return node

    def visit_With(self, node: ast.With) -> ast.With:
        node.items = [self.visit(i) for i in node.items]
        self._blocks(node)
        return node

    def visit_Try(self, node: ast.Try) -> ast.Try:
        self._blocks(node)
        return node

    def visit_Return(self, node: ast.Return) -> ast.Return:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            if self._site(node, "return", node, ast.Return(ast.Constant(None))):
                node.value = ast.Constant(None)
                return node
            node.value = self.visit(node.value)
        return node

    def visit_Break(self, node: ast.Break) -> ast.AST:
        return ast.copy_location(ast.Continue(), node) if self._site(node, "loopctl", node, ast.Continue()) else node

    def visit_Continue(self, node: ast.Continue) -> ast.AST:
        return ast.copy_location(ast.Break(), node) if self._site(node, "loopctl", node, ast.Break()) else node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        node = self.generic_visit(node)
        for i, op in enumerate(node.ops):
            swap = CMP_SWAP.get(type(op))
            if swap is None:
                continue
            after = copy.deepcopy(node)
            after.ops[i] = swap()
            if self._site(node, "cmp", node, after):
                node.ops[i] = swap()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        node = self.generic_visit(node)
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        if self._site(node, "boolop", node, ast.BoolOp(other, node.values)):
            node.op = other
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._site(node, "not", node, node.operand):
            return node.operand
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        node = self.generic_visit(node)
        swap = ARITH_SWAP.get(type(node.op))
        if swap is not None and self._site(node, "arith", node, ast.BinOp(node.left, swap(), node.right)):
            node.op = swap()
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        v = node.value
        if isinstance(v, bool):
            if self._site(node, "bool", node, ast.Constant(not v)):
                return ast.copy_location(ast.Constant(not v), node)
        elif isinstance(v, int):
            new = 1 if v == 0 else 0 if v == 1 else v + 1
            if self._site(node, "int", node, ast.Constant(new)):
                return ast.copy_location(ast.Constant(new), node)
        return node


def _tree(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def find_sites(path: str) -> list[Site]:
    m = _Mutator(path)
    m.visit(_tree(path))
    return m.sites


def mutate(site: Site) -> Any:
    """The code object of ``site.path`` with ``site`` applied (compiled under the original name)."""
    m = _Mutator(site.path, site.index)
    tree = ast.fix_missing_locations(m.visit(_tree(site.path)))
    if m.applied is None or m.applied.key != site.key:
        raise RuntimeError(f"site {site.key} no longer matches the source")
    return compile(tree, os.path.join(ROOT, site.path), "exec")


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".")


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, path: str, code: Any) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname == self.name:
            return importlib.util.spec_from_file_location(fullname, self.path, loader=self)
        return None

    def create_module(self, spec):  # noqa: ANN001
        return None

    def exec_module(self, module) -> None:  # noqa: ANN001
        exec(self.code, module.__dict__)  # noqa: S102


def _child(site: Site | None, tests: list[str], log: str) -> None:
    """In the forked child: serve the mutant, run the tests, exit with pytest's code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 3
    try:
        os.chdir(ROOT)
        sys.dont_write_bytecode = True
        for name in [n for n, mod in sys.modules.items()  # a parent that imported the project: forget it
                     if n.startswith("hyper_parallel") or (getattr(mod, "__file__", None) or "").startswith(
                         os.path.join(ROOT, "tests"))]:
            del sys.modules[name]
        if site is not None:
            try:
                compiled = mutate(site)
            except Exception as exc:  # a mutant that does not compile is killed by the compiler
                print(f"MUTANT DOES NOT COMPILE: {exc!r}")
                os._exit(1)
            sys.meta_path.insert(0, _Hook(_module_name(site.path), os.path.join(ROOT, site.path), compiled))
        import pytest
        import torch

        torch.set_num_threads(1)  # mutants run side by side on a shared machine
        code = int(pytest.main([*PYTEST_ARGS, *tests]))
    except BaseException as exc:  # noqa: BLE001
        print(f"CHILD ERROR: {exc!r}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_failure(log: str) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    for line in lines:
        if "MUTANT DOES NOT COMPILE" in line or "CHILD ERROR" in line:
            return line[:200]
    return lines[-1][:200] if lines else ""


@dataclass
class Outcome:
    key: str
    path: str
    line: int
    op: str
    desc: str
    status: str  # killed | killed-by-hang | survived | error
    seconds: float
    detail: str = ""
    note: dict[str, str] = field(default_factory=dict)


def _start(site: Site | None, tests: list[str], log: str) -> int:
    pid = os.fork()
    if pid == 0:
        _child(site, tests, log)
    return pid


def _finish(status: int, log: str) -> tuple[str, str]:
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return "survived", ""
    if code in (1, 2):  # tests failed / collection or import of the mutant failed
        return "killed", _first_failure(log)
    if code < 0:
        return "killed", f"crashed with signal {-code}"
    return "error", f"pytest exit {code}: {_first_failure(log)}"


def run_many(jobs: list[tuple[Site | None, list[str], str]], timeout: float | list[float], parallel: int = 1,
             report: Any = None) -> list[tuple[str, float, str]]:
    """Run each (site, tests, log) in a forked child, ``parallel`` at a time; a child past its
    timeout (seconds, one for all or one per job) is killed and counts as killed by hang."""
    limits = timeout if isinstance(timeout, list) else [timeout] * len(jobs)
    results: list[Any] = [None] * len(jobs)
    running: dict[int, tuple[int, float]] = {}  # pid -> (job index, start)
    nxt = 0
    while nxt < len(jobs) or running:
        while nxt < len(jobs) and len(running) < parallel:
            site, tests, log = jobs[nxt]
            running[_start(site, tests, log)] = (nxt, time.monotonic())
            nxt += 1
        for pid, (i, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            secs = time.monotonic() - start
            if done:
                state, detail = _finish(status, jobs[i][2])
            elif secs > limits[i]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                state, detail = "killed-by-hang", f"ran past {limits[i]:.0f}s"
            else:
                continue
            del running[pid]
            results[i] = (state, secs, detail)
            if report is not None:
                report(i, *results[i])
        time.sleep(0.05)
    return results


def run_one(site: Site | None, tests: list[str], timeout: float, log: str) -> tuple[str, float, str]:
    return run_many([(site, tests, log)], timeout)[0]


def sample(seed: int, count: int, modules: list[str]) -> tuple[dict[str, int], list[Site]]:
    sites = {m: find_sites(m) for m in modules}
    everything = [s for m in modules for s in sites[m]]
    picked = random.Random(seed).sample(everything, min(count, len(everything)))
    picked.sort(key=lambda s: (modules.index(s.path), s.index))
    return {m: len(v) for m, v in sites.items()}, picked


def _preload() -> None:
    """What every child needs and costs seconds to import: done once, before forking."""
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401

    try:
        import hypothesis  # noqa: F401
    except ImportError:
        pass


def audit(modules: list[str], seed: int, count: int, timeout: float, only: list[str] | None,
          logdir: str, progress: bool = True, parallel: int = 1) -> dict[str, Any]:
    _preload()
    site_counts, picked = sample(seed, count, modules)
    if only:
        by_key = {s.key: s for m in modules for s in find_sites(m)}
        missing = [k for k in only if k not in by_key]
        if missing:
            raise SystemExit(f"unknown mutant keys: {missing}")
        picked = [by_key[k] for k in only]
    os.makedirs(logdir, exist_ok=True)
    baseline: dict[str, Any] = {}
    mods = sorted({s.path for s in picked})
    runs = run_many([(None, TESTS[m], os.path.join(logdir, f"baseline{i}.log")) for i, m in enumerate(mods)],
                    timeout * 3, parallel)
    for m, (status, secs, detail) in zip(mods, runs, strict=True):
        baseline[m] = {"passed": status == "survived", "seconds": round(secs, 1), "detail": detail}
        if status != "survived":
            raise SystemExit(f"the unmutated code fails the tests chosen for {m}: {status} {detail}")
        if progress:
            print(f"baseline {m}: {secs:.1f}s", flush=True)
    notes = {}
    if os.path.exists(NOTES):
        with open(NOTES, encoding="utf-8") as f:
            notes = json.load(f)
    started = time.monotonic()

    def report(i: int, status: str, secs: float, detail: str) -> None:
        if progress:
            site = picked[i]
            print(f"[{i + 1}/{len(picked)}] {status:14s} {secs:5.1f}s {site.key}  {site.desc}", flush=True)

    jobs = [(site, TESTS[site.path], os.path.join(logdir, f"mutant{i}.log")) for i, site in enumerate(picked)]
    # A mutant may not take much longer than its module's unmutated run (the machine may be busy).
    limits = [max(timeout, HANG_FACTOR * baseline[site.path]["seconds"]) for site in picked]
    outcomes = []
    for site, (status, secs, detail) in zip(picked, run_many(jobs, limits, parallel, report), strict=True):
        out = Outcome(site.key, site.path, site.line, site.op, site.desc, status, round(secs, 1), detail)
        if status == "survived" and site.key in notes:
            out.note = notes[site.key]
        outcomes.append(out)
    per_module = {}
    for m in modules:
        mine = [o for o in outcomes if o.path == m]
        per_module[m] = {"sites": site_counts[m], "sampled": len(mine),
                         "killed": sum(o.status == "killed" for o in mine),
                         "killed_by_hang": sum(o.status == "killed-by-hang" for o in mine),
                         "survived": sum(o.status == "survived" for o in mine),
                         "errors": sum(o.status == "error" for o in mine)}
    return {"seed": seed, "requested": count, "timeout_s": timeout, "jobs": parallel, "chosen": bool(only),
            "hang_factor": HANG_FACTOR,
            "mutants_wall_s": round(time.monotonic() - started, 1), "pytest_args": PYTEST_ARGS, "tests": TESTS,
            "baseline": baseline, "modules": per_module,
            "totals": {k: sum(v[k] for v in per_module.values()) for k in next(iter(per_module.values()))},
            "mutants": [asdict(o) for o in outcomes]}


def write_report(result: dict[str, Any], stem: str, before: dict[str, Any] | None = None,
                 results_dir: str = RESULTS, title: str | None = None) -> None:
    os.makedirs(results_dir, exist_ok=True)
    if before is not None:
        result["before"] = {"modules": before["modules"], "totals": before["totals"],
                            "survivors": [m["key"] for m in before["mutants"] if m["status"] == "survived"]}
    notes = {}
    if os.path.exists(NOTES):
        with open(NOTES, encoding="utf-8") as f:
            notes = json.load(f)
    for m in result["mutants"]:
        m["note"] = notes.get(m["key"], {}) if m["status"] == "survived" else {}
    with open(os.path.join(results_dir, f"{stem}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    t = result["totals"]
    chosen = result.get("chosen") or (result["totals"]["sampled"] != result["requested"] and "before" not in result)
    sample_text = (f"{t['sampled']} chosen mutants (--only) of {t['sites']} sites" if chosen
                   else f"seed {result['seed']}, {t['sampled']} of {t['sites']} sites sampled")
    if title:
        result["title"] = title
    lines = [f"# {result.get('title') or 'Mutation audit of the pipeline runtime'}", "",
             f"Generated by `benchmarks/mutation_audit.py` ({sample_text}, {result['timeout_s']:.0f} s per mutant). A mutant is killed when one of the tests chosen for its "
             "module fails, killed by hang when it runs past the timeout (at least "
             f"{result.get('hang_factor', 2.5):g}x the module's unmutated run).", "",
             "| module | sites | sampled | killed | killed by hang | survived |"
             + (" survived before |" if before else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if before else "")]
    for m, v in [*result["modules"].items(), ("total", t)]:
        row = f"| `{m}` | {v['sites']} | {v['sampled']} | {v['killed']} | {v['killed_by_hang']} | {v['survived']} |"
        if before:
            row += f" {(before['totals'] if m == 'total' else before['modules'][m])['survived']} |"
        lines.append(row)
    if t["errors"]:
        lines += ["", f"{t['errors']} mutant(s) ended in a test-run error (not counted as killed)."]
    survivors = [m for m in result["mutants"] if m["status"] == "survived"]
    lines += ["", f"## Survivors ({len(survivors)})", "",
              "| mutant | mutation | verdict | reason |", "|---|---|---|---|"]
    for m in survivors:
        note = m.get("note") or {}
        desc = m["desc"].replace("|", "\\|")
        lines.append(f"| `{m['path']}:{m['line']}` ({m['op']}) | `{desc}` | {note.get('verdict', 'open')} | "
                     f"{note.get('reason', '').replace('|', '/')} |")
    if before:
        lines += ["", "'survived before' is the first audit (`mutation_audit_before.md`, same seed and sample, the tests as "
                  "they were then); this report reruns its survivors with the strengthened tests. Tests were only "
                  "added in between, so a mutant killed then is still killed."]
        killed_since = [k for k in result["before"]["survivors"] if k not in {m["key"] for m in survivors}]
        lines += ["", f"## Killed since the first audit ({len(killed_since)})", ""]
        lines += [f"- `{k}`" for k in killed_since]
    lines += ["", "## Tests run per module", ""]
    for m, tests in result["tests"].items():
        lines.append(f"- `{m}`: " + ", ".join(f"`{x}`" for x in tests))
    lines += ["", f"pytest options: `{' '.join(result['pytest_args'])}`", ""]
    with open(os.path.join(results_dir, f"{stem}.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--count", type=int, default=170, help="mutants sampled over all modules")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds per mutant before it counts as a hang (at least 4x its module's unmutated run)")
    ap.add_argument("--module", action="append", help="restrict to these module paths")
    ap.add_argument("--only", nargs="*", help="run exactly these mutant keys (path:line:col:op)")
    ap.add_argument("--tests", nargs="+", help="run these tests for every module instead of the chosen subsets")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--rerun-survivors", metavar="JSON",
                    help="rerun only the survivors of an earlier audit (same seed and count) and report the "
                         "whole sample, with the earlier survived counts as 'before'")
    ap.add_argument("--title", help="heading of the report")
    ap.add_argument("--report", metavar="JSON", help="only write the report of an earlier result (notes re-read)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    ap.add_argument("--list-sites", action="store_true")
    ap.add_argument("--out", default="mutation_audit", help="stem of the result files under benchmarks/results")
    ap.add_argument("--before", help="an earlier result JSON to report survived-before counts against")
    ap.add_argument("--logdir", default=os.path.join("/tmp", f"mutation_audit_{os.getpid()}"))
    args = ap.parse_args(argv)
    modules = args.module or list(TESTS)
    if args.tests:
        for m in modules:
            TESTS[m] = list(args.tests)
    if args.list_sites:
        for m in modules:
            print(f"{m}: {len(find_sites(m))} sites")
        return 0
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            result = json.load(f)
        before = None
        if args.before:
            with open(args.before, encoding="utf-8") as f:
                before = json.load(f)
        write_report(result, args.out, before, args.results_dir, args.title)
        return 0
    before = None
    if args.before or args.rerun_survivors:
        with open(args.before or args.rerun_survivors, encoding="utf-8") as f:
            before = json.load(f)
    only = args.only
    if args.rerun_survivors:  # with --only: those mutants too (e.g. a hang to judge with a longer limit)
        only = [m["key"] for m in before["mutants"] if m["status"] == "survived"] + list(args.only or [])
    result = audit(modules, args.seed, args.count, args.timeout, only, args.logdir, parallel=args.jobs)
    if args.rerun_survivors:
        result = _merge(before, result)
    write_report(result, args.out, before, args.results_dir, args.title)
    print(json.dumps(result["totals"]))
    return 0


def _merge(before: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """The earlier audit with its survivors replaced by their rerun (tests were only added since)."""
    again = {m["key"]: m for m in rerun["mutants"]}
    mutants = [again.get(m["key"], m) for m in before["mutants"]]
    per_module = {}
    for mod, v in before["modules"].items():
        mine = [m for m in mutants if m["path"] == mod]
        per_module[mod] = {"sites": v["sites"], "sampled": len(mine),
                           "killed": sum(m["status"] == "killed" for m in mine),
                           "killed_by_hang": sum(m["status"] == "killed-by-hang" for m in mine),
                           "survived": sum(m["status"] == "survived" for m in mine),
                           "errors": sum(m["status"] == "error" for m in mine)}
    out = dict(rerun)
    out.update(seed=before["seed"], requested=before["requested"], chosen=False, modules=per_module, mutants=mutants,
               totals={k: sum(v[k] for v in per_module.values()) for k in next(iter(per_module.values()))})
    return out


if __name__ == "__main__":
    sys.exit(main())
