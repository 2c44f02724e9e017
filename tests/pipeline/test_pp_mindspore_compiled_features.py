"""ScheduleMPipeTranspose and the activation features (swap, swap/checkpoint wrappers) with
compiled MindSpore stages, on LocalCluster(2).

* MPipe runs compiled: body stages and the preprocess go through ``ms.jit``; losses and every
  gradient (body and preprocess, on every rank) equal the non-pipelined MindSpore model, under
  GRAPH_MODE and in PyNative with ``HYPER_PARALLEL_MS_COMPILE=jit``.
* ``swap=True`` and ``swap_wrapper``/``checkpoint_wrapper`` cannot work in a compiled stage
  (measured: schedule swap swaps 0 bytes, a wrapped block fails to compile): the schedule refuses
  them at construction and again when a run starts; with ``HYPER_PARALLEL_MS_COMPILE=eager`` they
  run under GRAPH_MODE and match the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
from activation_harness import ActJob, run_act_job
from mpipe_harness import Case, check, run_case
from pp_harness import batch, check_against_oracle, full_model_oracle, merged, small_config

from hyper_parallel.platform.local import LocalCluster

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.timeout(300)
P = 2
SWAP = {"swap": True, "swap_threshold": 2}


@pytest.fixture(params=["graph", "jit"])
def setting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "jit":
        monkeypatch.setenv("HYPER_PARALLEL_MS_COMPILE", "jit")
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _run(setting: str, fn: Any, *args: Any) -> list[Any]:
    """``fn(*args)`` on P ranks, in GRAPH_MODE for the "graph" setting (the user's mode is kept)."""
    mode = ms.GRAPH_MODE if setting == "graph" else ms.PYNATIVE_MODE
    ms.set_context(mode=mode)
    try:
        results = LocalCluster(P, platform="mindspore").run(fn, *args)
        assert ms.get_context("mode") == mode
        return results
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


# ---------------------------------------------------------------------- MPipe, compiled
MPIPE = {  # setting -> case: the recompute backward (one chunk), and the owner backward (two chunks)
    "graph": Case("owner-interleaved-min-overflow", 2, 3, 1, owner_backward=True, overflow_mode="min"),
    "jit": Case("recompute-full-overflow", 1, 5, 1),
}


def test_mpipe_runs_compiled_and_matches_non_pipelined(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel.platform.mindspore import compiled

    routed: set[str] = set()
    original = compiled.compiled_call

    def recording(cell: Any) -> Any:
        routed.add(type(cell).__name__)
        return original(cell)

    monkeypatch.setattr(compiled, "compiled_call", recording)
    case = MPIPE[setting]
    check(case, _run(setting, run_case, case), "mindspore")  # body and preprocess gradients, every rank
    assert routed == {"Body", "Encoder"}, routed  # the body stages and the preprocess ran compiled


# ---------------------------------------------------------------------- activation features: refused
def _act_job(schedule: str, policy: str, options: dict[str, Any] | None = None) -> ActJob:
    config = small_config(n_layers=2)
    tokens, targets = batch(config, 4)
    return ActJob(schedule, 2, config, tokens, targets, layers=(1, 1), policy=policy, options=options or {})


def _build_or_refuse(job: ActJob, user_jit: bool = False) -> str:
    """Build ``job``'s schedule on this rank: "built", or the ValueError's message."""
    from activation_harness import build_stage_module
    from pp_harness import SCHEDULES, models

    from hyper_parallel import PipelineStage
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    mod = models("mindspore")
    module = build_stage_module(mod, job, p.rank, P, init_gpt_weights(job.config, 0))
    if user_jit:
        module = _jit_stage_class()(module)
    cls = SCHEDULES[job.schedule][0]
    try:
        cls(PipelineStage(module, p.rank, P), job.micro, loss_fn=mod.cross_entropy_loss, **job.options)
    except ValueError as exc:
        return str(exc)
    return "built"


EAGER_HINT = "HYPER_PARALLEL_MS_COMPILE=eager"


@functools.cache
def _jit_stage_class() -> Any:
    from mindspore import nn

    class JitStage(nn.Cell):
        """A stage whose construct the user compiled with ``@ms.jit``."""

        def __init__(self, inner: Any) -> None:
            super().__init__(auto_prefix=False)
            self.inner = inner

        @ms.jit
        def construct(self, *x: Any) -> Any:
            return self.inner(*x)

    return JitStage


def test_schedule_swap_is_refused_with_compiled_stages(setting: str) -> None:
    """Compiled, the stage keeps its activations inside the graph: schedule swap would swap nothing."""
    refused = _run(setting, _build_or_refuse, _act_job("1f1b", "plain", SWAP))
    why = "HYPER_PARALLEL_MS_COMPILE=" + ("auto, context GRAPH_MODE" if setting == "graph" else "jit")
    assert all(m.startswith("Schedule1F1B: swap=True needs stages that run op by op") and why in m
               and EAGER_HINT in m for m in refused), refused


@pytest.mark.parametrize(("setting", "policy", "named"), [
    ("graph", "swap", "blocks.{rank} (swap_wrapper)"),  # layers (1, 1): block r on rank r
    ("jit", "selective", "blocks.{rank} (checkpoint_wrapper)"),
    ("graph", "stage_checkpoint", "GPTStage (checkpoint_wrapper)"),  # the stage module itself
], indirect=["setting"])
def test_activation_wrappers_are_refused_with_compiled_stages(setting: str, policy: str, named: str) -> None:
    """A wrapped block makes the stage fail to compile (measured: "Parse Resolve convert failed" at
    the first forward); refused at construction instead, naming the stage and the module."""
    refused = _run(setting, _build_or_refuse, _act_job("gpipe", policy))
    for rank, message in enumerate(refused):
        assert f"ScheduleGPipe: stage {rank} holds modules wrapped by swap_wrapper/checkpoint_wrapper" in message
        assert named.format(rank=rank) in message and EAGER_HINT in message, message


def test_user_jit_stage_cells_refuse_swap_in_pynative() -> None:
    """The platform does not compile (PyNative, auto), but the user's @ms.jit stage Cell is compiled."""
    refused = _run("pynative", _build_or_refuse, _act_job("1f1b", "plain", SWAP), True)
    assert all("swap=True needs stages that run op by op, but JitStage (or a Cell inside it) has a construct "
               "compiled with @ms.jit" in m for m in refused), refused
    assert _run("pynative", _build_or_refuse, _act_job("1f1b", "swap")) == ["built", "built"]  # op by op: fine


def _mpipe_wrapped_preprocess() -> str:
    from mpipe_harness import mindspore_modules, mse

    from hyper_parallel import PipelineStage
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
    from hyper_parallel.core.pipeline_parallel.mpipe import ScheduleMPipeTranspose
    from hyper_parallel.platform import get_platform

    p = get_platform()
    encoder, bodies = mindspore_modules(P, 1, True)
    try:
        ScheduleMPipeTranspose(PipelineStage(bodies[p.rank], p.rank, P), 2, checkpoint_wrapper(encoder), 1,
                               loss_fn=mse)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_mpipe_refuses_a_wrapped_preprocess_in_graph_mode() -> None:
    refused = _run("graph", _mpipe_wrapped_preprocess)
    assert all(m.startswith("ScheduleMPipeTranspose: the MPipe preprocess holds modules wrapped") and
               "Encoder (checkpoint_wrapper)" in m for m in refused), refused


def _built_then_graph_mode(job: ActJob) -> str:
    """Build ``job``'s schedule in PyNative (accepted), switch the context to GRAPH_MODE, run it."""
    from pp_harness import SCHEDULES, models

    from hyper_parallel import PipelineStage
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    mod = models("mindspore")
    stage = PipelineStage(mod.GPTStage(job.config, p.rank, P, init_gpt_weights(job.config, 0)), p.rank, P)
    schedule = SCHEDULES[job.schedule][0](stage, job.micro, loss_fn=mod.cross_entropy_loss, **job.options)
    p.barrier()
    if p.rank == 0:
        ms.set_context(mode=ms.GRAPH_MODE)
    p.barrier()
    try:
        schedule.run(p.from_numpy(job.tokens), target=p.from_numpy(job.targets) if stage.is_last else None)
    except ValueError as exc:
        return str(exc)
    return "ran"


def test_swap_is_checked_again_when_a_run_starts() -> None:
    try:
        refused = LocalCluster(P, platform="mindspore").run(_built_then_graph_mode, _act_job("1f1b", "plain", SWAP))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert all("swap=True needs stages that run op by op" in m and "context GRAPH_MODE" in m for m in refused), \
        refused


# ---------------------------------------------------------------------- the remedy the errors name
def test_graph_mode_with_eager_stages_runs_wrappers_and_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRAPH_MODE with HYPER_PARALLEL_MS_COMPILE=eager: swapped and checkpointed blocks and schedule
    swap run op by op, exact against the non-pipelined model, and swap really moves activations."""
    monkeypatch.setenv("HYPER_PARALLEL_MS_COMPILE", "eager")
    config = small_config(n_layers=4)
    tokens, targets = batch(config, 4)
    job = ActJob("1f1b", 2, config, tokens, targets, layers=(2, 2), policy="mixed", options=SWAP)
    results = _run("graph", run_act_job, job)
    losses, grads = merged(results)
    ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    check_against_oracle("mindspore", losses[0], grads, ref_loss, ref_grads)
    assert results[0]["stats"]["swapped"] and results[0]["stats"]["late_loads"] == 0, results[0]["stats"]
