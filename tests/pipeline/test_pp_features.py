"""Pipeline features on LocalCluster, each against a non-pipelined run of the same model and batch."""

from __future__ import annotations

import numpy as np
import pytest
from pp_harness import (
    TOL,
    Job,
    batch,
    chained_oracle,
    check_against_oracle,
    full_model_oracle,
    merged,
    models,
    run_job,
    small_config,
    wrappers,
)

from hyper_parallel import BatchDimSpec, MetaStepType
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster
from hyper_parallel.demo.gpt import init_gpt_weights

P = 4
FRAMEWORKS = ["torch", "mindspore"]


def _compare(framework, results, ref_loss, ref_grads):
    losses, grads = merged(results)
    np.testing.assert_allclose(np.mean(losses[0]), ref_loss, **TOL[framework])
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], **TOL[framework], err_msg=name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_last_stage_returns_the_loss_without_loss_fn(framework):
    config = small_config()
    tokens, _ = batch(config, 8)
    mean_square, _ = wrappers(framework)
    job = Job("1f1b", 4, config, tokens, None, wrap_last=mean_square, use_loss_fn=False)
    ref_loss, ref_grads = chained_oracle(framework, job, P, {})
    _compare(framework, LocalCluster(P, platform=framework).run(run_job, job), ref_loss, ref_grads)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_keyword_arguments_split_and_whole(framework):
    config = small_config()
    tokens, targets = batch(config, 6)
    rng = np.random.default_rng(5)
    kwargs = {
        "offset": rng.standard_normal((6, config.max_seq_len)).astype(np.float32),  # split along dim 0
        "bias_vec": rng.standard_normal((config.d_model,)).astype(np.float32),  # passed whole
        "attn_scale": 0.5,  # not a tensor: passed whole
    }
    _, offset_first = wrappers(framework)
    job = Job("gpipe", 3, config, tokens, targets, wrap_first=offset_first, run_kwargs=kwargs,
              options={"kwargs_batch_dim": {"offset": 0, "bias_vec": BatchDimSpec(None)}})
    ref_loss, ref_grads = chained_oracle(framework, job, P, kwargs)
    _compare(framework, LocalCluster(P, platform=framework).run(run_job, job), ref_loss, ref_grads)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_merged_outputs_equal_full_model_logits(framework):
    config = small_config()
    tokens, targets = batch(config, 6)
    job = Job("1f1b", 3, config, tokens, targets, options={"output_concat_dim": 0})
    results = LocalCluster(P, platform=framework).run(run_job, job)
    assert [r["outputs"] is not None for r in results] == [False, False, False, True]
    mod = models(framework)
    full = mod.GPTFull(config, init_gpt_weights(config, 0))
    if framework == "torch":
        import torch

        logits = full(torch.from_numpy(tokens)).detach().numpy()
    else:
        import mindspore as ms

        logits = full(ms.Tensor(tokens)).asnumpy()
    np.testing.assert_allclose(results[-1]["outputs"], logits, **TOL[framework])


ALL_VARIANTS = [(overlap, transport) for overlap in (False, True) for transport in ("plain", "batch")]


# MindSpore: one schedule, and the variant that changes both options against the default (one PyNative
# run costs ~15 s here; torch crosses every variant)
@pytest.mark.parametrize("framework, schedule, variants", [
    ("torch", "1f1b", ALL_VARIANTS), ("torch", "interleaved", ALL_VARIANTS),
    ("mindspore", "interleaved", [(False, "plain"), (True, "batch")]),
])
def test_overlap_and_transport_are_bitwise_identical(framework, schedule, variants):
    config = small_config(n_layers=5)
    tokens, targets = batch(config, 10)
    base = None
    for overlap, transport in variants:
        job = Job(schedule, 5, config, tokens, targets,
                  options={"overlap_p2p": overlap, "p2p_transport": transport})
        losses, grads = merged(LocalCluster(P, platform=framework).run(run_job, job))
        if base is None:
            base = (losses, grads)
            ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
            check_against_oracle(framework, losses[0], grads, ref_loss, ref_grads)
            continue
        assert losses == base[0], (overlap, transport)
        for name, g in grads.items():
            assert np.array_equal(g, base[1][name]), (overlap, transport, name)


@pytest.mark.parametrize("schedule, expected", [("1f1b", [4, 3, 2, 1]), ("gpipe", [9, 9, 9, 9])])
def test_in_flight_activations(schedule, expected):
    config = small_config()
    tokens, targets = batch(config, 18)
    results = LocalCluster(P, platform="torch").run(run_job, Job(schedule, 9, config, tokens, targets))
    assert [r["peak"] for r in results] == expected


def _released_after_send():
    import torch

    from hyper_parallel import PipelineStage, Schedule1F1B

    p = get_platform()
    mod = models("torch")
    config = small_config()
    weights = init_gpt_weights(config, 0)
    stage = PipelineStage(mod.GPTStage(config, p.rank, P, weights), p.rank, P)
    schedule = Schedule1F1B(stage, 4, loss_fn=mod.cross_entropy_loss)
    checked = []

    def send_then_check(step, ctx):
        ctx.run_default(step)
        ctx.runtime.release_completed_sends()
        record = ctx.runtime.records[(step.stage_index, step.micro_index)]
        checked.append([p.storage_nbytes(o) for o in record.outputs])

    schedule.register_custom_function(MetaStepType.FWD_SEND, send_then_check)
    tokens, targets = batch(config, 8)
    losses = schedule.run(torch.from_numpy(tokens), target=torch.from_numpy(targets))
    return checked, [float(x) for x in losses], {k: v.numpy() for k, v in stage.named_gradients().items()}


def test_sent_outputs_hold_no_storage_and_gradients_stay_exact():
    results = LocalCluster(P, platform="torch").run(_released_after_send)
    for r, (checked, _, _) in enumerate(results[:-1]):
        assert len(checked) == 4, f"rank {r} sent {len(checked)} outputs"
        assert all(nbytes == [0] for nbytes in checked), f"rank {r}: {checked}"
    config = small_config()
    tokens, targets = batch(config, 8)
    ref_loss, ref_grads = full_model_oracle("torch", config, tokens, targets)
    grads = {k: v for _, _, g in results for k, v in g.items()}
    check_against_oracle("torch", results[-1][1], grads, ref_loss, ref_grads)


def _custom_forward_counter():
    import torch

    from hyper_parallel import PipelineStage, ScheduleGPipe

    p = get_platform()
    mod = models("torch")
    config = small_config()
    stage = PipelineStage(mod.GPTStage(config, p.rank, P, init_gpt_weights(config, 0)), p.rank, P)
    schedule = ScheduleGPipe(stage, 3, loss_fn=mod.cross_entropy_loss)
    seen = []

    def counting_forward(step, ctx):
        seen.append((step.stage_index, step.micro_index, len(ctx.args), len(ctx.targets)))
        ctx.run_default(step)

    schedule.register_custom_function(MetaStepType.FWD, counting_forward)
    tokens, targets = batch(config, 6)
    schedule.run(torch.from_numpy(tokens), target=torch.from_numpy(targets))
    comm = [str(s) for s in schedule.exec_order[p.rank] if s is not None and s.meta_type.is_comm]
    return seen, comm, {k: v.numpy() for k, v in stage.named_gradients().items()}


def test_custom_function_runs_instead_of_the_builtin_step():
    results = LocalCluster(P, platform="torch").run(_custom_forward_counter)
    for r, (seen, comm, _) in enumerate(results):
        assert [(s, i) for s, i, _, _ in seen] == [(r, 0), (r, 1), (r, 2)]
        assert all(nargs == 3 for _, _, nargs, _ in seen)
        assert all(ntargets == (3 if r == P - 1 else 0) for _, _, _, ntargets in seen)
        if r > 0:
            assert "RECV_F.s%d.m0" % r in comm
        if r < P - 1:
            assert "SEND_F.s%d.m0" % r in comm
    config = small_config()
    tokens, targets = batch(config, 6)
    _, ref_grads = full_model_oracle("torch", config, tokens, targets)
    grads = {k: v for _, _, g in results for k, v in g.items()}
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], atol=1e-5, rtol=0)


def _two_pipelines_on_a_mesh(framework):
    from hyper_parallel import PipelineStage, Schedule1F1B, init_device_mesh

    p = get_platform()
    mod = models(framework)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    config = small_config()
    stage = PipelineStage(mod.GPTStage(config, pp_rank, 2, init_gpt_weights(config, 0)), pp_rank, 2, mesh=mesh)
    schedule = Schedule1F1B(stage, 2, loss_fn=mod.cross_entropy_loss)
    tokens, targets = batch(config, 4, seed=dp_rank)  # each data-parallel replica gets its own batch
    losses = schedule.run(p.from_numpy(tokens), target=p.from_numpy(targets))
    return dp_rank, [float(p.to_numpy(x)) for x in losses], {k: p.to_numpy(v) for k, v in stage.named_gradients().items()}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pipelines_on_the_pp_dimension_of_a_mesh(framework):
    results = LocalCluster(4, platform=framework).run(_two_pipelines_on_a_mesh, framework)
    config = small_config()
    for dp_rank in (0, 1):
        mine = [r for r in results if r[0] == dp_rank]
        tokens, targets = batch(config, 4, seed=dp_rank)
        ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
        grads = {k: v for _, _, g in mine for k, v in g.items()}
        losses = next(r[1] for r in mine if r[1])
        check_against_oracle(framework, losses, grads, ref_loss, ref_grads)
