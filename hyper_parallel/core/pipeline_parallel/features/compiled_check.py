"""Activation features that need stages run op by op, refused where stages run compiled.

A stage compiled into one graph (MindSpore: ``GRAPH_MODE``, ``HYPER_PARALLEL_MS_COMPILE=jit``,
or a construct the user decorated with ``@ms.jit``) runs as one node of the autograd engine.
Two activation features cannot work there (measured on MindSpore 2.10, ``docs/mindspore.md``):

* ``swap=True``: the compiled node keeps its activations inside the graph, where saved-tensor
  hooks never see them. The run would give the right gradients and swap nothing (0 bytes).
* ``swap_wrapper`` / ``checkpoint_wrapper``: they replace a module's forward with Python code
  (saved-tensor hooks, a re-run in backward) that a graph cannot hold. Inside a compiled stage
  MindSpore fails to compile it at the first forward ("Parse Resolve convert failed").

So a schedule refuses them at construction (and again when a run or an ``eval`` starts: the
context may have been switched to ``GRAPH_MODE`` since) with a ``ValueError`` that says what and
why. Platforms that never compile stages (torch) pass every check. Where only a construct the user
decorated with ``@ms.jit`` is compiled, a wrapper is refused only on that Cell or inside it, and
``swap=True`` only when the stage Cell itself is compiled.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.pipeline_parallel.schedule import CheckBeforeRun, PipelineSchedule, register_feature

_EAGER = ("Set HYPER_PARALLEL_MS_COMPILE=eager (or MindSporePlatform(compile='eager')) to run the stages op "
          "by op, also under GRAPH_MODE")
_USER_JIT = ("HYPER_PARALLEL_MS_COMPILE=eager does not help here: MindSpore compiles a construct decorated with "
             "@ms.jit whatever the platform does. Remove @ms.jit from the stage Cell's construct")
_USER_JIT_WRAP = (_USER_JIT.replace("the stage Cell's construct", "those constructs") +
                  ", or wrap Cells outside them (a wrapper around a Cell that holds an @ms.jit Cell runs op by op)")


def _modules(schedule: PipelineSchedule) -> list[tuple[str, Any]]:
    out = [(f"stage {st.stage_index}", st.submodule) for st in schedule.stages]
    preprocess = getattr(schedule, "preprocess_module", None)  # ScheduleMPipeTranspose
    if preprocess is not None:
        out.append(("the MPipe preprocess", preprocess))
    return out


def _inside(name: str, compiled: list[str]) -> bool:
    """Whether the module at dotted ``name`` is one of ``compiled`` or inside one of them."""
    return any(c == "" or name == c or name.startswith(c + ".") for c in compiled)


def _label(name: str, module: Any) -> str:
    return name or type(module).__name__


def check_activation_features(schedule: PipelineSchedule, forward_only: bool = False) -> None:
    """Raise ValueError when ``swap=True`` or an activation wrapper meets a compiled stage.

    ``forward_only`` (eval): only the wrappers matter, swap has nothing to do without a backward.
    A construct the user compiled with ``@ms.jit`` (the platform itself compiling nothing) is
    compiled alone: wrappers on Cells outside it, or around a Cell holding it, run op by op and
    work; ``swap=True`` is refused only when the stage Cell itself is compiled (with a part of it
    compiled, the rest is swapped).
    """
    p = schedule.platform
    name = type(schedule).__name__
    swap = not forward_only and getattr(schedule, "swap_hook", None) is not None
    platform_why = p.compiled_stages()  # the platform compiles every stage: everything is refused
    for where, module in _modules(schedule):
        compiled = [""] if platform_why is not None else p.user_compiled_modules(module)
        if not compiled:
            continue
        if platform_why is not None:
            why, remedy, wrap_remedy = platform_why, _EAGER, _EAGER
        else:
            jit = ", ".join(_label(c, module) for c in compiled[:4]) + (" and more" if len(compiled) > 4 else "")
            why = f"{jit} {'has a construct' if len(compiled) == 1 else 'have constructs'} compiled with @ms.jit"
            remedy, wrap_remedy = _USER_JIT, _USER_JIT_WRAP
        if swap and "" in compiled:
            raise ValueError(
                f"{name}: swap=True needs stages that run op by op, but {p.compiled_stages(module)}. A compiled stage keeps its "
                "activations inside the graph, where the saved-tensor hooks of swap never see them: nothing "
                f"would be swapped. {remedy}, or drop swap=True"
            )
        wrapped = [(n, kind) for n, kind in p.saved_tensors().wrapped_modules(module) if _inside(n, compiled)]
        if wrapped:
            listed = ", ".join(f"{_label(n, module)} ({kind})" for n, kind in wrapped[:4])
            more = f" and {len(wrapped) - 4} more" if len(wrapped) > 4 else ""
            raise ValueError(
                f"{name}: {where} holds modules wrapped by swap_wrapper/checkpoint_wrapper: {listed}{more}. "
                f"These wrappers need stages that run op by op, but {why}. They replace a module's forward "
                "with Python code (saved-tensor hooks, a re-run in backward) that a compiled graph cannot "
                "hold: wrapped inside a compiled stage, the compile fails at the first forward; the stage "
                f"module itself wrapped would not be compiled at all. {wrap_remedy}, or remove the wrappers"
            )


class _ActivationCheck(CheckBeforeRun):
    """The check before every training run, and its forward-only form before every ``eval``."""

    def before_eval(self, schedule: PipelineSchedule) -> None:
        check_activation_features(schedule, forward_only=True)


def enable_activation_check(schedule: PipelineSchedule) -> None:
    """Check now and before every run (first: refuse before any other feature prepares the run)."""
    check_activation_features(schedule)
    schedule.add_feature(hook=_ActivationCheck(check_activation_features), hook_first=True)


def register() -> None:
    """Check every schedule built from now on (``features/__init__`` calls this)."""
    # after swap (order 10): it refuses swap=True where stages compile, reading what swap set up
    register_feature("compiled_check", lambda schedule, options: enable_activation_check(schedule), order=20)
