"""ScheduleMPipeTranspose on LocalCluster (torch, and MindSpore lean) against a non-pipelined run."""

from __future__ import annotations

import numpy as np
import pytest
from mpipe_gloo_worker import CASES as GLOO_CASES
from mpipe_gloo_worker import P as GLOO_P
from mpipe_harness import TOL, Case, check, data, missing_combinations, mse, run_case, torch_modules, torch_oracle

from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

P = 4
TORCH_CASES = [
    Case("dataload-only", 1, 6, 0),
    Case("dataload-only-owned-inputs", 2, 7, 0, inputs="owned"),
    Case("recompute-m<p", 1, 3, 2),
    Case("recompute-full-overflow", 2, 9, 2),
    Case("recompute-min-overflow-owned", 1, 6, 2, overflow_mode="min", inputs="owned"),
    Case("owner-full-overflow", 1, 10, 2, owner_backward=True),
    Case("owner-min-overflow-owned-prefetch", 2, 6, 1, owner_backward=True, overflow_mode="min", inputs="owned",
         overlap_p2p=True),
    Case("frozen-full-overflow", 2, 8, 2, trainable=False),
    Case("two-runs-accumulate", 1, 5, 2, owner_backward=True, runs=2),
    # m <= p (NT = m owners, ranks past them own nothing) and the min-overflow modes not hit above
    Case("dataload-only-m=p", 2, 4, 0),
    Case("dataload-only-min-m<p-owned", 1, 2, 0, overflow_mode="min", inputs="owned"),
    Case("dataload-only-min-overflow-prefetch", 2, 9, 0, overflow_mode="min", overlap_p2p=True),
    Case("recompute-min-m=p-owned", 2, 4, 2, overflow_mode="min", inputs="owned"),
    Case("owner-m<p", 1, 2, 2, owner_backward=True),
    Case("owner-m=1-owned", 1, 1, 2, owner_backward=True, inputs="owned"),
    Case("owner-min-m=p-prefetch", 2, 4, 1, owner_backward=True, overflow_mode="min", overlap_p2p=True),
    Case("frozen-m<p-owned", 1, 3, 2, trainable=False, inputs="owned"),
    Case("frozen-min-m=p", 2, 4, 1, trainable=False, overflow_mode="min"),
    Case("frozen-min-overflow-owned", 1, 11, 2, trainable=False, overflow_mode="min", inputs="owned"),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.name)
def test_torch_matches_non_pipelined(case):
    check(case, LocalCluster(P, platform="torch").run(run_case, case), "torch")


# (ranks, case): p = 2 and p = 3 together hit every required combination (PyNative is slow: one
# case per combination, the p = 3 ones where ranks own nothing or several overflow rounds).
MS_CASES = [
    (2, Case("recompute-full-overflow", 1, 5, 1)),
    (2, Case("owner-min-overflow", 2, 3, 1, owner_backward=True, overflow_mode="min")),
    (2, Case("dataload-only-owned", 1, 3, 0, inputs="owned")),
    (2, Case("frozen-m=p", 1, 2, 1, trainable=False)),
    (2, Case("dataload-only-m=p", 2, 2, 0)),
    (2, Case("recompute-m=1", 1, 1, 1)),
    (2, Case("owner-min-m=p-owned", 1, 2, 1, owner_backward=True, overflow_mode="min", inputs="owned")),
    (2, Case("frozen-full-overflow", 1, 3, 1, trainable=False)),
    (3, Case("dataload-only-min-m=p-owned", 1, 3, 0, overflow_mode="min", inputs="owned")),
    (3, Case("dataload-only-min-overflow", 1, 4, 0, overflow_mode="min")),
    (3, Case("recompute-min-m<p-owned", 1, 2, 1, overflow_mode="min", inputs="owned")),
    (3, Case("recompute-min-overflow", 1, 4, 1, overflow_mode="min")),
    (3, Case("owner-m=p", 2, 3, 1, owner_backward=True)),
    (3, Case("owner-full-overflow-prefetch", 1, 5, 1, owner_backward=True, overlap_p2p=True)),
    (3, Case("frozen-min-m<p", 1, 2, 1, trainable=False, overflow_mode="min")),
    (3, Case("frozen-min-overflow", 1, 4, 1, trainable=False, overflow_mode="min")),
]


@pytest.mark.parametrize(("ranks", "case"), MS_CASES, ids=[f"p{p}-{c.name}" for p, c in MS_CASES])
def test_mindspore_matches_non_pipelined(ranks, case):
    check(case, LocalCluster(ranks, platform="mindspore").run(run_case, case), "mindspore")


@pytest.mark.parametrize(("engine", "cases"), [
    ("torch LocalCluster", [(P, c) for c in TORCH_CASES]),
    ("torch gloo", [(GLOO_P, c) for c in GLOO_CASES]),
    ("MindSpore LocalCluster", MS_CASES),
])
def test_each_engine_runs_every_required_combination(engine, cases):
    """Every preprocess kind (T = 0, recompute, owner backward, frozen) x (m <= p, m > NT) x
    overflow mode is run on each engine against the non-pipelined oracle."""
    assert not missing_combinations(cases), f"{engine} misses {sorted(missing_combinations(cases))}"


# ---------------------------------------------------------------------- eval, failures


def _schedule(case: Case, encoder=None, bodies=None, **options):
    p = get_platform()
    n = p.world_size
    num_stages = n * case.chunks
    if bodies is None:
        encoder, bodies = torch_modules(num_stages, case.layers, case.trainable)
    stages = [PipelineStage(bodies[c * n + p.rank], c * n + p.rank, num_stages) for c in range(case.chunks)]
    return ScheduleMPipeTranspose(stages if case.chunks > 1 else stages[0], case.micro, encoder, case.layers,
                                  loss_fn=mse, **{**case.options(), **options})


def _eval_losses(case: Case):
    import torch

    schedule = _schedule(case)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    out = schedule.eval(image, tokens, target=target)
    grads = schedule.named_gradients()
    return None if out is None else [float(x) for x in out], sorted(grads)


def test_eval_gives_the_losses_and_touches_no_gradient():
    case = Case("eval", 2, 6, 2, owner_backward=True)
    results = LocalCluster(P, platform="torch").run(_eval_losses, case)
    ref_losses, _ = torch_oracle(case, P * case.chunks)
    assert [r[0] is not None for r in results] == [False, False, False, True]
    np.testing.assert_allclose(results[-1][0], ref_losses, **TOL["torch"])
    assert all(r[1] == [] for r in results)


def _simulated_and_executed(case: Case):
    schedule = _schedule(case)
    return schedule.simulate().lowered == schedule.exec_order


def test_the_simulator_runs_the_lists_the_schedule_executes():
    case = Case("sim", 2, 9, 2, owner_backward=True)
    results = LocalCluster(P, platform="torch").run(_simulated_and_executed, case)
    assert results == [True] * P


def _fail_then_inspect(case: Case):
    import torch

    p = get_platform()
    encoder, bodies = torch_modules(P * case.chunks, case.layers, case.trainable)
    schedule = _schedule(case, encoder, bodies)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    schedule.run(image, tokens, target=target)
    before = {k: v.clone() for k, v in schedule.named_gradients().items() if k.startswith("preprocess.")}
    original = encoder.forward

    def broken(img, tok):
        if p.rank == 2:
            raise RuntimeError("broken encoder")
        return original(img, tok)

    encoder.forward = broken
    try:
        schedule.run(image, tokens, target=target)
    except Exception as exc:  # noqa: BLE001 - every rank fails; rank 2 with the cause
        error = f"{type(exc).__name__}: {exc}"
    after = {k: v for k, v in schedule.named_gradients().items() if k.startswith("preprocess.")}
    return error, all(torch.equal(before[k], after[k]) for k in before) and set(before) == set(after)


def test_failed_run_names_the_preprocess_and_restores_its_gradients():
    results = LocalCluster(P, platform="torch").run(_fail_then_inspect, Case("fail", 1, 4, 1, owner_backward=True))
    assert "PreprocessError: rank 2: the preprocess of micro-batch 2 (PF.m2) failed: RuntimeError: broken encoder" \
        in results[2][0]
    assert all(restored for _, restored in results)


# ---------------------------------------------------------------------- errors


def _build(case: Case, options: dict, encoder_on: tuple[int, ...] | None = None, run_kwargs: bool = False,
           dyn_shape: bool = False, wide_on: int | None = None):
    import torch

    p = get_platform()
    n = p.world_size
    encoder, bodies = torch_modules(n * case.chunks, case.layers, case.trainable)
    if encoder_on is not None and p.rank not in encoder_on:
        encoder = None
    if wide_on == p.rank:  # this rank's preprocess makes one column too many
        original = encoder.forward
        encoder.forward = lambda img, tok: (torch.cat([original(img, tok)[0], img[:, :1]], 1), tok)
    stages = [PipelineStage(bodies[p.rank], p.rank, n, dyn_shape=dyn_shape)]
    schedule = ScheduleMPipeTranspose(stages[0], case.micro, encoder, options.pop("layers", case.layers),
                                      loss_fn=mse, **options)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    kwargs = {"extra": image} if run_kwargs else {}
    schedule.run(image, tokens, target=target, **kwargs)


ERRORS = [
    (dict(layers=-1), {}, ValueError, "num_transpose_layers must be >= 0, got -1"),
    (dict(layers=1.5), {}, TypeError, "num_transpose_layers must be an int, got 1.5"),
    (dict(layers=True), {}, TypeError, "num_transpose_layers must be an int, got True"),
    (dict(overflow_mode="half"), {}, ValueError, "overflow_mode must be one of 'full', 'min', got 'half'"),
    (dict(inputs="some"), {}, ValueError, "inputs must be one of"),
    (dict(p2p_transport="batch"), {}, ValueError, "p2p_transport='plain' only"),
    (dict(), dict(dyn_shape=True), ValueError, "needs static shapes"),
    (dict(), dict(encoder_on=(0,)), ValueError, r"needs the preprocess_module on every pipeline rank, but rank\(s\) \[1\]"),
    (dict(), dict(run_kwargs=True), ValueError, "ships positional tensors only"),
    (dict(), dict(wide_on=1), ValueError, r"rank 1 sent \(float32\[2, 7\], int64\[2, 3\]\) for micro-batch 1, but rank 0 "
     r"expects \(float32\[2, 6\], int64\[2, 3\]\)"),
]


@pytest.mark.parametrize(("options", "build", "error", "message"), ERRORS, ids=[e[3][:30] for e in ERRORS])
def test_errors(options, build, error, message):
    with pytest.raises(RankFailedError, match=message) as info:
        LocalCluster(2, platform="torch").run(_build, Case("e", 1, 4, 2), dict(options), **build)
    assert isinstance(info.value.error, error)


def test_dataload_only_takes_no_preprocess_and_owner_backward_needs_a_trainable_one():
    def build(case, layers, owner_backward, frozen=False):
        p = get_platform()
        encoder, bodies = torch_modules(2, 2, not frozen)
        ScheduleMPipeTranspose(PipelineStage(bodies[p.rank], p.rank, 2), 2, encoder, layers,
                               owner_backward=owner_backward, loss_fn=mse)

    with pytest.raises(RankFailedError, match="num_transpose_layers=0 is the dataload-only mode"):
        LocalCluster(2, platform="torch").run(build, None, 0, False)
    with pytest.raises(RankFailedError, match="owner_backward=True needs a trainable preprocess"):
        LocalCluster(2, platform="torch").run(build, None, 2, True, True)

