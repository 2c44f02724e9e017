"""Activation features that need stages run op by op, refused where stages run compiled.

A stage compiled into one graph (MindSpore: ``GRAPH_MODE``, ``HYPER_PARALLEL_MS_COMPILE=jit``,
or a construct the user decorated with ``@ms.jit``) runs as one node of the autograd engine.
Two activation features cannot work there (measured on MindSpore 2.10, ``docs/mindspore.md``):

* ``swap=True``: the compiled node keeps its activations inside the graph, where saved-tensor
  hooks never see them. The run would give the right gradients and swap nothing (0 bytes).
* ``swap_wrapper`` / ``checkpoint_wrapper``: they replace a module's forward with Python code
  (saved-tensor hooks, a re-run in backward) that a graph cannot hold. Inside a compiled stage
  MindSpore fails to compile it at the first forward ("Parse Resolve convert failed").

So a schedule refuses them at construction (and again when a run starts: the context may have
been switched to ``GRAPH_MODE`` since) with a ``ValueError`` that says what and why. Platforms
that never compile stages (torch) pass every check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyper_parallel.core.pipeline_parallel.runtime import PipelineRuntime
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule

_EAGER = ("Set HYPER_PARALLEL_MS_COMPILE=eager (or MindSporePlatform(compile='eager')) to run the stages op "
          "by op, also under GRAPH_MODE")


def _modules(schedule: PipelineSchedule) -> list[tuple[str, Any]]:
    out = [(f"stage {st.stage_index}", st.submodule) for st in schedule.stages]
    preprocess = getattr(schedule, "preprocess_module", None)  # ScheduleMPipeTranspose
    if preprocess is not None:
        out.append(("the MPipe preprocess", preprocess))
    return out


def check_activation_features(schedule: PipelineSchedule) -> None:
    """Raise ValueError when ``swap=True`` or an activation wrapper meets a compiled stage."""
    p = schedule.platform
    name = type(schedule).__name__
    swap = getattr(schedule, "swap_hook", None) is not None
    for where, module in _modules(schedule):
        why = p.compiled_stages(module)
        if why is None:
            continue
        if swap:
            raise ValueError(
                f"{name}: swap=True needs stages that run op by op, but {why}. A compiled stage keeps its "
                "activations inside the graph, where the saved-tensor hooks of swap never see them: nothing "
                f"would be swapped. {_EAGER}, or drop swap=True"
            )
        wrapped = p.saved_tensors().wrapped_modules(module)
        if wrapped:
            listed = ", ".join(f"{n or type(module).__name__} ({kind})" for n, kind in wrapped[:4])
            more = f" and {len(wrapped) - 4} more" if len(wrapped) > 4 else ""
            raise ValueError(
                f"{name}: {where} holds modules wrapped by swap_wrapper/checkpoint_wrapper: {listed}{more}. "
                f"These wrappers need stages that run op by op, but {why}. They replace a module's forward "
                "with Python code (saved-tensor hooks, a re-run in backward) that a compiled graph cannot "
                "hold: wrapped inside a compiled stage, the compile fails at the first forward; the stage "
                f"module itself wrapped would not be compiled at all. {_EAGER}, or remove the wrappers"
            )


def _hook() -> Any:
    from hyper_parallel.core.pipeline_parallel.schedule import RunHook

    class ActivationFeaturesCheck(RunHook):
        """The context may have changed since construction (say to GRAPH_MODE): check again."""

        def before_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
            check_activation_features(schedule)

    return ActivationFeaturesCheck()


def enable_activation_check(schedule: PipelineSchedule) -> None:
    """Check now and before every run."""
    check_activation_features(schedule)
    schedule._run_hooks.insert(0, _hook())  # first: refuse before any other feature prepares the run
