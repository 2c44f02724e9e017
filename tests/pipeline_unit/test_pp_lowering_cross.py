"""Every built-in schedule's lowering on 4 to 6 ranks, validated without tensors.

What ``PipelineSchedule`` lowers and validates before a run, for every built-in schedule class and
chunk count (v in 1..3 where the class takes it) x p in {4, 5, 6} x sampled micro-batch counts
(the fewest, one past p: a short round, 2p + 1) x transport (plain, batch) x metadata
(``first``: static shapes, ``all``: ``dyn_shape``) x ``overlap_p2p`` (prefetch) on/off. Each
lowering must run to the end on the engine model gloo and LocalCluster follow (``eager``) and, for
``batch``, on the stream model of NCCL/HCCL, where a rank's batched groups run in order and a send
completes only when its receive is posted. Apart from the validator, the messages are checked
directly: every cross-rank message is sent once and received once, in the same order on both
ends of each (sender, receiver, channel), and the compute steps are the compute schedule's.
p <= 3 is crossed with every m in test_pp_lowering_kills.py; every m up to 2p + 1 on 4 to 6 ranks
costs minutes, hence the sampled m here.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import counterpart, lower, peer_rank
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

CLASSES = list(available_schedules().values())  # every built-in schedule class
assert len(CLASSES) == 7, CLASSES
VARIANTS = [(cls, v) for cls in CLASSES for v in (1, 2, 3) if chunk_range(cls)[0] <= v <= chunk_range(cls)[1]]


def micro_counts(cls, p: int, v: int) -> list[int]:
    low = cls.min_microbatches(p, v)
    return sorted({m for m in (low, p + 1, 2 * p + 1) if m >= low})


def messages(lowered, placement) -> dict[tuple[int, int, bool], tuple[list, list]]:
    """(sender, receiver, metadata channel) -> (the sender's messages in program order, the
    receiver's), each message named by its send step."""
    out: dict[tuple[int, int, bool], tuple[list, list]] = defaultdict(lambda: ([], []))
    for rank, steps in lowered.items():
        for step in steps:
            for op in step.comm_parts:
                peer = peer_rank(op, placement)
                if op.meta_type.is_send:
                    out[(rank, peer, op.meta_type.is_meta)][0].append(op)
                else:
                    out[(peer, rank, op.meta_type.is_meta)][1].append(counterpart(op))
    return dict(out)


def check_messages(compute, lowered, placement) -> None:
    for (src, dst, _), (sent, received) in messages(lowered, placement).items():
        assert src != dst
        assert sent == received, f"rank {src} -> rank {dst}: sent {sent}, received in the order {received}"
        assert len(set(sent)) == len(sent), f"rank {src} -> rank {dst}: a message sent twice"
    for rank, steps in lowered.items():
        got = [s for s in steps if not s.meta_type.is_comm]
        assert got == [s for s in compute[rank] if s is not None], f"rank {rank}: compute steps changed"
        for step in steps:
            if step.meta_type is MetaStepType.BATCH_SEND_RECV:
                assert step.comm_parts and all(op.meta_type.is_comm for op in step.comm_parts)
    # every cross-rank forward output and input gradient travels: count them from the compute side
    expected = Counter()
    for rank, steps in compute.items():
        for step in steps:
            for part in (step.parts if step is not None else ()):
                t = part.meta_type
                if t is MetaStepType.FWD and placement.get(part.stage_index + 1, rank) != rank:
                    expected["F"] += 1
                if t in (MetaStepType.BWD, MetaStepType.BWD_INPUT) and placement.get(part.stage_index - 1, rank) != rank:
                    expected["B"] += 1
    sent = Counter()
    for (_, _, meta), (ops, _) in messages(lowered, placement).items():
        for op in ops:
            if not meta:
                sent["F" if op.meta_type is MetaStepType.FWD_SEND else "B"] += 1
    assert sent == expected, (sent, expected)


@pytest.mark.parametrize("p", [4, 5, 6])
@pytest.mark.parametrize("cls, v", VARIANTS, ids=[f"{c.__name__}-v{v}" for c, v in VARIANTS])
def test_every_builtin_lowering_runs_on_both_engine_models(cls, v, p):
    placement = cls.stage_placement(p, v)
    for m in micro_counts(cls, p, v):
        compute = cls.generate(p, v, m)
        for transport in ("plain", "batch"):
            for metadata in ("first", "all"):
                for prefetch in (False, True):
                    what = f"{cls.__name__} p={p} v={v} m={m} {transport} metadata={metadata} prefetch={prefetch}"
                    lowered = lower(compute, placement, transport, metadata=metadata, prefetch=prefetch)
                    try:
                        for engine in ("eager", "stream") if transport == "batch" else ("eager",):
                            validate_lowered(lowered, placement, m, transport, engine=engine)
                        check_messages(compute, lowered, placement)
                    except Exception as exc:
                        raise AssertionError(f"{what}: {exc}") from exc
