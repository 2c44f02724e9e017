"""Pipelines of the reference GPT with per-layer activation policies and uneven layer splits.

A job names a schedule, how many blocks each stage holds (``layers``; None: the even split) and a
per-block policy (plain, checkpoint, selective, swap, mixed, stage_checkpoint); schedule options
(``swap=True``...) go in ``options``. Every rank returns its losses, gradients, memory stats and
hook counts; the oracle is the unwrapped non-pipelined model (``pp_harness.full_model_oracle``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pp_harness import SCHEDULES, models

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, is_recomputing, swap_wrapper
from hyper_parallel.core.pipeline_parallel.features.memory_stats import memory_stats, track_memory
from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.demo.gpt import init_gpt_weights
from hyper_parallel.platform import get_platform

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")  # kept by the selective policy
POLICIES = ("plain", "checkpoint", "selective", "swap", "mixed", "stage_checkpoint")


# name -> (class, chunks per rank): the plain schedules, and the real dx/dW-split and OVERLAP_B_F ones
ACT_SCHEDULES: dict[str, tuple[Any, int]] = {
    **SCHEDULES,
    "zb_h1": (ScheduleInterleavedZeroBubble, 1),  # I/W split, one stage per rank
    "zbv": (ScheduleZBVZeroBubble, 2),  # I/W split, V placement
    "dualpipe_v": (ScheduleDualPipeV, 2),  # V placement, OVERLAP_B_F pairs and I/W split; m >= 2p
    "overlap_b_f": (ScheduleInterleaved1F1B, 2),  # with SCHEDULE_OPTIONS below: OVERLAP_B_F pairs
}
SCHEDULE_OPTIONS: dict[str, dict[str, Any]] = {"overlap_b_f": {"overlap_b_f": True}}


@dataclass
class ActJob:
    schedule: str
    micro: int
    config: Any
    tokens: np.ndarray
    targets: np.ndarray
    layers: tuple[int, ...] | None = None  # blocks per stage (stage order); sums to config.n_layers
    policy: str = "plain"
    options: dict[str, Any] = field(default_factory=dict)
    track: bool = False
    count_hooks: bool = False

    def replace(self, **kw: Any) -> ActJob:
        return dataclasses.replace(self, **kw)


def layer_ranges(n_layers: int, layers: tuple[int, ...]) -> list[range]:
    if sum(layers) != n_layers:
        raise ValueError(f"layers {layers} do not add up to n_layers={n_layers}")
    out, start = [], 0
    for count in layers:
        out.append(range(start, start + count))
        start += count
    return out


def policy_of(policy: str, block: int) -> str:
    if policy == "mixed":
        return ("checkpoint", "selective", "swap", "plain")[block % 4]
    return policy


def build_stage_module(framework_models: Any, job: ActJob, s: int, num_stages: int, weights: dict) -> Any:
    module = framework_models.GPTStage(job.config, s, num_stages, weights)
    if job.layers is not None:
        rng = layer_ranges(job.config.n_layers, job.layers)[s]
        blocks = {str(i): framework_models.Block(job.config, weights, i) for i in rng}
        module.layer_range = rng
        module.blocks = type(module.blocks)(blocks)
    for name, block in module.blocks.items():
        kind = policy_of(job.policy, int(name))
        if kind == "checkpoint":
            checkpoint_wrapper(block)
        elif kind == "selective":
            checkpoint_wrapper(block, save=LINEARS)
        elif kind == "swap":
            swap_wrapper(block)
    if job.policy == "stage_checkpoint":
        checkpoint_wrapper(module)
    return module


def _count_hooks(module: Any, counts: dict[str, int]) -> None:
    """Forward hooks (all calls / calls outside a re-run) and backward hooks on every mlp.fc."""
    p = get_platform()

    def forward_hook(*_: Any) -> None:
        counts["forward_all"] += 1
        if not is_recomputing():
            counts["forward_once"] += 1

    def backward_hook(*_: Any) -> None:
        counts["backward"] += 1

    for block in module.blocks.values():
        fc = block.mlp.fc
        fc.register_forward_hook(forward_hook)
        if p.name == "torch":
            fc.register_full_backward_hook(backward_hook)
        else:
            fc.register_backward_hook(backward_hook)


def run_act_job(job: ActJob) -> dict[str, Any]:
    """Body of one rank."""
    p = get_platform()
    mod = models(p.name)
    weights = init_gpt_weights(job.config, 0)
    cls, chunks = ACT_SCHEDULES[job.schedule]
    placement = cls.stage_placement(p.world_size, chunks)
    num_stages = len(placement)
    counts = {"forward_all": 0, "forward_once": 0, "backward": 0, "blocks": 0}
    stages = []
    for s in sorted(st for st, r in placement.items() if r == p.rank):
        module = build_stage_module(mod, job, s, num_stages, weights)
        if job.count_hooks:
            _count_hooks(module, counts)
        counts["blocks"] += len(module.blocks)
        stages.append(PipelineStage(module, s, num_stages))
    options = {**SCHEDULE_OPTIONS.get(job.schedule, {}), **job.options}
    schedule = cls(stages if chunks > 1 else stages[0], job.micro, loss_fn=mod.cross_entropy_loss, **options)
    if job.track:
        track_memory(schedule)
    target = p.from_numpy(job.targets) if stages[-1].is_last else None
    losses = schedule.run(p.from_numpy(job.tokens), target=target)
    grads = {name: p.to_numpy(g).copy() for st in stages for name, g in st.named_gradients().items()}
    stats = dataclasses.asdict(memory_stats(schedule)) if job.track or job.options.get("swap") else None
    return {"losses": [[float(p.to_numpy(x)) for x in losses]], "grads": grads, "stats": stats, "hooks": counts,
            "stages": [st.stage_index for st in stages],
            "compute": [None if s is None else str(s) for s in schedule.compute_schedule[schedule.pp_rank]]}
