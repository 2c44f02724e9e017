"""A small decoder-only language model written with mindspore.nn, trained with pipeline parallelism.

The model (token + position embedding, causal self-attention blocks, a head) is one list of Cells that
``split_layers`` cuts into one stage per rank, balanced by parameter count. MindSpore's CPU build has
no point-to-point communication, so on CPU the ranks run inside this process on a ``LocalCluster``::

    python examples/mindspore_decoder.py --ranks 2 --steps 10

On Ascend the same ``train`` function runs as one rank of an ``msrun`` job (HCCL point-to-point)::

    HYPER_PARALLEL_PLATFORM=mindspore msrun --worker_num=4 --local_worker_num=4 --master_port=8118 \\
        --join=True examples/mindspore_decoder.py --launcher msrun

On CPU an ``msrun`` job can still use what MindSpore's CPU build does have, the world-group
collectives: with ``--launcher msrun-dp`` every msrun process is one data-parallel replica that runs
the pipeline on a LocalCluster of ``--ranks`` ranks over its share of the batch, and the replicas
average their gradients with an all-reduce over the msrun world before each optimizer step::

    HYPER_PARALLEL_PLATFORM=mindspore msrun --worker_num=2 --local_worker_num=2 --master_port=8118 \\
        --join=True examples/mindspore_decoder.py --launcher msrun-dp --ranks 2

It prints each rank's stage and, on the last stage's rank (replica 0 with ``msrun-dp``), the loss of
every step.
"""

from __future__ import annotations

import argparse
import json
import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

import hyper_parallel as hp
from hyper_parallel.core.pipeline_parallel.tools.split_layers import split_layers


class Embed(nn.Cell):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = ms.Parameter(ms.Tensor(np.random.default_rng(0).normal(0, 0.02, (1, seq, dim)), ms.float32))

    def construct(self, tokens: ms.Tensor) -> ms.Tensor:
        return self.tok(tokens) + self.pos[:, : tokens.shape[1]]


class Block(nn.Cell):
    """Pre-norm causal self-attention and MLP, both residual."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.ln1, self.ln2 = nn.LayerNorm((dim,)), nn.LayerNorm((dim,))
        self.qkv, self.proj = nn.Dense(dim, 3 * dim), nn.Dense(dim, dim)
        self.fc1, self.fc2 = nn.Dense(dim, 4 * dim), nn.Dense(4 * dim, dim)
        self.mask = ms.Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = ops.split(self.qkv(self.ln1(x)), d, axis=-1)
        q, k, v = (y.reshape(b, t, self.heads, dh).transpose(0, 2, 1, 3) for y in (q, k, v))
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(dh) + self.mask[:t, :t]
        att = ops.matmul(ops.softmax(scores, axis=-1), v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(ops.gelu(self.fc1(self.ln2(x))))


class Head(nn.Cell):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm((dim,)), nn.Dense(dim, vocab)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.out(self.ln(x))


def build_layers(args: argparse.Namespace) -> list[nn.Cell]:
    """The whole model as a list of Cells (every rank builds the same weights)."""
    ms.set_seed(args.seed)
    blocks = [Block(args.dim, 4, args.seq) for _ in range(args.layers)]
    return [Embed(args.vocab, args.dim, args.seq), *blocks, Head(args.dim, args.vocab)]


def next_token_loss(logits: ms.Tensor, target: ms.Tensor) -> ms.Tensor:
    return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int, args: argparse.Namespace) -> tuple[ms.Tensor, ms.Tensor]:
    """Sequences counting up by a random stride from a random start (mod the vocabulary)."""
    rng = np.random.default_rng(1000 + step)
    start = rng.integers(0, args.vocab, (args.batch, 1))
    stride = rng.integers(1, 4, (args.batch, 1))
    text = ((start + stride * np.arange(args.seq + 1)) % args.vocab).astype(np.int32)
    return ms.Tensor(text[:, :-1]), ms.Tensor(text[:, 1:])


def train(args: argparse.Namespace) -> list[float]:
    """One rank's training loop (any launcher); the per-step mean losses on the last stage's rank."""
    platform = hp.get_platform()
    rank, world = platform.rank, platform.world_size
    pieces = split_layers(build_layers(args), world)[rank]  # balanced by parameter count
    module = nn.SequentialCell(pieces)
    stage = hp.PipelineStage(module, rank, world)
    count = sum(p.size for p in module.trainable_params())
    print(f"rank {rank}: stage {rank} = {[type(c).__name__ for c in pieces]} ({count} parameters)", flush=True)
    schedule = hp.Schedule1F1B(stage, args.micro_batches, loss_fn=next_token_loss)
    params = schedule.parameters()
    optimizer = nn.Adam(params, learning_rate=args.lr)
    losses: list[float] = []
    for step in range(args.steps):
        tokens, target = batch(step, args)
        schedule.zero_grad()
        step_losses = schedule.run(tokens, target=target if stage.is_last else None)
        optimizer(tuple(platform.get_grad(p) for p in params))  # MindSpore optimizers take the gradients
        if step_losses:
            losses.append(sum(float(v) for v in step_losses) / len(step_losses))
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses


def pipeline_step(stage_cells: nn.CellList, tokens: ms.Tensor, target: ms.Tensor,
                  args: argparse.Namespace) -> list[float]:
    """One rank of a replica's LocalCluster: run its stage over the replica's share of the batch."""
    rank, world = hp.get_platform().rank, len(stage_cells)
    stage = hp.PipelineStage(stage_cells[rank], rank, world)
    schedule = hp.Schedule1F1B(stage, args.micro_batches, loss_fn=next_token_loss)
    schedule.zero_grad()
    return [float(v) for v in schedule.run(tokens, target=target if stage.is_last else None)]


def train_data_parallel(args: argparse.Namespace) -> list[float]:
    """One data-parallel replica of an msrun job on CPU; the per-step mean losses of the whole batch."""
    from hyper_parallel.platform.local import LocalCluster

    platform = hp.get_platform()  # the msrun world: its collectives run on MindSpore's CPU build
    replica, replicas = platform.rank, platform.world_size
    if args.batch % (replicas * args.micro_batches):
        raise ValueError(f"--batch {args.batch} must split into {replicas} replicas x {args.micro_batches} "
                         "micro-batches")
    # the same weights in every replica; one Cell per pipeline stage, held in a CellList so that every
    # parameter gets a unique name ("<stage>.<layer>.<name>"), which the optimizer requires
    stage_cells = nn.CellList([nn.SequentialCell(piece) for piece in split_layers(build_layers(args), args.ranks)])
    params = stage_cells.trainable_params()
    optimizer = nn.Adam(params, learning_rate=args.lr)
    cluster = LocalCluster(args.ranks, platform="mindspore")
    share = slice(replica * args.batch // replicas, (replica + 1) * args.batch // replicas)
    losses: list[float] = []
    for step in range(args.steps):
        tokens, target = batch(step, args)
        step_losses = cluster.run(pipeline_step, stage_cells, tokens[share], target[share], args)[-1]
        grads = [platform.get_grad(p) for p in params]
        flat = platform.all_reduce(ops.cat([g.reshape(-1) for g in grads]), op="avg")
        sizes = [int(g.size) for g in grads]
        optimizer(tuple(part.reshape(g.shape) for part, g in zip(ops.split(flat, sizes), grads)))
        mean = platform.all_reduce(ms.Tensor([sum(step_losses) / len(step_losses)], ms.float32), op="avg")
        losses.append(float(mean.asnumpy()[0]))
        if replica == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=("local", "msrun", "msrun-dp"), default="local")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks of the LocalCluster (local, msrun-dp)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", default=None, help="write the losses as JSON here")
    args = parser.parse_args(argv)
    if args.launcher == "msrun":
        losses = train(args)
    elif args.launcher == "msrun-dp":
        losses = train_data_parallel(args)
    else:
        from hyper_parallel.platform.local import LocalCluster

        losses = LocalCluster(args.ranks, platform="mindspore").run(train, args)[-1]
    if args.report and losses and (args.launcher == "local" or hp.get_platform().rank == 0):
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({"losses": losses}, f)
    return losses


if __name__ == "__main__":
    main()
