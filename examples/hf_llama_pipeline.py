"""A Hugging Face transformers Llama trained with the interleaved 1F1B schedule (PyTorch, torchrun).

A small random ``LlamaConfig`` (no download). The model's pieces -- embedding, decoder layers, final
norm, head -- form one layer list, which ``split_layers`` cuts into ``ranks x chunks`` consecutive
stages balanced by parameter count. Each stage module keeps the whole model's parameter names
(``model.layers.3.mlp.up_proj.weight``), so checkpoints are keyed like the Hugging Face model::

    torchrun --nproc-per-node 4 examples/hf_llama_pipeline.py --steps 20 --ckpt /tmp/llama_ckpt
    torchrun --nproc-per-node 4 examples/hf_llama_pipeline.py --steps 30 --ckpt /tmp/llama_ckpt --resume

``--steps`` is the total: the second command trains steps 20..29.
The last stage's rank shows a tqdm progress bar with the loss and tokens/s, and every rank prints
its stages (which pieces, how many parameters) at the start.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from torch import nn
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import hyper_parallel as hp
from hyper_parallel.core.pipeline_parallel.tools.profile import timing_caveat
from hyper_parallel.core.pipeline_parallel.tools.split_layers import split_layers


def make_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
    )


def make_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)  # every rank builds the same random model and keeps its stages
    return LlamaForCausalLM(make_config(args))


def layer_list(model: LlamaForCausalLM) -> list[nn.Module]:
    """The model's pieces in the order the forward runs them."""
    return [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids for one step: each sequence counts up from a random start by a random stride (mod the
    vocabulary), something the model can learn. Its own generator: the same on every rank and after a resume."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    text = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class LlamaStage(nn.Module):
    """Consecutive pieces of a ``LlamaForCausalLM``, registered under their names in the whole model."""

    def __init__(self, model: LlamaForCausalLM, pieces: list[nn.Module]) -> None:
        super().__init__()
        names = {id(m): n for n, m in model.named_modules()}
        self.order = [names[id(piece)] for piece in pieces]
        for name, piece in zip(self.order, pieces):
            *path, leaf = name.split(".")
            parent: nn.Module = self
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, piece)
        self._rotary = [model.model.rotary_emb]  # a plain list: no parameters, not part of the stage's state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            piece = self.get_submodule(name)
            if name.startswith("model.layers."):
                positions = torch.arange(x.shape[1], device=x.device)[None]
                # sdpa attention without a mask is causal, as in the whole model's forward
                x = piece(x, position_ids=positions, position_embeddings=self._rotary[0](x, positions))
            else:
                x = piece(x)
        return x


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20,
                        help="total training steps, counted from step 0: with --resume, training goes on from the "
                             "checkpoint's step up to this one (e.g. --steps 30 after a checkpoint at step 20 "
                             "trains steps 20..29)")
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank (interleaved 1F1B)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (written at the end and every --ckpt-every)")
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --ckpt: its step, weights and optimizer state; "
                             "--steps stays the total")
    parser.add_argument("--report", default=None, help="write the losses as JSON here (last stage's rank)")
    args = parser.parse_args(argv)
    if args.resume and not args.ckpt:
        parser.error("--resume needs --ckpt (the folder to continue from)")
    torch.set_num_threads(1)

    platform = hp.get_platform()
    rank, world = platform.rank, platform.world_size
    num_stages = world * args.chunks
    model = make_model(args)
    groups = split_layers(layer_list(model), num_stages)  # balanced by parameter count
    mine = [c * world + rank for c in range(args.chunks)]  # looped placement: stage c*p + r on rank r
    modules = {s: LlamaStage(model, groups[s]) for s in mine}
    for s, module in modules.items():
        count = sum(p.numel() for p in module.parameters())
        print(f"rank {rank} stage {s}: {module.order[0]} .. {module.order[-1]} ({count} parameters)", flush=True)
    stages = [hp.PipelineStage(modules[s], s, num_stages) for s in mine]
    schedule = hp.ScheduleInterleaved1F1B(stages, args.micro_batches, loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(schedule.parameters(), lr=args.lr)

    start = 0
    if args.resume:
        start = hp.load_checkpoint(args.ckpt, schedule, optimizer)["step"]
    is_last = stages[-1].is_last
    losses: list[float] = []
    rates: list[float] = []
    bar = tqdm(range(start, args.steps), desc="llama pp", disable=not is_last, dynamic_ncols=True)
    for step in bar:
        tokens, target = batch(step, args)
        began = time.perf_counter()
        optimizer.zero_grad()
        step_losses = schedule.run(tokens, target=target if is_last else None)
        optimizer.step()
        if step_losses:
            losses.append(sum(float(v) for v in step_losses) / len(step_losses))
            rate = tokens.numel() / (time.perf_counter() - began)
            rates.append(rate)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{rate:.0f}")
        done = step + 1
        if args.ckpt and (done == args.steps or (args.ckpt_every and done % args.ckpt_every == 0)):
            hp.save_checkpoint(args.ckpt, schedule, optimizer, extra={"step": done})
    bar.close()
    report = {"rank": rank, "start": start, "losses": losses}
    if is_last:
        print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start}..{args.steps - 1}"
              if losses else f"rank {rank}: nothing to do: training starts at step {start} and --steps {args.steps} is the total",
              flush=True)
        caveat = timing_caveat(rates)
        if caveat and rates:
            print(caveat, flush=True)  # about the tokens_per_s of the bar
        if args.report:
            with open(args.report, "w", encoding="utf-8") as f:
                json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        # free what the run left in reference cycles (gloo work objects among them) while the process
        # group still lives: gloo aborts a process whose work objects are freed during interpreter exit
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
