"""Profiler: measure the F, B, I, W times and memory of real stage modules -> a costs file.

`profile_stages` runs every stage, in pipeline order, on one sample micro-batch through the
platform's stage autograd API (``stage_forward``, ``stage_backward``, ``stage_backward_input``,
``stage_backward_weight``), so what it times is what the runtime runs, on either framework.
Each stage's input is the previous stage's output. Per stage and step type it keeps the median
wall time (``platform.synchronize()`` before each clock reading) of ``repeats`` runs after
``warmup`` runs. Output gradients are ones (their values do not change the work).

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

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .costs import CostModel, StageCost


@dataclass
class ProfileResult:
    """The measured cost model and what could not be measured (``notes``)."""

    costs: CostModel
    notes: list[str] = field(default_factory=list)
    raw_ms: list[dict[str, list[float]]] = field(default_factory=list)


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


def _run_stage(platform: Any, fn: Callable[..., Any], args: tuple[Any, ...], params: list[Any], first: bool,
               reps: int, warmup: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time F, B, I, W of one stage; return the times and (output, kept bytes) facts."""
    from hyper_parallel.platform.memory import saved_activation_bytes

    timer = _Timer(platform)
    grad_args = tuple(not first and _differentiable(platform, a) for a in args)
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    facts: dict[str, Any] = {}
    for k in range(warmup + reps):
        keep = k >= warmup
        record, t_f = timer(lambda: platform.stage_forward(fn, args, {}, params, grad_args))
        if "outputs" not in facts:
            facts["outputs"] = tuple(platform.detach(o) if platform.is_tensor(o) else o for o in record.outputs)
            facts["saved"] = saved_activation_bytes(platform, record)
        grads = [platform.ones_like(o) if _differentiable(platform, o) and platform.requires_grad(o) else None
                 for o in record.outputs]
        _, t_b = timer(lambda: platform.stage_backward(record, grads))
        record, t_f2 = timer(lambda: platform.stage_forward(fn, args, {}, params, grad_args))
        _, t_i = timer(lambda: platform.stage_backward_input(record, grads))
        if "saved_after_input" not in facts:
            facts["saved_after_input"] = saved_activation_bytes(platform, record)
        _, t_w = timer(lambda: platform.stage_backward_weight(record))
        if keep:
            times["F"] += [t_f, t_f2]
            times["B"].append(t_b)
            times["I"].append(t_i)
            times["W"].append(t_w)
    return times, facts


def profile_stages(
    stages: Sequence[Any],
    sample: Any,
    *,
    platform: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    target: Any = None,
    warmup: int = 1,
    repeats: int = 3,
    fit_overhead: bool = True,
) -> ProfileResult:
    """Measure every stage module (see the module docstring). ``sample`` is the first stage's
    positional input for one micro-batch (a tensor or a tuple); with ``loss_fn`` the last stage
    runs ``loss_fn(output, target)``, else its output is treated as the loss."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.memory import tensor_bytes

    if not stages:
        raise ValueError("profile_stages needs at least one stage module")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'warmup' else 1}, got {value!r}")
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
    entries, raw = [], []
    half_args = _half(platform, args, size) if halves else None
    half_target = platform.chunk(target, 2, 0)[0] if halves and platform.is_tensor(target) else target
    try:
        for s, module in enumerate(stages):
            last = s == len(stages) - 1
            params = [p for _, p in platform.named_parameters(module)]

            def stage_fn(*a: Any, _m: Any = module, _t: Any = target, _last: bool = last) -> Any:
                out = _m(*a)
                return loss_fn(out, _t) if _last and loss_fn is not None else out

            times, facts = _run_stage(platform, stage_fn, args, params, s == 0, repeats, warmup)
            medians = {k: statistics.median(v) for k, v in times.items()}
            overhead = 0.0
            if half_args is not None:

                def half_fn(*a: Any, _m: Any = module, _t: Any = half_target, _last: bool = last) -> Any:
                    out = _m(*a)
                    return loss_fn(out, _t) if _last and loss_fn is not None else out

                half_times, half_facts = _run_stage(platform, half_fn, half_args, params, s == 0, repeats, warmup)
                intercepts = [2 * statistics.median(half_times[k]) - medians[k] for k in medians]
                overhead = min(max(0.0, statistics.mean(intercepts)), min(medians.values()))
                half_args = tuple(half_facts["outputs"])
            saved, after = facts["saved"], facts["saved_after_input"]
            if saved is None and s == 0:
                notes.append(f"activation bytes are not measured on the {platform.name} platform (left at 0)")
            outputs = facts["outputs"]
            entries.append(StageCost(
                F=medians["F"], B=medians["B"], I=medians["I"], W=medians["W"],
                activation_bytes=float(saved or 0), activation_bytes_after_input=float(after or 0) if saved else None,
                output_bytes=0.0 if last else float(tensor_bytes(platform, outputs)),
                param_bytes=float(sum(tensor_bytes(platform, p) for p in params)), overhead_ms=overhead,
            ))
            raw.append(times)
            args = tuple(outputs)
    finally:
        for param, grad in zip(all_params, earlier, strict=True):
            platform.set_grad(param, grad)
    return ProfileResult(CostModel(stages=tuple(entries), micro_batch_size=size), notes, raw)
