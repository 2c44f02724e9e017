"""The tree is the architecture: no import cycle, layers point down, folders hold one role.

Every ``import`` of the library's own modules counts as an edge, wherever it stands: at the top of
a module, inside a function (a lazy import), or under ``TYPE_CHECKING``. The checks read the source
with ``ast`` and import nothing, so they also hold for modules a test run never imports.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import REPO_ROOT

LIB = os.path.join(REPO_ROOT, "hyper_parallel")
PP = "hyper_parallel.core.pipeline_parallel"

# what each part of pipeline_parallel may import from the others (its own modules always)
ALLOWED = {
    "ir": set(),
    "lowering": {"ir"},
    "schedules": {"ir", "lowering"},
    "runtime": {"ir", "lowering"},
    "simulation": {"ir", "lowering", "schedules"},
    "schedule": {"ir", "lowering", "runtime", "schedules"},
    "zero_bubble_schedules": {"ir", "lowering", "runtime", "schedules", "schedule"},
    "features": {"ir", "lowering", "runtime", "schedules", "schedule", "zero_bubble_schedules", "simulation"},
    "tools": {"ir", "lowering", "runtime", "schedules", "schedule", "zero_bubble_schedules", "simulation",
              "features"},
}
FRAMEWORKS = ("torch", "mindspore", "torch_npu")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(LIB):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, lazy ones included."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            subs = [a.name for a in node.names if _resolve(f"{name}.{a.name}") in MODULES]
            yield from ((f"{name}.{s}", node.lineno) for s in subs)
            if len(subs) < len(node.names):  # names from the module itself
                yield name, node.lineno


def _resolve(name: str) -> str:
    """An old flat path (``_moved_modules.MOVED``) is an import of the module at its new home."""
    from hyper_parallel.core.pipeline_parallel._moved_modules import MOVED

    head, _, rest = name[len(PP) + 1:].partition(".") if name.startswith(PP + ".") else ("", "", "")
    if head in MOVED:
        return f"{PP}.{MOVED[head]}" + (f".{rest}" if rest else "")
    return name


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        names = {_resolve(name) for name, _ in _imports(mod, path)}
        edges[mod] = {name for name in names if name in MODULES and name != mod}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _part(module: str) -> str | None:
    if not module.startswith(PP + "."):
        return None
    return module[len(PP) + 1:].split(".")[0]


def test_no_import_cycle_anywhere():
    assert _cycles(_edges()) == []


def test_cycle_finder_finds_a_cycle():
    """The checker itself can fail: a lazy import back from the runtime closes a circle."""
    edges = _edges()
    edges[f"{PP}.runtime.executor"] = edges[f"{PP}.runtime.executor"] | {f"{PP}.schedule"}
    assert any(f"{PP}.schedule" in c and f"{PP}.runtime.executor" in c for c in _cycles(edges))


def test_layers_point_down():
    bad = []
    for mod, targets in _edges().items():
        part = _part(mod)
        if part is None or part.startswith("_"):
            continue
        for target in targets:
            other = _part(target)
            if other is None or other == part or other.startswith("_"):
                continue
            if other not in ALLOWED[part]:
                bad.append(f"{mod} -> {target}")
    assert bad == []


def test_nothing_below_the_tools_imports_them():
    """Only the tools themselves, the CLI and the dry run (both entry points) import the tools."""
    entry_points = {"hyper_parallel.cli", "hyper_parallel.cli_tools", "hyper_parallel.dryrun"}
    bad = [f"{mod} -> {target}" for mod, targets in _edges().items() for target in targets
           if _part(target) == "tools" and _part(mod) != "tools" and mod not in entry_points
           and not mod.startswith(("hyper_parallel.demo", "hyper_parallel.measure"))]
    assert bad == []


def test_schedule_class_knows_no_feature_by_name():
    for mod in (f"{PP}.schedule", f"{PP}.zero_bubble_schedules"):
        assert not any(_part(t) in ("features", "tools") for t in _edges()[mod]), mod


def test_only_the_platform_imports_a_framework():
    bad = []
    for mod, path in MODULES.items():
        if mod.startswith(("hyper_parallel.platform", "hyper_parallel.demo")):
            continue
        for name, line in _imports(mod, path):
            if name.split(".")[0] in FRAMEWORKS:
                bad.append(f"{path}:{line} imports {name}")
    assert bad == []


def test_core_talks_to_a_framework_only_through_get_platform():
    """``core/`` may import ``hyper_parallel.platform`` (``get_platform()``, ``platform.base`` ...), never
    a backend package: that would tie a framework-neutral module to torch or MindSpore."""
    bad = []
    for mod, path in MODULES.items():
        if not mod.startswith("hyper_parallel.core"):
            continue
        for name, line in _imports(mod, path):
            if name.startswith(("hyper_parallel.platform.torch", "hyper_parallel.platform.mindspore")):
                bad.append(f"{path}:{line} imports {name}")
    assert bad == []


def test_folders_hold_one_role():
    """At most 14 modules a folder, and every sub-package says what lives there and what it may import."""
    root = os.path.join(LIB, "core", "pipeline_parallel")
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        modules = [f for f in files if f.endswith(".py") and f != "__init__.py"]
        assert len(modules) <= 14, (folder, len(modules))
        init = os.path.join(folder, "__init__.py")
        assert os.path.exists(init), folder
        doc = ast.get_docstring(ast.parse(open(init).read()))
        assert doc, init
        if folder != root and os.path.basename(folder) in ALLOWED:
            assert "May import" in doc, init


def test_moved_module_paths_still_import():
    """Each old flat path gives the very module at its new home (docs and user code import them)."""
    from hyper_parallel.core.pipeline_parallel import _moved_modules

    assert _moved_modules.MOVED
    for old, new in _moved_modules.MOVED.items():
        assert f"{PP}.{new}" in MODULES, new
        module = importlib.import_module(f"{PP}.{old}")
        assert module is importlib.import_module(f"{PP}.{new}"), old


@pytest.mark.parametrize("statement", [
    "from hyper_parallel.core.pipeline_parallel.simulate import simulate",
    "from hyper_parallel.core.pipeline_parallel.overlap import CommComputeOverlap",
    "from hyper_parallel.core.pipeline_parallel.split_layers import split_layers",
    "from hyper_parallel.core.pipeline_parallel.memory_stats import track_memory",
    "from hyper_parallel.core.pipeline_parallel.mpipe_model import compare_warmup",
    "from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType",
    "from hyper_parallel.core.pipeline_parallel.lowering import p2p",
    "from hyper_parallel.core.pipeline_parallel import lower, validate_lowered",
])
def test_documented_statements_import(statement):
    namespace: dict = {}
    exec(statement, namespace)  # noqa: S102 - the statement a user writes, verbatim
    assert len(namespace) > 1


def test_an_unregistered_feature_option_is_refused(monkeypatch):
    """swap=True with no swap feature registered fails loudly instead of running without swap."""
    from hyper_parallel.core.pipeline_parallel import schedule

    monkeypatch.setattr(schedule, "_FEATURES", {k: v for k, v in schedule._FEATURES.items() if k != "swap"})

    class Stub:  # only what _set_up_features reads
        pass

    with pytest.raises(RuntimeError, match="swap= needs a feature that runs it"):
        schedule.PipelineSchedule._set_up_features(Stub(), {"swap": True, "swap_threshold": 4})
    monkeypatch.setattr(schedule, "_FEATURES", {})  # nothing registered: options that are off need nothing
    schedule.PipelineSchedule._set_up_features(Stub(), {"swap": False, "swap_threshold": None,
                                                        "comm_compute_overlap": None})


def test_features_run_in_their_stated_order_whatever_the_registration_order(monkeypatch):
    """The compiled-stage check must see what swap set up: the order is stated, not the dict's."""
    from hyper_parallel.core.pipeline_parallel import schedule

    features = dict(reversed(list(schedule._FEATURES.items())))
    monkeypatch.setattr(schedule, "_FEATURES", features)
    seen = []
    for name in features:
        f = features[name]
        if f.setup is not None:
            monkeypatch.setitem(features, name, schedule._Feature(
                f.name, f.order, lambda sch, opts, name=name: seen.append(name), f.reader, f.options))
    schedule.PipelineSchedule._set_up_features(object(), {})
    assert seen == ["swap", "compiled_check", "overlap_step"]


def test_the_registry_survives_a_reload_of_the_schedule_module():
    """IPython's autoreload reloads modules: the features registered once must stay registered
    (in a fresh interpreter: a reload here would give this process's tests new class objects)."""
    code = ("import importlib\n"
            "from hyper_parallel.core.pipeline_parallel import schedule\n"
            "before = sorted(schedule._FEATURES)\n"
            "importlib.reload(schedule)\n"
            "print(before == sorted(schedule._FEATURES), 'swap' in before)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"]


def test_old_submodule_attributes_of_the_package():
    """``pp.stage``, ``pp.simulate`` ... (attributes of the package before the move) still answer."""
    import hyper_parallel.core.pipeline_parallel as pp
    from hyper_parallel.core.pipeline_parallel import _moved_modules

    for old, new in _moved_modules.MOVED.items():
        assert getattr(pp, old) is importlib.import_module(f"{PP}.{new}"), old
    with pytest.raises(AttributeError):
        pp.no_such_module  # noqa: B018


def test_an_old_path_import_leaves_the_module_its_own_spec():
    """Importing a module by its old name must not rename it: reload and tools read __spec__."""
    module = importlib.import_module(f"{PP}.simulate")
    assert module.__spec__.name == f"{PP}.simulation.simulate"
    assert module.__spec__.origin and module.__spec__.origin.endswith("simulation/simulate.py")
    # reload in a fresh interpreter (here it would give this process's tests new class objects)
    code = (f"import importlib\nm = importlib.import_module('{PP}.simulate')\n"
            "r = importlib.reload(m)\nprint(r is m, m.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", f"{PP}.simulation.simulate"]


def test_old_lowering_and_runtime_names_still_import():
    from hyper_parallel.core.pipeline_parallel.lowering import METADATA, TRANSPORTS, counterpart, lower, peer_rank  # noqa: F401
    from hyper_parallel.core.pipeline_parallel.runtime import (  # noqa: F401
        P2P_TYPES,
        CustomFunction,
        PeerError,
        PipelineRuntime,
        StageError,
        StepContext,
    )


def test_checker_sees_an_import_by_an_old_path():
    """A lazy import of a feature by its old flat path inside schedule.py is an upward edge too."""
    from hyper_parallel.core.pipeline_parallel._moved_modules import MOVED

    assert _resolve(f"{PP}.memory_stats") == f"{PP}.{MOVED['memory_stats']}"
    edges = _edges()
    edges[f"{PP}.schedule"] = edges[f"{PP}.schedule"] | {_resolve(f"{PP}.memory_stats")}
    assert _cycles(edges)
