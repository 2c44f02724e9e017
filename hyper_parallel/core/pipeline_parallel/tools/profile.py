"""Profiler: measure the F, B, I, W times and memory of real stage modules -> a costs file.

`profile_stages` runs every stage, in pipeline order, on one sample micro-batch through the
platform's stage autograd API (``stage_forward``, ``stage_backward``, ``stage_backward_input``,
``stage_backward_weight``), so what it times is what the runtime runs, on either framework.
Each stage's input is the previous stage's output (one untimed pass makes them). Output
gradients are ones (their values do not change the work).

Robust timing: ``warmup`` untimed and ``repeats`` timed rounds, each round running every stage
once in turn (a burst of load on a busy machine then hits all stages alike instead of the one
being measured). Per stage and step type the time is the median of the repeats (wall time,
``platform.synchronize()`` before each clock reading); its spread is the median absolute
deviation relative to the median. ``threads`` sets the framework's CPU thread count for the
measurement (restored afterwards; the count used is in ``ProfileResult.threads``). The result
warns (``ProfileResult.warnings``) when a step type's repeats spread more than ``max_spread``,
or when identical stages (same module type, parameter shapes, input shapes and position
role) have medians further apart than ``max_spread`` of the smaller: their costs cannot be
trusted; rerun with more repeats, fewer threads, or on a quieter machine.

Also measured: ``output_bytes`` (the forward output, i.e. the message to the next stage),
``param_bytes``, and where the backend can tell (torch; not MindSpore) ``activation_bytes``
(what the forward saved for the backward, parameters excluded) and
``activation_bytes_after_input`` (what is still saved between I and W).

With ``fit_overhead`` (and an even micro-batch) every stage also runs on half the micro-batch;
``overhead_ms`` is the intercept ``2 t(b/2) - t(b)`` averaged over the step types and clipped to
``[0, shortest step]``: the part of a step time that does not shrink with the micro-batch, which
`CostModel.for_micro_batch_size` keeps fixed when the tuner tries other micro-batch sizes.

The gradients the profile accumulates are removed again (every parameter's gradient is what it
was before).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost


STEPS = ("F", "B", "I", "W")
MAX_SPREAD = 0.25
"""Default ``max_spread``: repeats (or identical stages) further apart than 25 % are warned about."""


@dataclass
class ProfileResult:
    """The measured cost model, what could not be measured (``notes``), what should not be
    trusted (``warnings``), every timed run (``raw_ms``, per stage and step type), the relative
    spread of each median (``spread``) and the CPU thread count measured with (``threads``)."""

    costs: CostModel
    notes: list[str] = field(default_factory=list)
    raw_ms: list[dict[str, list[float]]] = field(default_factory=list)
    spread: list[dict[str, float]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    threads: int | None = None


def _as_args(sample: Any) -> tuple[Any, ...]:
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def _batch_size(platform: Any, args: Sequence[Any]) -> int | None:
    for a in args:
        if platform.is_tensor(a) and len(platform.shape(a)) > 0:
            return int(platform.shape(a)[0])
    return None


def _half(platform: Any, args: Sequence[Any], size: int) -> tuple[Any, ...]:
    return tuple(platform.chunk(a, 2, 0)[0] if platform.is_tensor(a) and platform.shape(a)[:1] == (size,) else a
                 for a in args)


class _Timer:
    def __init__(self, platform: Any) -> None:
        self.platform = platform

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.platform.synchronize()
        t0 = time.perf_counter()
        out = fn()
        self.platform.synchronize()
        return out, (time.perf_counter() - t0) * 1e3


def _differentiable(platform: Any, value: Any) -> bool:
    return platform.is_tensor(value) and platform.is_floating(value)


@dataclass
class _Stage:
    """One stage as the profiler runs it: the function, its input, its parameters."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    params: list[Any]
    grad_args: tuple[bool, ...]
    times: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in STEPS})
    facts: dict[str, Any] = field(default_factory=dict)


def _run_once(platform: Any, timer: _Timer, st: _Stage) -> dict[str, list[float]]:
    """F, B, then F, I, W of one stage once: the times, and on the first run its facts."""
    from hyper_parallel.platform.memory import saved_activation_bytes

    record, t_f = timer(lambda: platform.stage_forward(st.fn, st.args, {}, st.params, st.grad_args))
    if "outputs" not in st.facts:
        st.facts["outputs"] = tuple(platform.detach(o) if platform.is_tensor(o) else o for o in record.outputs)
        st.facts["saved"] = saved_activation_bytes(platform, record)
    grads = [platform.ones_like(o) if _differentiable(platform, o) and platform.requires_grad(o) else None
             for o in record.outputs]
    _, t_b = timer(lambda: platform.stage_backward(record, grads))
    record, t_f2 = timer(lambda: platform.stage_forward(st.fn, st.args, {}, st.params, st.grad_args))
    _, t_i = timer(lambda: platform.stage_backward_input(record, grads))
    if "saved_after_input" not in st.facts:
        st.facts["saved_after_input"] = saved_activation_bytes(platform, record)
    _, t_w = timer(lambda: platform.stage_backward_weight(record))
    return {"F": [t_f, t_f2], "B": [t_b], "I": [t_i], "W": [t_w]}


def _measure(platform: Any, stages: list[Any], fns: list[Callable[..., Any]], args: tuple[Any, ...],
             warmup: int, repeats: int) -> list[_Stage]:
    """Chain the stages once (each one's input is the previous one's output), then run
    ``warmup + repeats`` rounds over all stages, keeping the times of the last ``repeats``."""
    timer = _Timer(platform)
    runs = []
    for s, (module, fn) in enumerate(zip(stages, fns)):
        grad_args = tuple(s > 0 and _differentiable(platform, a) for a in args)
        st = _Stage(fn, args, [p for _, p in platform.named_parameters(module)], grad_args)
        _run_once(platform, timer, st)  # untimed: makes the next stage's input and this one's facts
        runs.append(st)
        args = tuple(st.facts["outputs"])
    for k in range(warmup + repeats):
        for st in runs:
            times = _run_once(platform, timer, st)
            if k >= warmup:
                for key, values in times.items():
                    st.times[key] += values
    return runs


def _spread(values: list[float]) -> float:
    """Median absolute deviation relative to the median (0 for one value)."""
    mid = statistics.median(values)
    if len(values) < 2 or mid <= 0:
        return 0.0
    return statistics.median(abs(v - mid) for v in values) / mid


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timing_caveat(*samples: Sequence[float], processes: int | None = None, cores: int | None = None,
                  load: float | None = None, max_spread: float = MAX_SPREAD) -> str | None:
    """A line to print under times measured on this host when the host is too loaded for them to mean
    much, else None. The reasons it names:

    - more processes of this job on the host (``processes``, default ``LOCAL_WORLD_SIZE`` as set by
      torchrun, else 1) than CPU cores this process may use (``cores``): the ranks take turns, and a
      time measures the turn-taking;
    - a 1-minute load average (``load``, default ``os.getloadavg()``) above the cores: other work competes;
    - a series of repeats (each of ``samples``, three or more) whose median absolute deviation is more
      than ``max_spread`` of its median (as the profiler warns).
    """
    cores = _usable_cores() if cores is None else cores
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if load is None and hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
    reasons = []
    if processes > cores:
        reasons.append(f"{processes} processes share {cores} CPU core(s)")
    if load is not None and load > cores:
        reasons.append(f"the load average is {load:.1f} on {cores} core(s)")
    spreads = [_spread(list(series)) for series in samples if len(series) >= 3]
    if spreads and max(spreads) > max_spread:
        reasons.append(f"repeats spread {max(spreads):.0%} around their median")
    if not reasons:
        return None
    return f"caveat: {', '.join(reasons)}: these times say more about this machine's load than about the pipeline"


def _signature(platform: Any, module: Any, args: tuple[Any, ...], first: bool, last: bool) -> Any:
    """What makes two stages the same work: module type and structure (its ``repr``: submodules
    without parameters, such as activations, and their settings), parameter shapes and dtypes,
    input shapes and whether the stage is the first (no input gradient) or the last (the loss)."""
    params = tuple((name, tuple(platform.shape(p)), platform.dtype_name(p))
                   for name, p in platform.named_parameters(module))
    shapes = tuple(tuple(platform.shape(a)) if platform.is_tensor(a) else repr(a) for a in args)
    return type(module).__name__, repr(module), params, shapes, first, last


def _warnings(medians: list[dict[str, float]], spreads: list[dict[str, float]], signatures: list[Any],
              max_spread: float, repeats: int) -> list[str]:
    out = []
    for s, spread in enumerate(spreads):
        bad = [f"{k} {spread[k]:.0%}" for k in STEPS if spread[k] > max_spread]
        if bad:
            out.append(f"stage {s}: the {repeats} repeats spread beyond {max_spread:.0%} of their median "
                       f"({', '.join(bad)}): the machine is busy or the thread count too high; these times "
                       "cannot be trusted")
    groups: dict[Any, list[int]] = {}
    for s, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(s)
    for same in groups.values():
        if len(same) < 2:
            continue
        for k in STEPS:
            low = min(same, key=lambda s: medians[s][k])
            high = max(same, key=lambda s: medians[s][k])
            if medians[low][k] > 0 and medians[high][k] > (1 + max_spread) * medians[low][k]:
                out.append(f"identical stages {low} and {high} differ beyond {max_spread:.0%} in {k}: "
                           f"{medians[low][k]:.4g} ms vs {medians[high][k]:.4g} ms; these times cannot be trusted")
    return out


def profile_stages(
    stages: Sequence[Any],
    sample: Any,
    *,
    platform: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    target: Any = None,
    warmup: int = 1,
    repeats: int = 5,
    fit_overhead: bool = True,
    threads: int | None = None,
    max_spread: float = MAX_SPREAD,
) -> ProfileResult:
    """Measure every stage module (see the module docstring). ``sample`` is the first stage's
    positional input for one micro-batch (a tensor or a tuple); with ``loss_fn`` the last stage
    runs ``loss_fn(output, target)``, else its output is treated as the loss. ``threads``: the
    CPU thread count to measure with (None: the framework's current one)."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.memory import tensor_bytes
    from hyper_parallel.platform.threads import num_threads, set_num_threads

    if not stages:
        raise ValueError("profile_stages needs at least one stage module")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'warmup' else 1}, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    if isinstance(max_spread, bool) or not isinstance(max_spread, (int, float)) or not max_spread > 0:
        raise ValueError(f"max_spread must be a number > 0, got {max_spread!r}")
    if loss_fn is not None and target is None:
        raise ValueError("loss_fn needs a target")
    platform = platform or get_platform()
    args = _as_args(sample)
    size = _batch_size(platform, args)
    notes: list[str] = []
    halves = fit_overhead and size is not None and size >= 2 and size % 2 == 0
    if fit_overhead and not halves:
        notes.append(f"overhead_ms not fitted: the micro-batch size {size} is not even")
    all_params = [p for module in stages for _, p in platform.named_parameters(module)]
    earlier = [platform.get_grad(p) for p in all_params]
    half_target = platform.chunk(target, 2, 0)[0] if halves and platform.is_tensor(target) else target
    before = num_threads(platform.name)
    if threads is not None:
        why = set_num_threads(platform.name, threads)
        if why is not None:
            notes.append(f"threads not set: {why}")
    used = num_threads(platform.name)

    def stage_fn(module: Any, last: bool, tgt: Any) -> Callable[..., Any]:
        def fn(*a: Any) -> Any:
            out = module(*a)
            return loss_fn(out, tgt) if last and loss_fn is not None else out

        return fn

    n = len(stages)
    try:
        runs = _measure(platform, list(stages), [stage_fn(m, s == n - 1, target) for s, m in enumerate(stages)],
                        args, warmup, repeats)
        halves_run = (_measure(platform, list(stages),
                               [stage_fn(m, s == n - 1, half_target) for s, m in enumerate(stages)],
                               _half(platform, args, size), warmup, repeats) if halves else None)
    finally:
        for param, grad in zip(all_params, earlier, strict=True):
            platform.set_grad(param, grad)
        if threads is not None and before is not None and before != used:
            set_num_threads(platform.name, before)
    entries, medians, spreads, signatures = [], [], [], []
    for s, (module, st) in enumerate(zip(stages, runs)):
        last = s == n - 1
        mid = {k: statistics.median(v) for k, v in st.times.items()}
        medians.append(mid)
        spreads.append({k: _spread(v) for k, v in st.times.items()})
        signatures.append(_signature(platform, module, st.args, s == 0, last))
        overhead = 0.0
        if halves_run is not None:
            intercepts = [2 * statistics.median(halves_run[s].times[k]) - mid[k] for k in mid]
            overhead = min(max(0.0, statistics.mean(intercepts)), min(mid.values()))
        saved, after = st.facts["saved"], st.facts["saved_after_input"]
        if saved is None and s == 0:
            notes.append(f"activation bytes are not measured on the {platform.name} platform (left at 0)")
        entries.append(StageCost(
            F=mid["F"], B=mid["B"], I=mid["I"], W=mid["W"],
            activation_bytes=float(saved or 0), activation_bytes_after_input=float(after or 0) if saved else None,
            output_bytes=0.0 if last else float(tensor_bytes(platform, st.facts["outputs"])),
            param_bytes=float(sum(tensor_bytes(platform, p) for p in st.params)), overhead_ms=overhead,
        ))
    return ProfileResult(CostModel(stages=tuple(entries), micro_batch_size=size), notes,
                         [st.times for st in runs], spreads, _warnings(medians, spreads, signatures, max_spread,
                                                                        repeats), used)
