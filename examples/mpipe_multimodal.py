"""A small vision-encoder + decoder model trained with and without MPipe transposition (PyTorch).

The vision encoder (the *preprocess*: patch embedding and a few MLP layers over random images)
feeds a decoder of transformer layers over [image tokens, text tokens] that predicts the next
text token. Without MPipe, stage 0's rank runs the encoder for every micro-batch; with MPipe every
rank encodes the micro-batches it owns during its warm-up idle time and sends the image tokens to
stage 0's rank. Training steps alternate between the two in one run (the same modules, the same
optimizer), so the step times compare under the same machine load::

    torchrun --nproc-per-node 4 examples/mpipe_multimodal.py --steps 8

Each step prints its mean loss, its wall time and the warm-up time (from the start of the step
until stage 0's rank starts its first backward); the end prints the medians of both modes (the first ``--skip`` steps left out), what
the simulator predicts for the same shape of job, and the warm-up time MPipe saved.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

import hyper_parallel as hp
from hyper_parallel.core.pipeline_parallel.features.mpipe.model import compare_warmup
from hyper_parallel.core.pipeline_parallel.tools.profile import timing_caveat


class VisionEncoder(nn.Module):
    """Images (B, 3, S, S) -> image tokens (B, patches, dim); the text tokens pass through."""

    def __init__(self, image_size: int, patch: int, dim: int, layers: int) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.num_patches = (image_size // patch) ** 2

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, _, _ = images.shape
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        h = self.embed(patches)
        for layer in self.layers:
            h = h + layer(h)
        return h, tokens


class DecoderStage(nn.Module):
    """``layers`` causal transformer layers; stage 0 embeds the text first, the last stage adds the head."""

    def __init__(self, index: int, num_stages: int, dim: int, vocab: int, seq: int, layers: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == num_stages - 1
        self.seq = seq
        if self.first:
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        if self.last:
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            h = torch.cat([h, self.tok(tokens) + self.pos], dim=1)
        n = h.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        for block in self.blocks:
            h = block(h, src_mask=mask)
        if self.last:
            return self.head(self.norm(h[:, -self.seq:]))
        return h


class EncoderThenStage0(nn.Module):
    """Stage 0 of the plain pipeline: the encoder, then decoder stage 0 (the same modules)."""

    def __init__(self, encoder: nn.Module, stage0: nn.Module) -> None:
        super().__init__()
        self.encoder, self.stage0 = encoder, stage0

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.stage0(*self.encoder(images, tokens))


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def warmup_seconds(schedule: hp.PipelineSchedule) -> float | None:
    """Start of stage 0's first backward in the last run (stage 0's rank only; tracer on)."""
    for record in schedule.tracer.records():
        if record["kind"] == "compute" and record["step"].startswith("B.s0."):
            return record["start"]
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps, alternating MPipe on and off")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=2, help="decoder stages per rank (1: 1F1B, more: interleaved)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--encoder-layers", type=int, default=4, help="num_transpose_layers of the preprocess")
    parser.add_argument("--layers-per-stage", type=int, default=1, help="decoder layers per stage")
    parser.add_argument("--owner-backward", action="store_true", help="backpropagate the encoder on its owners")
    parser.add_argument("--freeze-encoder", action="store_true", help="a frozen encoder (no backward, no broadcast)")
    parser.add_argument("--inputs", choices=("global", "owned"), default="owned")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--modes", choices=("both", "mpipe", "plain"), default="both",
                        help="alternate both (default) or run one of them")
    parser.add_argument("--out", help="write the losses and times as JSON here (stage 0's rank)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (one-time costs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    platform = hp.get_platform()
    rank, world = platform.rank, platform.world_size
    num_stages = world * args.chunks
    torch.manual_seed(0)  # every rank builds the same model and keeps its own stages
    encoder = VisionEncoder(args.image_size, args.patch, args.dim, args.encoder_layers)
    encoder.requires_grad_(not args.freeze_encoder)
    decoder = [DecoderStage(s, num_stages, args.dim, args.vocab, args.seq, args.layers_per_stage)
               for s in range(num_stages)]
    mine = [c * world + rank for c in range(args.chunks)]

    def stages(first: nn.Module) -> list[hp.PipelineStage]:
        return [hp.PipelineStage(first if s == 0 else decoder[s], s, num_stages) for s in mine]

    common = dict(loss_fn=next_token_loss, p2p_transport="plain")
    mpipe = hp.ScheduleMPipeTranspose(stages(decoder[0]), args.micro_batches, encoder, args.encoder_layers,
                                      owner_backward=args.owner_backward, inputs=args.inputs, **common)
    plain_cls = hp.ScheduleInterleaved1F1B if args.chunks > 1 else hp.Schedule1F1B
    plain_stages = stages(EncoderThenStage0(encoder, decoder[0]))
    plain = plain_cls(plain_stages if args.chunks > 1 else plain_stages[0], args.micro_batches, **common)
    for schedule in (mpipe, plain):
        schedule.tracer.enabled = True
    params = {id(x): x for x in [*mpipe.parameters(), *plain.parameters()]}
    optimizer = torch.optim.SGD(params.values(), lr=args.lr)

    global_batch = args.micro_batches * args.micro_batch_size
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(global_batch, 3, args.image_size, args.image_size, generator=gen)
    text = torch.randint(0, args.vocab, (global_batch, args.seq + 1), generator=gen)
    tokens, target = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    rows = mpipe.owned_sample_indices(global_batch) if args.inputs == "owned" else list(range(global_batch))

    times: dict[str, list[float]] = {"mpipe": [], "plain": []}
    warmups: dict[str, list[float]] = {"mpipe": [], "plain": []}
    losses: list[tuple[str, float]] = []
    for step in range(args.steps):
        mode = args.modes if args.modes != "both" else "mpipe" if step % 2 == 0 else "plain"
        optimizer.zero_grad()
        if mode == "mpipe" and step > 0 and not args.freeze_encoder:
            mpipe.sync_preprocess()  # the plain step updated the encoder on stage 0's rank only
        platform.barrier()
        start = time.perf_counter()
        if mode == "mpipe":
            out = mpipe.run(images[rows], tokens[rows], target=target)
        else:
            out = plain.run(images, tokens, target=target)
        elapsed = time.perf_counter() - start
        optimizer.step()
        elapsed = max(platform.all_gather_object(elapsed))
        schedule = mpipe if mode == "mpipe" else plain
        warm = warmup_seconds(schedule) if rank == 0 else None
        warm = platform.all_gather_object(warm)[0]
        loss = platform.all_gather_object(float(sum(float(x) for x in out) / len(out)) if out else None)
        loss = next(x for x in loss if x is not None)
        if step >= args.skip:
            times[mode].append(elapsed)
            warmups[mode].append(warm)
        losses.append((mode, loss))
        if rank == 0:
            print(f"step {step:2d} [{mode:5s}] loss {loss:.4f}  step {1000 * elapsed:7.1f} ms  "
                  f"warm-up {1000 * warm:7.1f} ms", flush=True)
    summary = {"losses": losses, "times": times, "warmups": warmups}
    if rank == 0 and times["plain"] and times["mpipe"]:
        med = {k: statistics.median(v) for k, v in times.items()}
        warm = {k: statistics.median(v) for k, v in warmups.items()}
        sim = compare_warmup(world, args.chunks, args.micro_batches, args.encoder_layers,
                             layers_per_stage=args.chunks * args.layers_per_stage, trainable=not args.freeze_encoder,
                             owner_backward=args.owner_backward, inputs=args.inputs)
        print(f"median step time: plain {1000 * med['plain']:.1f} ms, mpipe {1000 * med['mpipe']:.1f} ms "
              f"(ratio {med['mpipe'] / med['plain']:.3f})")
        print(f"median warm-up:   plain {1000 * warm['plain']:.1f} ms, mpipe {1000 * warm['mpipe']:.1f} ms, "
              f"saved {1000 * (warm['plain'] - warm['mpipe']):.1f} ms")
        caveat = timing_caveat(times["plain"], times["mpipe"], warmups["plain"], warmups["mpipe"])
        if caveat:
            print(caveat)
        print("simulated (encoder layer = decoder layer, F = 1 per rank's share): makespan plain "
              f"{sim['plain'].result.makespan:g} mpipe {sim['mpipe'].result.makespan:g}; warm-up plain "
              f"{sim['plain'].warmup_end:g} mpipe {sim['mpipe'].warmup_end:g}")
        summary.update(median_ms={k: 1000 * v for k, v in med.items()},
                       warmup_ms={k: 1000 * v for k, v in warm.items()})
    if rank == 0 and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    platform.barrier()  # no rank leaves while another still talks to it
    return summary


if __name__ == "__main__":
    RESULT = main()
    if torch.distributed.is_initialized():
        gc.collect()  # free gloo work objects left in reference cycles while the group lives
        torch.distributed.destroy_process_group()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Started by torchrun: leave without the interpreter's teardown, in which gloo jobs of this
        # torch build abort now and then ("terminate called without an active exception") after
        # all their work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
