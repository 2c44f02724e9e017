"""A pipeline whose backwards are all split (I, then W deferred to the end of each rank's list)
against the non-pipelined model: sent outputs are released, so dx starts from roots without data."""

from __future__ import annotations

import pytest
from pp_harness import SCHEDULES, Job, batch, check_against_oracle, full_model_oracle, merged, run_job, small_config

from hyper_parallel import MetaStep, MetaStepType, Schedule1F1B
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b
from hyper_parallel.platform.local import LocalCluster

P = 4


class SplitBackward1F1B(Schedule1F1B):
    """1F1B with every backward split into I, and every W put after the rank's last step."""

    @classmethod
    def generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int):  # type: ignore[no-untyped-def]
        out = {}
        for rank, steps in generate_1f1b(num_ranks, num_microbatches).items():
            kept, deferred = [], []
            for step in steps:
                if step is not None and step.meta_type is MetaStepType.BWD:
                    kept.append(MetaStep(step.micro_index, MetaStepType.BWD_INPUT, step.stage_index))
                    deferred.append(MetaStep(step.micro_index, MetaStepType.BWD_WEIGHT, step.stage_index))
                else:
                    kept.append(step)
            out[rank] = kept + deferred
        return out


@pytest.fixture
def split_schedule():
    SCHEDULES["split_1f1b"] = (SplitBackward1F1B, 1)
    yield "split_1f1b"
    del SCHEDULES["split_1f1b"]


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_split_backward_pipeline_matches_non_pipelined(framework, split_schedule):
    config = small_config()
    tokens, targets = batch(config, 8)
    job = Job(split_schedule, 4, config, tokens, targets)
    results = LocalCluster(P, platform=framework).run(run_job, job)
    losses, grads = merged(results)
    assert len(losses[0]) == 4
    ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
    check_against_oracle(framework, losses[0], grads, ref_loss, ref_grads)
