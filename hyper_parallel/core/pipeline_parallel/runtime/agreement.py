"""What every pipeline rank must agree on, checked once when a schedule is built.

Each rank describes its own schedule; the descriptions are gathered over the pipeline group
and compared with the first rank's, so every rank reports the same pair of ranks. A mismatch
would otherwise show up as a hang or a wrong gradient in the middle of a run.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform.base import Group, Platform

MUST_MATCH = (
    ("schedule", "schedule class"),
    ("micro_batch_num", "micro_batch_num"),
    ("chunks", "stages per rank"),
    ("stage_num", "stage_num"),
    ("transport", "p2p_transport"),
    ("scale_grads", "scale_grads"),
    ("overlap_p2p", "overlap_p2p"),
    ("overlap_b_f", "overlap_b_f"),
    ("dyn_shape", "dyn_shape"),
    ("has_loss_fn", "whether a loss_fn is given"),
)


def gather_and_check(platform: Platform, group: Group, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """All-gather ``mine`` over ``group``; raise ValueError naming both ranks of the first mismatch."""
    everyone = platform.all_gather_object(mine, group)
    reference = everyone[0]
    for key, what in MUST_MATCH:
        for pp_rank, theirs in enumerate(everyone):
            if theirs[key] != reference[key]:
                raise ValueError(
                    f"pipeline ranks disagree on {what}: rank {group.ranks[0]} has {reference[key]!r} but "
                    f"rank {group.ranks[pp_rank]} has {theirs[key]!r}"
                )
    return everyone
