"""Section 5 of ``make bench``: the demo's GPT (``hyper_parallel.demo``), tokens per second, ours / torch's.

2 and 4 gloo processes, 1F1B (one stage per rank) and interleaved 1F1B (two per rank), the same
weights and batch for both libraries, the steps of the two alternating; tokens/s = tokens of
the batch / median step time (the slowest rank's end minus the earliest start).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from bench_common import LIBS, alternate_pairs, median
from bench_schedules import build

from hyper_parallel.demo.gpt import GPTConfig, init_gpt_weights
from hyper_parallel.demo.gpt_torch import GPTStage, cross_entropy_loss

CONFIG = GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=8)
MICRO_BATCH = 2
SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B")


def gpt_job(m: int, rounds: int) -> dict:
    world = dist.get_world_size()
    weights = init_gpt_weights(CONFIG)
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, CONFIG.vocab_size, (m * MICRO_BATCH, CONFIG.max_seq_len)))
    targets = torch.from_numpy(rng.integers(0, CONFIG.vocab_size, (m * MICRO_BATCH, CONFIG.max_seq_len)))
    out: dict[str, Any] = {"tokens": int(tokens.numel())}
    for name in SCHEDULES:
        chunks = 2 if name == "ScheduleInterleaved1F1B" else 1

        def make(index: int, chunks: int = chunks) -> torch.nn.Module:
            return GPTStage(CONFIG, index, world * chunks, weights)

        steps = {lib: build(lib, name, make, m, 0, 0, data=(tokens, targets), loss_fn=cross_entropy_loss)[1]
                 for lib in LIBS}
        out[name] = alternate_pairs(steps, rounds, dist.barrier)
    return out


def summarize(per_rank: list[dict], world: int, m: int) -> list[dict]:
    rows = []
    tokens = per_rank[0]["tokens"]
    for name in SCHEDULES:
        med = {}
        for lib in LIBS:
            n = len(per_rank[0][name][lib])
            med[lib] = median([max(r[name][lib][i][1] for r in per_rank) - min(r[name][lib][i][0] for r in per_rank)
                               for i in range(n)])
        rows.append({"processes": world, "schedule": name, "m": m, "tokens_per_step": tokens,
                     "ours_tok_s": tokens / med["ours"], "torch_tok_s": tokens / med["torch"],
                     "ours_over_torch": med["torch"] / med["ours"]})
    return rows
