"""Every schedule on LocalCluster(2, "mindspore") with compiled stages, against the non-pipelined model.

Two settings: ``GRAPH_MODE`` (the user's context; the platform compiles each stage with ms.jit
and keeps gradients), and PyNative with ``HYPER_PARALLEL_MS_COMPILE=jit``. Before the fix,
GRAPH_MODE gave the right losses and no gradient at all: ``check_against_oracle`` fails on the
missing gradient names. The oracles always run in PyNative.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from pp_harness import (
    SCHEDULES,
    TOL,
    Job,
    batch,
    chained_oracle,
    check_against_oracle,
    full_model_oracle,
    merged,
    run_job,
    small_config,
    wrappers,
)

from hyper_parallel import (
    BatchDimSpec,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.platform.local import LocalCluster

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.timeout(300)
P = 2
SETTINGS = ["graph", "jit"]


@pytest.fixture(params=SETTINGS)
def setting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "jit":
        monkeypatch.setenv("HYPER_PARALLEL_MS_COMPILE", "jit")
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _run(setting: str, job: Job) -> list[dict[str, Any]]:
    """The pipeline on P ranks, in GRAPH_MODE for the "graph" setting (the user's mode is kept)."""
    mode = ms.GRAPH_MODE if setting == "graph" else ms.PYNATIVE_MODE
    ms.set_context(mode=mode)
    try:
        results = LocalCluster(P, platform="mindspore").run(run_job, job)
        assert ms.get_context("mode") == mode
        return results
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def _compare(results: list[dict[str, Any]], ref_loss: float, ref_grads: dict[str, np.ndarray]) -> None:
    losses, grads = merged(results)
    np.testing.assert_allclose(np.mean(losses[0]), ref_loss, **TOL["mindspore"])
    assert set(grads) == set(ref_grads), f"missing or extra gradients: {set(grads) ^ set(ref_grads)}"
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], **TOL["mindspore"], err_msg=name)


# the dx/dW split (I and W steps) and OVERLAP_B_F pairs: name -> (class, chunks, options)
SPLIT_AND_PAIRS = {
    "zb_h1": (ScheduleInterleavedZeroBubble, 1, {}),
    "zbv": (ScheduleZBVZeroBubble, 2, {}),
    "dualpipe_v": (ScheduleDualPipeV, 2, {}),
    "overlap_b_f": (ScheduleInterleaved1F1B, 2, {"overlap_b_f": True}),
}
MICRO = {"dualpipe_v": 2 * P}  # DualPipeV needs m >= 2p; the others run 3 micro-batches
# the keyword-argument and dyn_shape tests: 2 micro-batches, DualPipeV 2p, overlap_b_f p + 1 (its first pair)
FEATURE_MICRO = {"dualpipe_v": 2 * P, "overlap_b_f": P + 1}
SPLIT = ("zb_h1", "zbv", "dualpipe_v")  # the schedules with a dx/dW split
# every schedule meets keyword arguments and dyn_shape compiled, in one setting or the other
KWARGS_CASES = [("graph", "gpipe"), ("jit", "gpipe"), ("graph", "1f1b"), ("jit", "interleaved"),
                ("graph", "looped_bfs"), ("graph", "zb_h1"), ("jit", "zbv"), ("graph", "dualpipe_v"),
                ("jit", "overlap_b_f")]
DYN_CASES = [("jit", "gpipe"), ("graph", "1f1b"), ("graph", "interleaved"), ("jit", "looped_bfs"),
             ("jit", "zb_h1"), ("graph", "zbv"), ("jit", "dualpipe_v"), ("graph", "overlap_b_f")]


def _options(schedule: str) -> dict[str, Any]:
    return SPLIT_AND_PAIRS[schedule][2] if schedule in SPLIT_AND_PAIRS else {}


@pytest.fixture
def split_and_pairs() -> Iterator[None]:
    SCHEDULES.update({name: (cls, chunks) for name, (cls, chunks, _) in SPLIT_AND_PAIRS.items()})
    yield
    for name in SPLIT_AND_PAIRS:
        del SCHEDULES[name]


def _steps_ran(results: list[dict[str, Any]]) -> set[str]:
    return {kind for r in results for kind in r["step_kinds"]}


@pytest.mark.parametrize("schedule", [*SCHEDULES, *SPLIT_AND_PAIRS])
def test_every_schedule_tied_and_two_tensors_matches_non_pipelined(setting: str, schedule: str,
                                                                   split_and_pairs: None) -> None:
    chunks = SCHEDULES[schedule][1]
    micro = MICRO.get(schedule, 3)
    config = small_config(n_layers=2 * chunks, tie_embeddings=True, two_tensor_boundary=True)
    tokens, targets = batch(config, 2 * micro)
    ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    results = _run(setting, Job(schedule, micro, config, tokens, targets, options=_options(schedule)))
    losses, grads = merged(results)
    assert len(losses[0]) == micro
    kinds = _steps_ran(results)
    assert ("BWD_INPUT" in kinds) == (schedule in ("zb_h1", "zbv", "dualpipe_v")), kinds
    assert ("OVERLAP_B_F" in kinds) == (schedule in ("dualpipe_v", "overlap_b_f")), kinds
    check_against_oracle("mindspore", losses[0], grads, ref_loss, ref_grads, tie=True)
    np.testing.assert_array_equal(grads["tok_emb"], grads["head.weight"])  # shared_parameters summed them


@pytest.mark.parametrize(("setting", "schedule"), KWARGS_CASES, indirect=["setting"])
def test_keyword_arguments(setting: str, schedule: str, split_and_pairs: None) -> None:
    """Keyword inputs of stage 0 with every schedule (the V schedules: stage 0 and the last stage on
    rank 0; the dx/dW split; the OVERLAP_B_F pairs of DualPipeV and overlap_b_f)."""
    num_stages = P * SCHEDULES[schedule][1]
    micro = FEATURE_MICRO.get(schedule, 2)
    config = small_config(n_layers=num_stages)
    tokens, targets = batch(config, 2 * micro)
    rng = np.random.default_rng(5)
    kwargs = {
        "offset": rng.standard_normal((2 * micro, config.max_seq_len)).astype(np.float32),  # split along dim 0
        "bias_vec": rng.standard_normal((config.d_model,)).astype(np.float32),  # passed whole
        "attn_scale": 0.5,  # not a tensor: a constant of the compiled graph
    }
    _, offset_first = wrappers("mindspore")
    job = Job(schedule, micro, config, tokens, targets, wrap_first=offset_first, run_kwargs=kwargs,
              options={"kwargs_batch_dim": {"offset": 0, "bias_vec": BatchDimSpec(None)}, **_options(schedule)})
    ref_loss, ref_grads = chained_oracle("mindspore", job, num_stages, kwargs)
    results = _run(setting, job)
    _compare(results, ref_loss, ref_grads)
    assert ("BWD_INPUT" in _steps_ran(results)) == (schedule in SPLIT)
    assert ("OVERLAP_B_F" in _steps_ran(results)) == (schedule in ("dualpipe_v", "overlap_b_f"))


def test_last_stage_returns_the_loss_without_loss_fn(setting: str) -> None:
    config = small_config(n_layers=2)
    tokens, _ = batch(config, 4)
    mean_square, _ = wrappers("mindspore")
    job = Job("1f1b", 2, config, tokens, None, wrap_last=mean_square, use_loss_fn=False)
    ref_loss, ref_grads = chained_oracle("mindspore", job, P, {})
    _compare(_run(setting, job), ref_loss, ref_grads)


@pytest.mark.parametrize(("setting", "schedule"), DYN_CASES, indirect=["setting"])
def test_dyn_shape_compiles_each_sequence_length(setting: str, schedule: str, split_and_pairs: None) -> None:
    """Three runs of sequence lengths 5, 8, 5 with every schedule (the dx/dW split: each input
    backward keeps a dW of its own run's shapes; several chunks per rank; OVERLAP_B_F pairs)."""
    micro = FEATURE_MICRO.get(schedule, 2)
    config = small_config(n_layers=P * SCHEDULES[schedule][1])
    seqs = [5, 8, 5]
    data = [batch(config, 2 * micro, seq=s, seed=k) for k, s in enumerate(seqs)]
    job = Job(schedule, micro, config, [d[0] for d in data], [d[1] for d in data], runs=len(seqs),
              stage_options={"dyn_shape": True}, options={"scale_grads": False, **_options(schedule)})
    results = _run(setting, job)
    assert ("BWD_INPUT" in _steps_ran(results)) == (schedule in SPLIT)
    losses, grads = merged(results)
    total: dict[str, np.ndarray] = {}
    for k, (tokens, targets) in enumerate(data):
        ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
        np.testing.assert_allclose(np.mean(losses[k]), ref_loss, **TOL["mindspore"])
        for name, g in ref_grads.items():
            total[name] = total.get(name, 0) + g * micro  # scale_grads=False: summed over micro-batches and runs
    assert set(grads) == set(total)
    for name, g in grads.items():
        np.testing.assert_allclose(g, total[name], **TOL["mindspore"], err_msg=name)


def _jit_stage_class() -> Any:
    from mindspore import nn

    class JitStage(nn.Cell):
        """A stage whose construct the user compiled with ``@ms.jit``."""

        def __init__(self, inner: Any) -> None:
            super().__init__(auto_prefix=False)  # keeps the inner stage's parameter names
            self.inner = inner

        @ms.jit
        def construct(self, *x: Any) -> Any:
            return self.inner(*x)

    return JitStage


@pytest.mark.parametrize(("mode", "schedule"), [("pynative", "1f1b"), ("graph", "1f1b"), ("pynative", "zbv")])
def test_user_jit_stage_cells(mode: str, schedule: str, split_and_pairs: None) -> None:
    """First and last stages compiled by the user's ``@ms.jit``; with ZB-V (dx/dW split, both on
    rank 0 in the V) their input backward takes dW too and the weight step adds it."""
    chunks = SCHEDULES[schedule][1]
    config = small_config(n_layers=2 * chunks)
    tokens, targets = batch(config, 4)
    jit_stage = _jit_stage_class()
    job = Job(schedule, 2, config, tokens, targets, wrap_first=jit_stage, wrap_last=jit_stage)
    ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    results = _run("graph" if mode == "graph" else "pynative", job)
    losses, grads = merged(results)
    check_against_oracle("mindspore", losses[0], grads, ref_loss, ref_grads)
    assert ("BWD_INPUT" in _steps_ran(results)) == (schedule in ("zbv", "dualpipe_v"))


def _one_step_then_sgd(lr: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """1F1B, then the README's optimizer pattern on this rank's parameters."""
    from mindspore import nn

    from hyper_parallel import PipelineStage, Schedule1F1B
    from hyper_parallel.demo import gpt_mindspore
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    config = small_config(n_layers=2)
    stage = PipelineStage(gpt_mindspore.GPTStage(config, p.rank, P, init_gpt_weights(config, 0)), p.rank, P)
    schedule = Schedule1F1B(stage, 2, loss_fn=gpt_mindspore.cross_entropy_loss)
    tokens, targets = batch(config, 4)
    schedule.run(p.from_numpy(tokens), target=p.from_numpy(targets) if stage.is_last else None)
    params = [prm for _, prm in p.named_parameters(stage.submodule)]
    before = {prm.name: p.to_numpy(prm).copy() for prm in params}
    grads = {name: p.to_numpy(g).copy() for name, g in stage.named_gradients().items()}
    nn.SGD(params, learning_rate=lr)(tuple(p.get_grad(prm) for prm in params))
    return grads, before, {prm.name: p.to_numpy(prm).copy() for prm in params}


def test_graph_mode_gradients_feed_the_readme_optimizer_pattern() -> None:
    config = small_config(n_layers=2)
    tokens, targets = batch(config, 4)
    _, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        results = LocalCluster(P, platform="mindspore").run(_one_step_then_sgd, 0.1)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    grads = {name: g for r in results for name, g in r[0].items()}
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(grads[name], ref, **TOL["mindspore"], err_msg=name)
    for rank_grads, before, after in results:
        for name, g in rank_grads.items():
            np.testing.assert_allclose(after[name], before[name] - 0.1 * g, rtol=1e-6, atol=1e-7, err_msg=name)


def _stages_ran_compiled() -> list[bool]:
    from hyper_parallel import PipelineStage, Schedule1F1B
    from hyper_parallel.demo import gpt_mindspore
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.mindspore import compiled

    p = get_platform()
    config = small_config(n_layers=2)
    stage = PipelineStage(gpt_mindspore.GPTStage(config, p.rank, P, init_gpt_weights(config, 0)), p.rank, P)
    tokens, targets = batch(config, 2)
    Schedule1F1B(stage, 1, loss_fn=gpt_mindspore.cross_entropy_loss).run(
        p.from_numpy(tokens), target=p.from_numpy(targets) if stage.is_last else None)
    return [stage.submodule in compiled._COMPILED]


def test_graph_mode_stages_of_the_runtime_are_compiled(caplog: pytest.LogCaptureFixture) -> None:
    """The runtime's stage functions (the Cell, and the last stage's loss closure naming it with
    __wrapped__) are the ones the platform can compile: no stage falls back to op by op."""
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        results = LocalCluster(P, platform="mindspore").run(_stages_ran_compiled)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert results == [[True], [True]]
    assert "cannot compile the stage function" not in caplog.text


def _overlap_schedule(name: str, switch_to_graph: bool) -> str:
    """Build ``name`` with a CommComputeOverlap on this rank; with ``switch_to_graph`` build it in
    PyNative, then run it under GRAPH_MODE. Returns "built" or the ValueError's message."""
    from hyper_parallel import PipelineStage
    from hyper_parallel.core.pipeline_parallel.features.overlap import CommComputeOverlap
    from hyper_parallel.demo import gpt_mindspore
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    cls, chunks, options = SPLIT_AND_PAIRS[name]
    placement = cls.stage_placement(P, chunks)
    config = small_config(n_layers=len(placement))
    weights = init_gpt_weights(config, 0)
    stages = [PipelineStage(gpt_mindspore.GPTStage(config, s, len(placement), weights), s, len(placement))
              for s in sorted(s for s, r in placement.items() if r == p.rank)]
    m = MICRO.get(name, 3)
    try:
        schedule = cls(stages, m, loss_fn=gpt_mindspore.cross_entropy_loss, comm_compute_overlap=CommComputeOverlap(),
                       **options)
        if not switch_to_graph:
            return "built"
        p.barrier()
        if p.rank == 0:
            ms.set_context(mode=ms.GRAPH_MODE)
        p.barrier()
        tokens, targets = batch(config, 2 * m)
        schedule.run(p.from_numpy(tokens), target=p.from_numpy(targets) if stages[-1].is_last else None)
        return "ran"
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("name", ["dualpipe_v", "overlap_b_f"])
def test_comm_compute_overlap_is_refused_with_compiled_stages(setting: str, name: str) -> None:
    """The sync points of CommComputeOverlap's wrapped layers are Python calls that a compiled
    stage graph does not make (none fired under GRAPH_MODE): the schedule refuses the pair at
    construction, and at run time when the context became GRAPH_MODE after construction. Op by op
    (PyNative, compile auto) it is accepted."""
    expected = "comm_compute_overlap needs stages that run op by op, but the MindSpore platform compiles every stage"
    mode = ms.GRAPH_MODE if setting == "graph" else ms.PYNATIVE_MODE
    ms.set_context(mode=mode)
    try:
        refused = LocalCluster(P, platform="mindspore").run(_overlap_schedule, name, False)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert all(expected in m and "HYPER_PARALLEL_MS_COMPILE=eager" in m for m in refused), refused
    assert all(("HYPER_PARALLEL_MS_COMPILE=" + ("auto" if setting == "graph" else "jit")) in m for m in refused), refused


def test_comm_compute_overlap_is_checked_again_when_a_run_starts() -> None:
    try:
        results = LocalCluster(P, platform="mindspore").run(_overlap_schedule, "dualpipe_v", True)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert all("comm_compute_overlap needs stages that run op by op" in m and "GRAPH_MODE" in m for m in results), results
    assert LocalCluster(P, platform="mindspore").run(_overlap_schedule, "dualpipe_v", False) == ["built", "built"]
