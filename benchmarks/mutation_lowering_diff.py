"""Does a surviving ``lowering.py`` mutant change what ``lower()`` returns anywhere?

For each mutant key given, lowers every built-in schedule over a grid (p, v, m, transport,
metadata mode, prefetch) with the original and with the mutated module and prints the first
case where the lowered step lists differ (or the mutant raises), or ``same on N cases``: the
evidence behind marking a lowering survivor equivalent in ``mutation_audit_notes.json``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/mutation_lowering_diff.py KEY [KEY ...]
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mutation_audit as ma  # noqa: E402

from hyper_parallel.core.pipeline_parallel import lowering  # noqa: E402
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement  # noqa: E402
from hyper_parallel.core.pipeline_parallel.schedules import (  # noqa: E402
    generate_1f1b,
    generate_dualpipe_v,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_interleaved_zero_bubble,
    generate_looped_bfs,
    generate_zbv_zero_bubble,
)


def cases():
    for p in (2, 3):
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p + 1} - {0}):
            yield f"gpipe p{p} m{m}", generate_gpipe(p, m), looped_placement(p, 1)
            yield f"1f1b p{p} m{m}", generate_1f1b(p, m), looped_placement(p, 1)
            yield f"interleaved p{p} v2 m{m}", generate_interleaved_1f1b(p, 2, m), looped_placement(p, 2)
            yield f"looped p{p} v2 m{m}", generate_looped_bfs(p, 2, m), looped_placement(p, 2)
            yield f"izb p{p} v2 m{m}", generate_interleaved_zero_bubble(p, 2, m), looped_placement(p, 2)
            yield f"zbv p{p} m{m}", generate_zbv_zero_bubble(p, m), v_placement(p)
            if m >= 2 * p:
                yield f"dualpipev p{p} m{m}", generate_dualpipe_v(p, m), v_placement(p)


def mutant_module(key: str) -> types.ModuleType:
    site = next(s for s in ma.find_sites(f"{ma.PP}/lowering/p2p.py") if s.key == key)
    spec = importlib.util.spec_from_loader("hyper_parallel.core.pipeline_parallel._lowering_mutant", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hyper_parallel.core.pipeline_parallel"
    sys.modules[spec.name] = mod
    exec(ma.mutate(site), mod.__dict__)  # noqa: S102
    return mod


def compare(key: str) -> str:
    mutant = mutant_module(key)
    n = 0
    for (name, compute, placement), transport, metadata, prefetch in itertools.product(
            list(cases()), ("plain", "batch"), ("none", "first", "all"), (False, True)):
        args = (compute, placement, transport)
        kw = dict(metadata=metadata, prefetch=prefetch)
        want = lowering.lower(*args, **kw)
        try:
            got = mutant.lower(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            return f"differs: {name} {transport} metadata={metadata} prefetch={prefetch}: raises {exc!r}"
        if got != want:
            return f"differs: {name} {transport} metadata={metadata} prefetch={prefetch}"
        n += 1
    return f"same on {n} cases"


if __name__ == "__main__":
    for key in sys.argv[1:]:
        print(key, compare(key), flush=True)
