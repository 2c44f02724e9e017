"""Expert-parallel MoE under interleaved 1F1B with ``overlap_b_f`` (PyTorch, 4 gloo processes).

A (pp=2, ep=2) mesh: two pipelines of two ranks, each rank holding two stages (chunks) of a
small transformer-like model. Every stage is ``--layers`` blocks ``h = x + tanh(mix(x)); out = h
+ sum_e gate_e * expert_e(h)``; the experts of a block live one per rank of the ``ep`` mesh
dimension, so each block sends its tokens to the experts and the expert outputs back with two
all-to-alls over ``ep`` (dispatch and combine; their gradients go the same ways in the
backward). The router is soft (every token goes to every expert, weighted by the router's
softmax), so every all-to-all moves blocks of one fixed size; a top-k router would move fewer
rows in the same pattern.

With ``overlap_b_f`` the steady state's (backward, forward) pairs of different chunks run as one
``OVERLAP_B_F`` step on a ``CommComputeOverlap``: the forward of one micro-batch and the backward
of another take turns on two threads, and each all-to-all is *started* before its side hands
the turn over and *waited for* when the side gets it back, so it is in flight while the other
side computes. Run::

    torchrun --nproc-per-node 4 examples/moe_overlap.py
    torchrun --nproc-per-node 4 examples/moe_overlap.py --width 512 --tokens 1024 --steps 6

Its steps alternate between plain interleaved 1F1B and the same schedule with ``overlap_b_f``
(same stages, same training run; ``--no-compare`` runs every step with the overlap), printing the
loss of every step, and then the all-to-all time per step of each:

- *without overlap* every all-to-all is waited for right after it started: the time spent in
  the all-to-all calls (start plus wait) is the all-to-all time ``A``;
- *with overlap* the time spent in the same calls is what the rank still waits: the exposed
  time ``E``. The hidden time is ``A - E`` (medians over the steps of each mode, the first left
  out). Both include any time a rank waits for its ``ep`` peer to reach the same all-to-all.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel as hp
from hyper_parallel.core.pipeline_parallel.features.overlap import CommComputeOverlap
from hyper_parallel.core.pipeline_parallel.tools.profile import timing_caveat

PP, EP = 2, 2
CHUNKS = 2


class AllToAll:
    """Row blocks ``i`` of a tensor go to rank ``i`` of the ``ep`` group; the blocks received are
    stacked in rank order. ``start`` posts the transfers and returns at once; ``finish`` waits.
    ``seconds`` adds up the time spent in both calls (what the calling rank waits)."""

    def __init__(self, group: Any, ranks: tuple[int, ...], me: int) -> None:
        self.group, self.ranks, self.me = group, ranks, me
        self.seconds = 0.0

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        began = time.perf_counter()
        blocks = x.contiguous().chunk(len(self.ranks), 0)
        out = torch.empty_like(x)
        received = out.chunk(len(self.ranks), 0)
        ops = []
        for block, buffer, peer in zip(blocks, received, self.ranks, strict=True):
            if peer == self.me:
                buffer.copy_(block)
            else:
                ops += [dist.P2POp(dist.isend, block, peer, self.group), dist.P2POp(dist.irecv, buffer, peer, self.group)]
        works = dist.batch_isend_irecv(ops) if ops else []
        self.seconds += time.perf_counter() - began
        return out, works

    def finish(self, works: list[Any]) -> None:
        began = time.perf_counter()
        for work in works:
            work.wait()
        self.seconds += time.perf_counter() - began


class _Pending:
    """The transfers of one exchange still in flight: the forward's, then its gradient's."""

    def __init__(self, a2a: AllToAll) -> None:
        self.a2a = a2a
        self.works: list[Any] = []
        self.grad_works: list[Any] = []


class _Start(torch.autograd.Function):
    """Forward: start the exchange of ``x`` (the result is filled by `_Finish`). Backward: start
    the exchange of the gradient (filled by `_FinishGrad`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: _Pending) -> torch.Tensor:
        ctx.pending = pending
        out, pending.works = pending.a2a.start(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, ctx.pending.grad_works = ctx.pending.a2a.start(grad)
        return out, None


class _Finish(torch.autograd.Function):
    """Forward: wait for the exchange started by `_Start`. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: _Pending) -> torch.Tensor:
        pending.a2a.finish(pending.works)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _FinishGrad(torch.autograd.Function):
    """Forward: identity. Backward: wait for the gradient exchange started by `_Start`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: _Pending) -> torch.Tensor:
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.pending.a2a.finish(ctx.pending.grad_works)
        return grad, None


def _start(x: torch.Tensor, pending: _Pending) -> torch.Tensor:
    return _Start.apply(x, pending)


class MoEBlock(nn.Module):
    """``h = x + tanh(mix(x))``; ``out = h + sum_e gate_e(h) * expert_e(h)`` with expert ``e`` on
    rank ``e`` of the ``ep`` group (this rank holds one expert)."""

    def __init__(self, width: int, hidden: int, a2a: AllToAll | None, overlap: CommComputeOverlap | None,
                 last: bool) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.router = nn.Linear(width, EP)
        self.expert_in = nn.Linear(width, hidden)
        self.expert_out = nn.Linear(hidden, width)
        self.a2a = a2a
        start_dispatch = start_combine = _start
        if overlap is not None:  # sync points around the starts: the turn passes while they are in flight
            start_dispatch = overlap.wrap_dispatch(_start)
            start_combine = overlap.wrap_combine(_start, is_last_layer=last)
        self.start_dispatch, self.start_combine = start_dispatch, start_combine

    def exchange(self, x: torch.Tensor, start: Any) -> torch.Tensor:
        pending = _Pending(self.a2a)
        x = _FinishGrad.apply(x, pending)
        return _Finish.apply(start(x, pending), pending)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.mix(x))
        gate = torch.softmax(self.router(h), dim=-1)
        tokens = self.exchange(h.repeat(EP, 1), self.start_dispatch)  # every token to every expert
        y = self.expert_out(torch.relu(self.expert_in(tokens)))
        back = self.exchange(y, self.start_combine).chunk(EP, 0)  # expert e's outputs of my tokens
        return h + sum(gate[:, e:e + 1] * back[e] for e in range(EP))

    def expert_parameters(self) -> list[nn.Parameter]:
        return [*self.expert_in.parameters(), *self.expert_out.parameters()]


class Stage(nn.Module):
    def __init__(self, blocks: list[MoEBlock]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_stage(index: int, ep_rank: int, width: int, hidden: int, layers: int, a2a: AllToAll | None,
                overlap: CommComputeOverlap | None) -> Stage:
    """Stage ``index``: the same non-expert weights on every ``ep`` rank, this rank's own experts."""
    blocks = [MoEBlock(width, hidden, a2a, overlap, last=k == layers - 1) for k in range(layers)]
    for k, block in enumerate(blocks):
        torch.manual_seed(1000 * index + k)
        for module in (block.mix, block.router):
            module.reset_parameters()
        torch.manual_seed(1000 * index + k + 100 * (ep_rank + 1))
        for module in (block.expert_in, block.expert_out):
            module.reset_parameters()
    return Stage(blocks)


def batch(ep_rank: int, rows: int, width: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This ``ep`` rank's share of step ``step``'s batch (the ``ep`` ranks also split the data)."""
    data = torch.Generator().manual_seed(10_000 * step + ep_rank)
    return torch.randn(rows, width, generator=data), torch.randn(rows, width, generator=data)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def sync_gradients(modules: list[Stage], ep_group: Any) -> None:
    """Data parallel over ``ep``: average the replicated weights' gradients over the ``ep`` ranks;
    the experts' gradients already hold the tokens of every ``ep`` rank (their sum)."""
    for module in modules:
        for block in module.blocks:
            experts = {id(q) for q in block.expert_parameters()}
            for param in block.parameters():
                if param.grad is None:
                    continue
                if id(param) not in experts:
                    dist.all_reduce(param.grad, group=ep_group)
                param.grad /= EP


def setup(args: argparse.Namespace, overlap: CommComputeOverlap | None, baseline: bool = False) -> dict[str, Any]:
    """The mesh, this rank's stages and a schedule (with ``overlap``: overlap_b_f on, the MoE
    layers wrapped). ``baseline`` adds a plain interleaved 1F1B schedule over the same stages (the
    wrapped layers' sync points do nothing there)."""
    mesh = hp.init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    ep_group = mesh.get_torch_group("ep")
    a2a = AllToAll(ep_group, tuple(mesh["ep"].ranks), dist.get_rank())
    indices = [c * PP + pp for c in range(CHUNKS)]
    modules = [build_stage(s, ep, args.width, args.hidden, args.layers, a2a, overlap) for s in indices]
    stages = [hp.PipelineStage(m, s, PP * CHUNKS, mesh=mesh) for m, s in zip(modules, indices, strict=True)]
    schedule = hp.ScheduleInterleaved1F1B(stages, args.micro_batches, loss_fn=loss_fn,
                                          overlap_b_f=overlap is not None, comm_compute_overlap=overlap)
    job = {"mesh": mesh, "pp": pp, "ep": ep, "ep_group": ep_group, "a2a": a2a, "modules": modules,
           "stages": stages, "schedule": schedule}
    if baseline:
        job["baseline"] = hp.ScheduleInterleaved1F1B(stages, args.micro_batches, loss_fn=loss_fn)
    return job


def train(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Train ``args.steps`` steps; with a baseline schedule, the steps alternate between it and the
    overlap_b_f one (so the machine's load hits both alike). Per step and mode: the mean loss (ranks
    of the last stage), the step's wall time and the time spent in all-to-all calls."""
    modes = {"overlap_b_f": job["schedule"]}
    if "baseline" in job:
        modes = {"no overlap": job["baseline"], **modes}
    modules, a2a = job["modules"], job["a2a"]
    optimizer = torch.optim.SGD([q for m in modules for q in m.parameters()], lr=args.lr)
    rows = args.tokens * args.micro_batches
    out: dict[str, list[dict[str, float]]] = {label: [] for label in modes}
    for step in range(args.steps):
        label = list(modes)[step % len(modes)]
        x, y = batch(job["ep"], rows, args.width, step)
        optimizer.zero_grad()
        dist.barrier()
        a2a.seconds = 0.0
        began = time.perf_counter()
        losses = modes[label].run(x, target=y if job["stages"][-1].is_last else None)
        seconds = time.perf_counter() - began
        all_to_all = a2a.seconds
        sync_gradients(modules, job["ep_group"])
        optimizer.step()
        loss = sum(float(v) for v in losses) / len(losses) if losses else float("nan")
        if losses:
            print(f"rank {dist.get_rank()} (pp={job['pp']}, ep={job['ep']}) step {step} [{label}]: loss {loss:.6f}",
                  flush=True)
        out[label].append({"loss": loss, "seconds": seconds, "all_to_all": all_to_all})
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256, help="rows per micro-batch and ep rank")
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks per stage")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-compare", action="store_true",
                        help="every step with overlap_b_f (default: steps alternate with plain interleaved 1F1B)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=None, help="write this rank's numbers as JSON to OUT.rank<r>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    hp.get_platform()  # joins the torchrun job
    job = setup(args, CommComputeOverlap(), baseline=not args.no_compare)
    phases = train(args, job)
    report: dict[str, Any] = {"rank": dist.get_rank(), "phases": phases}
    if len(phases) == 2 and all(phases.values()):
        # the first step of each mode is left out (warm-up) when there are more
        def median(label: str, key: str) -> float:
            rows = phases[label][1:] or phases[label]
            return statistics.median(r[key] for r in rows)

        total, exposed = median("no overlap", "all_to_all"), median("overlap_b_f", "all_to_all")
        hidden = total - exposed
        report.update(all_to_all=total, exposed=exposed, hidden=hidden)
        print(f"rank {dist.get_rank()}: all-to-all per step {total * 1e3:.1f} ms without overlap, "
              f"{exposed * 1e3:.1f} ms exposed with overlap_b_f: {hidden * 1e3:.1f} ms hidden "
              f"({100 * hidden / total if total else 0.0:.0f}%); step {median('no overlap', 'seconds') * 1e3:.0f} ms "
              f"-> {median('overlap_b_f', 'seconds') * 1e3:.0f} ms (medians)", flush=True)
        series = [[r[key] for r in rows] for rows in phases.values() for key in ("seconds", "all_to_all")]
        caveat = timing_caveat(*series)
        if caveat:
            print(f"rank {dist.get_rank()}: {caveat}", flush=True)
    if args.out:
        with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        gc.collect()  # free gloo work objects left in reference cycles while the group lives
        dist.barrier()
        dist.destroy_process_group()
