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

import numpy as np
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
    assert all("swap=True needs stages that run op by op, but JitStage has a construct compiled with @ms.jit" in m
               and "HYPER_PARALLEL_MS_COMPILE=eager does not help" in m for m in refused), refused
    assert _run("pynative", _build_or_refuse, _act_job("1f1b", "swap")) == ["built", "built"]  # op by op: fine


# ------------------------------------------------------- the user's @ms.jit: only that Cell is compiled
W = 4


@functools.cache
def _mixed_classes() -> tuple[Any, Any]:
    """``Mixed``: a stage Cell whose ``j`` is an @ms.jit Cell and whose ``plain`` runs op by op."""
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self, seed: int) -> None:
            super().__init__()
            rng = np.random.default_rng(seed)
            self.w = ms.Parameter(ms.Tensor((rng.standard_normal((W, W)) * 0.5).astype(np.float32)), name=f"w{seed}")

        def construct(self, x: Any) -> Any:
            return ops.tanh(ops.matmul(x, self.w))

    class Mixed(nn.Cell):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.j = _jit_stage_class()(Block(rank))
            self.plain = Block(rank + 10)

        def construct(self, x: Any) -> Any:
            return self.plain(self.j(x))

    return Block, Mixed


def _mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def _xy() -> tuple[Any, Any]:
    x = np.linspace(-1, 1, 8 * W).reshape(8, W).astype(np.float32)
    return ms.Tensor(x), ms.Tensor(np.flip(x, 0).copy())


def _mixed_run(wrap: str, options: dict[str, Any]) -> Any:
    """One 1F1B run of two ``Mixed`` stages, ``wrap`` ("", "plain", "j", "stage") wrapped by
    checkpoint_wrapper: losses, gradients and swapped bytes, or the ValueError's message."""
    from hyper_parallel import PipelineStage, Schedule1F1B
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
    from hyper_parallel.platform import get_platform

    p = get_platform()
    stage = _mixed_classes()[1](p.rank)
    if wrap:
        checkpoint_wrapper(stage if wrap == "stage" else getattr(stage, wrap))
    try:
        schedule = Schedule1F1B(PipelineStage(stage, p.rank, P), 4, loss_fn=_mse, **options)
    except ValueError as exc:
        return str(exc)
    x, y = _xy()
    losses = schedule.run(x if p.rank == 0 else None, target=y if p.rank == 1 else None)
    swapped = schedule.swap_hook.last.swapped_bytes if options.get("swap") else None
    return [float(v.asnumpy()) for v in losses], [p.get_grad(q).asnumpy() for q in stage.trainable_params()], swapped


def _mixed_oracle() -> tuple[float, list[list[np.ndarray]]]:
    """The loss and, per rank, the gradients of its stage's parameters, without a pipeline."""
    from mindspore import nn

    mixed = _mixed_classes()[1]
    net = nn.SequentialCell([mixed(0), mixed(1)])
    params = net.trainable_params()
    x, y = _xy()
    loss, grads = ms.value_and_grad(lambda a, b: _mse(net(a), b), None, params)(x, y)
    per_rank = len(params) // P
    return float(loss.asnumpy()), [[g.asnumpy() for g in grads[r * per_rank:(r + 1) * per_rank]] for r in range(P)]


@pytest.mark.parametrize(("wrap", "options"), [("plain", {}), ("stage", {}), ("", SWAP)])
def test_user_jit_cell_leaves_the_rest_of_the_stage_to_wrappers_and_swap(wrap: str, options: dict[str, Any]) -> None:
    """PyNative: MindSpore compiles only ``j``. A wrapper on a Cell outside it, or around the stage
    Cell holding it, runs op by op; swap swaps what runs op by op. Exact against the non-pipelined model."""
    results = _run("pynative", _mixed_run, wrap, options)
    ref_loss, ref_grads = _mixed_oracle()
    assert all(not isinstance(r, str) for r in results), results
    np.testing.assert_allclose(np.mean(results[1][0]), ref_loss, rtol=1e-6)
    for rank, (_, grads, _) in enumerate(results):
        assert len(grads) == len(ref_grads[rank]) == 2
        for grad, ref in zip(grads, ref_grads[rank]):
            np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-6)
    if options:
        assert results[0][2] > 0, results  # rank 0 keeps micro-batches in flight: swapped


@pytest.mark.parametrize("compile_mode", ["auto", "eager"])
def test_a_wrapped_user_jit_cell_is_refused_without_pointing_to_eager(compile_mode: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper replaced the @ms.jit construct of ``j`` (it would fail to compile at the first
    forward, measured); ``HYPER_PARALLEL_MS_COMPILE=eager`` cannot help a construct the user compiled."""
    monkeypatch.setenv("HYPER_PARALLEL_MS_COMPILE", compile_mode)
    refused = _run("pynative", _mixed_run, "j", {})
    for rank, message in enumerate(refused):
        assert isinstance(message, str), message
        assert message.startswith(f"Schedule1F1B: stage {rank} holds modules wrapped by swap_wrapper/"
                                  "checkpoint_wrapper: j (checkpoint_wrapper)"), message
        assert "but j has a construct compiled with @ms.jit" in message, message
        assert "HYPER_PARALLEL_MS_COMPILE=eager does not help" in message, message
        assert "Set HYPER_PARALLEL_MS_COMPILE=eager" not in message, message


def _mpipe_wrapped_preprocess() -> str:
    from mpipe_harness import mindspore_modules, mse

    from hyper_parallel import PipelineStage
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
    from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
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


def _built_then_graph_mode_eval(job: ActJob, with_loss: bool) -> str:
    """Build ``job``'s schedule (wrapped blocks) in PyNative, switch to GRAPH_MODE, eval() it."""
    from activation_harness import build_stage_module
    from pp_harness import SCHEDULES, models

    from hyper_parallel import PipelineStage
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    mod = models("mindspore")
    stage = PipelineStage(build_stage_module(mod, job, p.rank, P, init_gpt_weights(job.config, 0)), p.rank, P)
    schedule = SCHEDULES[job.schedule][0](stage, job.micro, loss_fn=mod.cross_entropy_loss)
    p.barrier()
    if p.rank == 0:
        ms.set_context(mode=ms.GRAPH_MODE)
    p.barrier()
    target = p.from_numpy(job.targets) if stage.is_last and with_loss else None
    try:
        schedule.eval(p.from_numpy(job.tokens) if stage.is_first else None, target=target)
    except ValueError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("with_loss", [False, True])
def test_wrappers_are_checked_again_when_an_eval_starts(with_loss: bool) -> None:
    """eval() runs no run hooks: without its own check a wrapped block failed to compile at the first
    forward ("Parse Resolve convert failed", the other rank then deadlocked)."""
    try:
        refused = LocalCluster(P, platform="mindspore").run(_built_then_graph_mode_eval, _act_job("gpipe", "selective"),
                                                            with_loss)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    for rank, message in enumerate(refused):
        assert f"stage {rank} holds modules wrapped by swap_wrapper/checkpoint_wrapper" in message, message
        assert "context GRAPH_MODE" in message and EAGER_HINT in message, message


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
