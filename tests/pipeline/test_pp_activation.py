"""Swap, recompute and uneven layer splits inside pipeline schedules, against the non-pipelined
model (torch and MindSpore LocalCluster), and the activation memory they report."""

from __future__ import annotations

import numpy as np
import pytest
from activation_harness import ACT_SCHEDULES, ActJob, layer_ranges, run_act_job
from pp_harness import batch, check_against_oracle, full_model_oracle, merged, small_config

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform.local import LocalCluster

pytestmark = pytest.mark.timeout(600)
SWAP = {"swap": True, "swap_threshold": 2}
SPLIT = ["zb_h1", "zbv", "dualpipe_v"]  # the dx/dW split (I and W steps)
PAIRS = ["dualpipe_v", "overlap_b_f"]  # OVERLAP_B_F steps


def _setup(schedule: str) -> tuple[int, tuple[int, ...]]:
    """World size and blocks per stage (uneven, with an empty stage) for a schedule."""
    chunks = ACT_SCHEDULES[schedule][1]
    return (4, (3, 0, 1, 2)) if chunks == 1 else (2, (2, 1, 0, 3))


def _job(schedule: str, policy: str, options: dict | None = None, micro: int = 4, **kw) -> tuple[int, ActJob]:
    """Two micro-batches per rank-pair at least (DualPipeV needs m >= 2p: p=2, m=4)."""
    world, layers = _setup(schedule)
    config = small_config(n_layers=sum(layers))
    tokens, targets = batch(config, 2 * micro)
    return world, ActJob(schedule, micro, config, tokens, targets, layers=layers, policy=policy,
                         options=options or {}, **kw)


def _run_and_check(framework: str, world: int, job: ActJob, expect_swap: bool = True) -> list[dict]:
    results = LocalCluster(world, platform=framework).run(run_act_job, job)
    losses, grads = merged(results)
    assert len(losses) == 1 and len(losses[0]) == job.micro
    ref_loss, ref_grads = full_model_oracle(framework, job.config, job.tokens, job.targets)
    check_against_oracle(framework, losses[0], grads, ref_loss, ref_grads)
    if job.options.get("swap"):
        assert all(r["stats"]["late_loads"] == 0 for r in results), [r["stats"] for r in results]
        assert any(r["stats"]["swapped"] for r in results) == expect_swap, [r["stats"] for r in results]
    steps = [s for r in results for s in r["compute"] if s is not None]  # the real schedules ran:
    assert any(s.startswith("I.") for s in steps) == (job.schedule in SPLIT), steps  # I/W steps
    assert any(s.startswith("OVERLAP_B_F") for s in steps) == (job.schedule in PAIRS), steps  # pairs
    return results


def _pairs_of_unequal_chunks(job: ActJob, results: list[dict]) -> list[str]:
    """The OVERLAP_B_F steps that ran whose backward and forward stages hold different block counts."""
    blocks = [len(r) for r in layer_ranges(job.config.n_layers, job.layers)]
    out = []
    for r in results:
        for step in r["compute"]:
            if step is not None and step.startswith("OVERLAP_B_F"):
                b, f = step[len("OVERLAP_B_F["):-1].split("+")
                if blocks[int(b.split(".")[1][1:])] != blocks[int(f.split(".")[1][1:])]:
                    out.append(step)
    return out


# ---------------------------------------------------------------- torch LocalCluster
@pytest.mark.parametrize("swap", [False, True], ids=["resident", "swap"])
@pytest.mark.parametrize("schedule", list(ACT_SCHEDULES))
def test_every_schedule_with_uneven_layers_and_mixed_policies(schedule, swap):
    """Per-block mix of checkpoint, selective, swap_wrapper and plain; stages of 3, 0, 1, 2 blocks
    for one-chunk schedules (p=4, m=4), of 2, 1, 0, 3 blocks for two-chunk ones (p=2, m=4: a rank
    holds chunks of 2 and 0 blocks, or of 1 and 3 looped / 2 and 3, 1 and 0 in the V), so the real
    OVERLAP_B_F pairs of DualPipeV and overlap_b_f=True join chunks of different sizes."""
    world, job = _job(schedule, "mixed", SWAP if swap else None)
    results = _run_and_check("torch", world, job)
    if schedule in PAIRS:
        assert _pairs_of_unequal_chunks(job, results), [r["compute"] for r in results]


@pytest.mark.parametrize("schedule", ["zbv", "overlap_b_f"])
def test_two_chunk_schedules_at_four_ranks_with_uneven_layers(schedule):
    """p=4, m=8, eight stages of 2, 0, 1, 1, 0, 2, 1, 1 blocks with mixed policies and schedule
    swap (DualPipeV runs this on 4 gloo processes, test_pp_activation_gloo.py)."""
    layers = (2, 0, 1, 1, 0, 2, 1, 1)
    config = small_config(n_layers=sum(layers))
    tokens, targets = batch(config, 16)
    job = ActJob(schedule, 8, config, tokens, targets, layers=layers, policy="mixed", options=SWAP)
    results = _run_and_check("torch", 4, job)
    if schedule in PAIRS:
        assert _pairs_of_unequal_chunks(job, results)


@pytest.mark.parametrize("schedule", ["1f1b", *SPLIT, "overlap_b_f"])
@pytest.mark.parametrize("policy", ["plain", "checkpoint", "selective", "swap", "stage_checkpoint"])
def test_each_policy_alone_with_schedule_swap(schedule, policy):
    """With every block swap-wrapped, or the whole stage checkpointed, the schedule finds nothing
    left to swap (what stays is parameters, stage inputs and outputs); otherwise it swaps."""
    world, job = _job(schedule, policy, SWAP)
    _run_and_check("torch", world, job, expect_swap=policy in ("plain", "checkpoint", "selective"))


@pytest.mark.parametrize("schedule", ["1f1b", *SPLIT, "overlap_b_f"])
def test_recompute_hooks_fire_once(schedule):
    world, job = _job(schedule, "checkpoint", SWAP, count_hooks=True)
    for r in _run_and_check("torch", world, job):
        calls = job.micro * r["hooks"]["blocks"]
        assert r["hooks"]["forward_once"] == calls, r["hooks"]
        assert r["hooks"]["backward"] == calls, r["hooks"]
        assert r["hooks"]["forward_all"] == 2 * calls, "one re-run per backward, also with the dx/dW split"


def _gap_rule_by_hand(compute: list[str | None], threshold: int) -> list[tuple[int, int]]:
    swapped = []
    for slot, step in enumerate(compute):
        if step is not None and step.startswith("B."):
            _, s, m = step.split(".")
            if slot - compute.index(f"F.{s}.{m}") >= threshold:
                swapped.append((int(s[1:]), int(m[1:])))
    return sorted(swapped)


def _memory_job(policy: str, swap: bool) -> ActJob:
    config = small_config(n_layers=4, d_model=32, max_seq_len=16)
    tokens, targets = batch(config, 16)
    return ActJob("1f1b", 8, config, tokens, targets, policy=policy, options={"swap": swap}, track=True)


def test_schedule_swap_lowers_rank0_peak_and_follows_the_gap_rule():
    """1F1B, p=4, m=8: rank 0 keeps fewer saved bytes with swap; every rank swaps exactly the
    micro-batches whose backward is at least 4 slots after their forward."""
    plain = LocalCluster(4, platform="torch").run(run_act_job, _memory_job("plain", False))
    swapped = LocalCluster(4, platform="torch").run(run_act_job, _memory_job("plain", True))
    before, after = plain[0]["stats"]["peak_saved_bytes"], swapped[0]["stats"]["peak_saved_bytes"]
    print(f"\n1F1B p=4 m=8 rank 0 peak saved activation bytes: {before} resident, {after} with swap")
    assert 0 < after < before
    for r in swapped:
        assert [tuple(k) for k in r["stats"]["swapped"]] == _gap_rule_by_hand(r["compute"], 4), r["stages"]
        assert r["stats"]["late_loads"] == 0
    assert [len(r["stats"]["swapped"]) for r in swapped] == [8, 6, 0, 0]
    assert [r["stats"]["peak_saved_bytes"] for r in swapped[2:]] == [r["stats"]["peak_saved_bytes"] for r in plain[2:]]
    losses_a, grads_a = merged(plain)
    losses_b, grads_b = merged(swapped)
    assert losses_a == losses_b
    for name in grads_a:
        np.testing.assert_array_equal(grads_a[name], grads_b[name])


def test_recompute_lowers_the_peak_and_selective_sits_between():
    peaks = {}
    for policy in ("plain", "selective", "checkpoint"):
        results = LocalCluster(4, platform="torch").run(run_act_job, _memory_job(policy, False))
        peaks[policy] = results[0]["stats"]["peak_saved_bytes"]
    print(f"\n1F1B p=4 m=8 rank 0 peak saved activation bytes: {peaks}")
    assert peaks["checkpoint"] < peaks["selective"] < peaks["plain"]


def test_memory_stats_needs_tracking():
    def body():
        from pp_harness import models

        from hyper_parallel.platform import get_platform

        p = get_platform()
        config = small_config(n_layers=1)
        from hyper_parallel.demo.gpt import init_gpt_weights

        stage = PipelineStage(models("torch").GPTStage(config, 0, 1, init_gpt_weights(config)), 0, 1)
        schedule = Schedule1F1B(stage, 2, loss_fn=models("torch").cross_entropy_loss)
        with pytest.raises(RuntimeError, match="memory tracking is off"):
            schedule.memory_stats()
        tokens, targets = batch(config, 2)
        schedule_swap = Schedule1F1B(stage, 2, loss_fn=models("torch").cross_entropy_loss, swap=True)
        with pytest.raises(RuntimeError, match="needs a training run"):
            schedule_swap.memory_stats()
        schedule_swap.run(p.from_numpy(tokens), target=p.from_numpy(targets))
        assert schedule_swap.eval(p.from_numpy(tokens), target=p.from_numpy(targets))  # no swap steps there
        assert not any("SWAP" in str(s) for s in schedule_swap._lowered("first", forward_only=True)[0])
        return schedule_swap.memory_stats().samples

    assert LocalCluster(1, platform="torch").run(body)[0] == 2


def test_swap_threshold_is_checked_before_running():
    def body():
        from pp_harness import models

        from hyper_parallel.demo.gpt import init_gpt_weights

        config = small_config(n_layers=1)
        stage = PipelineStage(models("torch").GPTStage(config, 0, 1, init_gpt_weights(config)), 0, 1)
        with pytest.raises(ValueError, match="swap_threshold must be >= 2 compute slots"):
            Schedule1F1B(stage, 2, swap=True, swap_threshold=1)
        return True

    assert LocalCluster(1, platform="torch").run(body) == [True]


def test_swap_steps_in_exec_order():
    def body():
        from pp_harness import models

        from hyper_parallel.demo.gpt import init_gpt_weights
        from hyper_parallel.platform import get_platform

        p = get_platform()
        config = small_config(n_layers=4)
        stage = PipelineStage(models("torch").GPTStage(config, p.rank, 4, init_gpt_weights(config)), p.rank, 4)
        schedule = Schedule1F1B(stage, 8, loss_fn=models("torch").cross_entropy_loss, swap=True)
        return [str(s) for s in schedule.exec_order[p.rank] if s is not None and "SWAP_WAIT_LOAD" in str(s)]

    waits = LocalCluster(4, platform="torch").run(body)
    assert [len(w) for w in waits] == [8, 6, 0, 0]


# ---------------------------------------------------------------- MindSpore LocalCluster (lean)
def test_mindspore_mixed_policies_uneven_layers_and_swap():
    world, job = _job("1f1b", "mixed", SWAP)
    _run_and_check("mindspore", world, job)


def test_mindspore_zbv_with_recompute_and_swap():
    """ZB-V (dx/dW split, V placement, uneven chunks) with every block checkpointed and schedule swap."""
    world, job = _job("zbv", "checkpoint", SWAP, count_hooks=True)
    for r in _run_and_check("mindspore", world, job):
        calls = job.micro * r["hooks"]["blocks"]
        assert (r["hooks"]["forward_once"], r["hooks"]["forward_all"]) == (calls, 2 * calls)


def test_peak_saved_bytes_are_m_forwards_worth_under_gpipe():
    """GPipe holds every micro-batch's activations at once: on rank 0 the tracked peak is m times
    what one forward of the stage saves, counted here with torch's own saved-tensor hooks."""

    def body():
        import torch
        from pp_harness import models

        from hyper_parallel.core.pipeline_parallel.features.memory_stats import track_memory
        from hyper_parallel.core.pipeline_parallel.schedule import ScheduleGPipe
        from hyper_parallel.demo.gpt import init_gpt_weights
        from hyper_parallel.platform import get_platform

        p = get_platform()
        config = small_config(n_layers=4)
        mod = models("torch")
        module = mod.GPTStage(config, p.rank, 2, init_gpt_weights(config))
        stage = PipelineStage(module, p.rank, 2)
        schedule = ScheduleGPipe(stage, 3, loss_fn=mod.cross_entropy_loss)
        track_memory(schedule)
        tokens, targets = batch(config, 6)
        schedule.run(p.from_numpy(tokens), target=p.from_numpy(targets) if stage.is_last else None)
        if p.rank != 0:
            return None
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(p.from_numpy(tokens[:2]))
        params = {q.untyped_storage().data_ptr() for q in module.parameters()}
        return schedule.memory_stats().peak_saved_bytes, sum(n for k, n in storages.items() if k not in params)

    peak, per_forward = LocalCluster(2, platform="torch").run(body)[0]
    assert per_forward > 0 and peak == 3 * per_forward
